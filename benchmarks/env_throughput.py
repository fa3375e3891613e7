"""Control steps per second of the batched lift env, against a plain sequential MuJoCo loop.

Both sides step the same model, the same number of worlds and the same 25 physics substeps per
control step, in the same run (machines are noisy, so only the ratio is meaningful):

- baseline: a Python loop calling ``mujoco.mj_step`` on each world in turn (one core);
- ours: ``MujocoBatchedEnv.step`` (IK controller + ``mujoco.rollout`` threads), physics only
  (no camera) and with the 64x64 camera rendered every step.

Usage: python benchmarks/env_throughput.py [--num_envs 16] [--steps 100]
Writes JSON to stdout; the last line is ``batched_vs_sequential=<x> with_render_vs_sequential=<y>``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("MUJOCO_GL", "egl")

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sim.config import EnvConfig  # noqa: E402
from sim.mujoco_env import MujocoBatchedEnv  # noqa: E402


def sequential_steps_per_s(env: MujocoBatchedEnv, steps: int) -> float:
    datas = [mujoco.MjData(env.model) for _ in range(env.num_envs)]
    for d, src in zip(datas, env.data):
        d.qpos[:], d.ctrl[:] = src.qpos, src.ctrl
    start = time.perf_counter()
    for _ in range(steps):
        for d in datas:
            for _ in range(env.config.substeps):
                mujoco.mj_step(env.model, d)
    return steps * env.num_envs / (time.perf_counter() - start)


def batched_steps_per_s(env: MujocoBatchedEnv, steps: int, render: bool) -> float:
    env.reset(seed=0)
    hold = torch.from_numpy(np.concatenate([env.ee_positions(), np.zeros((env.num_envs, 1))], axis=1))
    observe = env._observe
    if not render:  # physics, IK and state only: skip the camera
        env._observe = lambda: {}
    start = time.perf_counter()
    for _ in range(steps):
        env.step(hold)
    elapsed = time.perf_counter() - start
    env._observe = observe
    return steps * env.num_envs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    with MujocoBatchedEnv(EnvConfig(num_envs=args.num_envs, max_episode_steps=10**6)) as env:
        env.reset(seed=0)
        seq = sequential_steps_per_s(env, args.steps)
        phys = batched_steps_per_s(env, args.steps, render=False)
        full = batched_steps_per_s(env, args.steps, render=True)
    result = {
        "num_envs": args.num_envs,
        "substeps": env.config.substeps,
        "cpu_count": os.cpu_count(),
        "sequential_control_steps_per_s": round(seq, 1),
        "batched_physics_control_steps_per_s": round(phys, 1),
        "batched_with_render_control_steps_per_s": round(full, 1),
    }
    print(json.dumps(result, indent=2))
    print(f"batched_vs_sequential={phys / seq:.2f} with_render_vs_sequential={full / seq:.2f}")


if __name__ == "__main__":
    main()
