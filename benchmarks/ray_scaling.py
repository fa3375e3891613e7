"""Asynchronous Ray rollouts on a real two-node cluster started on this machine: the same PPO env-step budget
collected synchronously and asynchronously, one rollout worker killed mid-run in the asynchronous arm.

The same code as `vla-rl bench ray` (``vla_rl.bench_ray``, whose docstring states the protocol and its dated history).

Usage: python benchmarks/ray_scaling.py [--quick=true] [--env_steps=20000] [--nodes=2] [--help]
Writes outputs/bench/ray/ray.json and each arm's ray_timeline.json; the last line printed is
``async_over_sync=<ratio> nodes=<n> worker_restarts=<k> lost_rollouts=<m>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ray", *sys.argv[1:]]))
