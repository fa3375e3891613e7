"""Env-steps/s of the batched simulators against raw mujoco.rollout and gymnasium's AsyncVectorEnv.

The same code as `vla-rl bench sim` (``vla_rl.bench``): every ratio is against a baseline
measured in the same run, on the same model, N and substeps (machines are noisy).

Usage: python benchmarks/sim_throughput.py [--num_envs=[1,16,256]] [--steps=20] [--help]
Writes JSON (default outputs/bench/sim.json); the last line printed is
``sim_overhead_vs_rollout=<x> speedup_vs_gym_async=<y> render_speedup_vs_gym_async=<z>
libero_speedup_vs_lerobot_async=<w>`` (LIBERO rows: their section of `vla_rl.bench`; --libero_task='' skips them).
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":  # the gymnasium workers import this file again; only the parent runs
    sys.exit(main(["bench", "sim", *sys.argv[1:]]))
