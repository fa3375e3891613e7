"""Success under inference delay: a policy trained with the delay augmentation (training-time RTC)
against a plain one, trained identically, on a task whose world moves while the policy thinks.

The same code as `vla-rl bench delay` (``vla_rl.bench_delay``, whose docstring states the protocol and its dated history).

Usage: python benchmarks/delay_robustness.py [--quick=true] [--episodes=100] [--delays=[0,2,4,6,8]] [--help]
Writes outputs/bench/delay/delay.json and delay.png; the last line printed is
``augmented_over_plain=<x> augmented_at_zero_delay=<s> plain_at_zero_delay=<s>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "delay", *sys.argv[1:]]))
