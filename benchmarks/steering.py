"""Steering a frozen flow policy out of distribution: latent steering (RL², gated and always) and noise-space
steering (DSRL) against the base policy, in distribution and under two variations of the task.

The same code as `vla-rl bench steering` (``vla_rl.bench_steering``, whose docstring names the task and the
variations and states the protocol).

Usage: python benchmarks/steering.py [--quick=true] [--eval_episodes=100] [--help]
Writes outputs/bench/steering/steering.json and steering.png; the last line printed is
``gated_gain_ood=<points> gated_loss_id=<points> dsrl_gain_ood=<points>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "steering", *sys.argv[1:]]))
