"""Instructions that change mid-task (SwitchVLA): replanning through the latency protocol against the next-chunk
rule, on `reach_switch` at a fixed inference delay.

The same code as `vla-rl bench switch` (``vla_rl.bench_switch``); the protocol is ``benchmarks/switch_2026-12-07.md``.

Usage: python benchmarks/instruction_switch.py [--quick=true] [--seeds=[0,1]] [--help]
Writes outputs/bench/switch/switch.json (pooled.json with --seeds); the last line printed is
``replan_success=<x> next_chunk_success=<y> replan_over_next_chunk=<r> median_reaction_replan=<m>
median_reaction_next_chunk=<n> episodes=<k>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "switch", *sys.argv[1:]]))
