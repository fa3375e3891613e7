"""The latency benchmarks' calibration on tasks with surprises: the task and the delay chosen from the
baseline arms alone (plain imitation under delay, no-delay PPO, naive PPO under delay), by the protocol
of ``delay_calibration_2026-12-02.md`` beside this file.

The same code as `vla-rl bench delay-calibration` (``vla_rl.bench_delay_calibration``).

Usage: python benchmarks/delay_calibration.py [--quick=true] [--output_dir=...] [--help]
Writes outputs/bench/delay_calibration/calibration.json; the last line printed is
``task=<t> delay=<D> plain_loss_points=<x> naive_over_standard=<y>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "delay-calibration", *sys.argv[1:]]))
