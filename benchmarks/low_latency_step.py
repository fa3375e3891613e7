"""How long the low-latency part's per-step inference takes on one CPU core while the slow policy's inference
runs on another: the robot's case, where the part acts every control tick and a chunk is being computed
meanwhile. ARLI's part must leave the tick its time: the target is a p99 of at most 25% of the control period.

Each measured step does what the robot's node does at a tick: the freshest observation (numpy, as it arrives)
becomes a batch of one, the protocol's context is read, and the part corrects the queue's action
(`PreTrainedPolicy.low_latency_step`). The slow inference runs in a second process pinned to the other core,
in a loop, the whole time (its own latencies are reported too).

Usage: python benchmarks/low_latency_step.py --checkpoint=DIR [--steps=5000] [--control-hz=20] [--out=FILE]
A checkpoint without a low-latency part gets a fresh one (its timing is the same, its actions the slow ones).
The last line printed is ``low_latency_p99_ms=<x> period_share=<y> slow_p50_ms=<z>``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import torch


def _observation(policy, generator: np.random.Generator) -> dict[str, np.ndarray]:
    """A robot's observation of one world, as the node's inputs hold it (numpy, float32)."""
    c = policy.config
    obs = {"observation.state": generator.standard_normal((1, c.state_dim)).astype(np.float32)}
    for cam in c.cameras:
        obs[f"observation.images.{cam}"] = generator.random((1, 3, c.image_size, c.image_size), dtype=np.float32)
    return obs


def _load(checkpoint: str):
    from vla_rl.stages import load_policy

    policy, _ = load_policy(checkpoint)
    if policy.low_latency is None:
        c = policy.config
        policy.add_low_latency(rows=c.horizon, max_age=2 * c.horizon, cameras=list(c.cameras))
    return policy.eval()


def _slow_loop(checkpoint: str, core: int, stop, latencies) -> None:
    """The slow inference on ``core``, chunk after chunk, until ``stop`` is set; its latencies (s) appended."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    policy, generator = _load(checkpoint), np.random.default_rng(1)
    while not stop.is_set():
        obs = {k: torch.from_numpy(v) for k, v in _observation(policy, generator).items()}
        obs["task"] = [policy.config.vocabulary[0] if policy.config.vocabulary else ""]
        start = time.perf_counter()
        with torch.no_grad():
            policy.predict_chunk(obs)
        latencies.append(time.perf_counter() - start)


def measure(checkpoint: str, steps: int, control_hz: float) -> dict:
    from vla_core.runtime.protocol import StepContext

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("this benchmark needs two CPU cores (one for the slow inference, one for the part)")
    context = mp.get_context("spawn")
    stop, latencies = context.Event(), context.Manager().list()
    slow = context.Process(target=_slow_loop, args=(checkpoint, cores[1], stop, latencies), daemon=True)
    slow.start()
    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    policy, generator = _load(checkpoint), np.random.default_rng(0)
    c = policy.config
    rows, a = c.low_latency_rows, c.action_dim
    while len(latencies) < 3:  # the slow loop is running before any step is timed
        time.sleep(0.05)
    times = []
    for step in range(steps + 100):
        obs, plan = _observation(policy, generator), generator.standard_normal((1, rows, a)).astype(np.float32)
        start = time.perf_counter()
        batch = {k: torch.from_numpy(v) for k, v in obs.items()}
        ctx = StepContext(torch.from_numpy(plan), torch.ones(1, rows, dtype=torch.bool),
                          torch.tensor([step % c.low_latency_max_age]), torch.tensor([step % 4]))  # fmt: skip
        policy.low_latency_step(batch, torch.from_numpy(plan[:, 0]), ctx).numpy()
        if step >= 100:  # the first steps warm the allocator and the kernels up
            times.append(time.perf_counter() - start)
    stop.set()
    slow.join(timeout=10)
    ms, slow_ms = np.array(times) * 1e3, np.array(list(latencies)) * 1e3
    period_ms = 1e3 / control_hz
    return {
        "checkpoint": checkpoint, "steps": steps, "control_hz": control_hz, "period_ms": period_ms,
        "low_latency_ms": {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "max": float(ms.max())},
        "period_share_p99": float(np.percentile(ms, 99) / period_ms),
        "slow_ms": {"p50": float(np.percentile(slow_ms, 50)), "p99": float(np.percentile(slow_ms, 99)),
                    "chunks": len(slow_ms)},
        "cores": cores[:2], "torch_threads": 1,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a vla-rl checkpoint (with or without a low-latency part)")
    parser.add_argument("--steps", type=int, default=5000, help="control steps timed")
    parser.add_argument("--control-hz", type=float, default=20.0, help="the robot's control rate")
    parser.add_argument("--out", default="outputs/bench/low_latency_step.json", help="where the JSON goes")
    args = parser.parse_args()
    result = measure(args.checkpoint, args.steps, args.control_hz)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    t = result["low_latency_ms"]
    print(f"low-latency step: p50 {t['p50']:.2f} ms, p99 {t['p99']:.2f} ms, max {t['max']:.2f} ms over {args.steps} "
          f"steps; slow inference meanwhile: p50 {result['slow_ms']['p50']:.1f} ms over {result['slow_ms']['chunks']} "
          f"chunks")  # fmt: skip
    print(
        f"low_latency_p99_ms={t['p99']:.2f} period_share={result['period_share_p99']:.3f} "
        f"slow_p50_ms={result['slow_ms']['p50']:.1f}"
    )


if __name__ == "__main__":
    main()
