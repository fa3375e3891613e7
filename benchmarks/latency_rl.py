"""Latency-aware RL (ARLI) on this machine: naive PPO under inference delay against ARLI's low-latency policy
(a small part acting every control step on the freshest observation, trained by RL per step) and against PPO
whose policy reads the committed actions and a mid-inference observation (``mid_head``), with no-delay PPO,
training-time RTC and the scripted expert's ceiling per timeline alongside.

The same code as `vla-rl bench latency-rl` (``vla_rl.bench_latency_rl``, whose docstring states the protocol and its dated history).

Usage: python benchmarks/latency_rl.py [--quick=true] [--env_steps=36000] [--eval_episodes=100] [--help]
Writes outputs/bench/latency_rl/latency_rl.json and latency_rl.png; the last line printed is
``latency_aware_over_naive=<x> latency_aware_over_nodelay=<y> nodelay_gain=<p>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "latency-rl", *sys.argv[1:]]))
