"""RL fine-tuning on this machine: PPO and GRPO each improve the same imitation checkpoint on the same
env-step budget, judged on held-out evaluation episodes.

The same code as `vla-rl bench rl` (``vla_rl.bench_rl``, whose docstring states the protocol and its dated history).

Usage: python benchmarks/rl_finetune.py [--quick=true] [--env_steps=150000] [--eval_episodes=100] [--help]
Writes outputs/bench/rl/rl.json and each run's success.png; the last line printed is
``ppo_gain=<points> grpo_gain=<points> env_steps=<n> minutes=<m>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "rl", *sys.argv[1:]]))
