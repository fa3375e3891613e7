"""A delay beyond the trained one: two delay-trained policies (for D and for 1.5 D) served through `vla-rl serve`
to `vla-rl sim-robot` over ROS 2 at a real inference delay of 1.5 D, so the first is told D (serve's clamp,
counted as ``delay_clamped``) and the second reads the delay it meets.

The same code as `vla-rl bench delay-beyond` (``vla_rl.bench_delay_beyond``, whose docstring states the protocol
and its dated history).

Usage: python benchmarks/delay_beyond.py [--task=track] [--delay=6] [--quick=true] [--help]
Writes outputs/bench/delay_beyond/delay_beyond.json; the last line printed is
``clamp_cost_points=<x> trained_success=<a> matched_success=<b> clamped_fraction=<c> episodes=<n>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "delay-beyond", *sys.argv[1:]]))
