"""`vla-rl eval` against LeRobot's own LIBERO evaluator, step by step, on the same tasks, initial states,
worlds and seeded policy.

The same code as `vla-rl bench libero` (``vla_rl.bench_libero``, whose docstring states the protocol and its
dated history).

Usage: python benchmarks/libero_eval.py [--quick=true] [--task_ids='[0,1]'] [--worlds=2] [--help]
Writes outputs/bench/libero/libero_eval.json; the last line printed is
``state_agreement=<x> outcome_agreement=<y> throughput_ratio=<z>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "libero", *sys.argv[1:]]))
