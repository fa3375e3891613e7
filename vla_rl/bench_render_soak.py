"""`vla-rl bench render-soak`: does the camera renderer crash a long run natively?

Long runs died with SIGSEGV and no Python traceback; their faulthandler logs (``native_crash.log``) showed two
render threads in ``mjr_render`` and ``mjr_readPixels`` at the same moment (`sim.render.ParallelRenderers`, Mesa's
llvmpipe), during fine-tuning and its periodic evaluations. The soak repeats that pattern for as long as it takes:

- a training batch of ``num_envs`` worlds (lift, the camera rendered every step on ``render_threads`` renderers)
  stepped with random end-effector moves;
- every ``evaluate_every`` of its steps, an evaluation batch of ``eval_envs`` worlds made, stepped
  ``eval_steps`` steps and closed, as a periodic evaluation does;
- in segments of ``segment_minutes``, each a child process of this one (``python -m vla_rl.bench_render_soak``)
  with Python's faulthandler writing ``native_crash_<k>.log``: a native crash ends its segment, this process
  counts it (the child died by a signal) and starts the next, until ``frames`` frames are rendered.

``--render_isolation`` picks the renderer (`sim.config.EnvConfig.render_isolation`): ``thread``, the design the
crashes came from, or ``process``, render worker processes (a worker's crash is counted in ``worker_restarts``
and costs the run nothing; a crash of the run itself is ``native_crashes``). Resumable: the totals are in
``<output_dir>/soak.json``, each segment's progress in ``segment.json`` (saved every few seconds), so a killed
soak loses at most those seconds. The final line: ``native_crashes=<n> frames=<n> minutes=<m>
worker_restarts=<k> render_isolation=<thread|process>``.

Protocol history:

- 2026-12-07: the first version. The issue's targets: on the design that ships, ``native_crashes=0`` over at
  least 2,000,000 frames, with the same soak of today's threads beside it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sim.config import RenderIsolation
from vla_core.crash_log import CRASH_SIGNALS, exit_cause
from vla_core.files import write_text_atomic


@dataclass
class BenchRenderSoakConfig:
    """Render for hours the way a fine-tuning run with periodic evaluations does, counting native crashes."""

    render_isolation: RenderIsolation = "process"  # thread (the design the crashes came from) or process
    frames: int = 2_000_000  # camera frames to render in all (training and evaluation batches)
    num_envs: int = 16  # worlds of the training batch
    eval_envs: int = 50  # worlds of each evaluation batch
    evaluate_every: int = 200  # training steps between evaluations
    eval_steps: int = 20  # steps of each evaluation batch before it is closed
    image_size: int = 64
    render_threads: int = 0  # renderers per batch (`EnvConfig.render_threads`); 0 = one per CPU core
    segment_minutes: float = 10.0  # each child process runs this long (or until it crashes)
    seed: int = 0
    output_dir: str = "outputs/bench/render_soak"  # the soak of each --render_isolation goes to <output_dir>/<it>
    quick: bool = False  # a toy soak (1,000 frames, 15 s segments) to check the loop end to end


def bench_render_soak(cfg: BenchRenderSoakConfig) -> dict[str, Any]:
    """Run (or resume) the soak in ``<output_dir>/<render_isolation>``; returns its report (also ``soak.json``)."""
    from vla_rl.bench_stages import RunClock

    if cfg.frames < 1 or cfg.num_envs < 1 or cfg.eval_envs < 1 or cfg.segment_minutes <= 0:
        raise ValueError("--frames, --num_envs and --eval_envs must be >= 1 and --segment_minutes > 0")
    if cfg.quick:
        cfg = BenchRenderSoakConfig(**{**asdict(cfg), "frames": 1000, "num_envs": 4, "eval_envs": 4,
                                       "evaluate_every": 20, "eval_steps": 5, "segment_minutes": 0.25})  # fmt: skip
    out = Path(cfg.output_dir) / cfg.render_isolation
    out.mkdir(parents=True, exist_ok=True)
    state_file, segment_file = out / "soak.json", out / "segment.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    if state and state["config"] != asdict(cfg):
        raise ValueError(f"{state_file} is a soak of other settings ({state['config']}); resume it with them or "
                         "choose another --output_dir")  # fmt: skip
    state = state or {"config": asdict(cfg), "frames": 0, "native_crashes": 0, "worker_restarts": 0, "segments": []}
    clock = RunClock(out / "run_clock.json")
    while True:
        k = len(state["segments"])  # the next segment's index; a segment file is counted once, under its index
        if segment_file.is_file() and json.loads(segment_file.read_text()).get("segment") == k:
            _absorb(state, json.loads(segment_file.read_text()), None)  # cut with this process: no exit code
            write_text_atomic(state_file, json.dumps(state, indent=2))
            continue
        if state["frames"] >= cfg.frames:
            break
        child = subprocess.run(
            [sys.executable, "-m", "vla_rl.bench_render_soak", json.dumps(asdict(cfg)), str(segment_file),
             str(out / f"native_crash_{k}.log"), str(k), str(cfg.seed + k)],
            check=False,  # a segment's death by a signal is what the soak counts, not an error
        )  # fmt: skip
        saved = json.loads(segment_file.read_text()) if segment_file.is_file() else {}
        progress = saved if saved.get("segment") == k else {"segment": k, "frames": 0}
        _absorb(state, progress, child.returncode)
        write_text_atomic(state_file, json.dumps(state, indent=2))  # before anything can stop the soak
        if child.returncode < 0:
            how = "native crash" if state["segments"][-1]["native_crash"] else "killed"
            print(f"segment {k}: {how} ({exit_cause(child.returncode)}) after {progress['frames']} frames; its "
                  f"log: {out / f'native_crash_{k}.log'}", file=sys.stderr)  # fmt: skip
        elif child.returncode != 0:
            raise RuntimeError(f"soak segment {k} failed with exit code {child.returncode} (a Python error: see above)")
        print(f"soak {cfg.render_isolation}: {state['frames']:,}/{cfg.frames:,} frames, "
              f"{state['native_crashes']} native crashes, {state['worker_restarts']} worker restarts", flush=True)  # fmt: skip
    report = {**state, "minutes": clock.stop(), "render_isolation": cfg.render_isolation}
    write_text_atomic(state_file, json.dumps(report, indent=2))
    return report


def _absorb(state: dict[str, Any], progress: dict[str, Any], returncode: int | None) -> None:
    """Add one segment's progress to the totals; a death by a crash signal (`CRASH_SIGNALS`) is a native crash."""
    crashed = returncode is not None and returncode < 0 and -returncode in CRASH_SIGNALS
    state["frames"] += progress.get("frames", 0)
    state["worker_restarts"] += progress.get("worker_restarts", 0)
    state["native_crashes"] += int(crashed)
    state["segments"].append({**progress, "returncode": returncode, "native_crash": crashed})


def format_summary(report: dict[str, Any]) -> str:
    return (f"native_crashes={report['native_crashes']} frames={report['frames']} minutes={report['minutes']:.1f} "
            f"worker_restarts={report['worker_restarts']} render_isolation={report['render_isolation']}")  # fmt: skip


def soak_segment(cfg: BenchRenderSoakConfig, progress_file: Path, segment: int, seed: int) -> None:
    """One segment (the child process): train-like stepping with periodic evaluation batches for
    ``cfg.segment_minutes``, its frames saved to ``progress_file`` every few seconds."""
    import numpy as np
    import torch

    from sim.config import EnvConfig
    from sim.factory import make_env

    def env_config(n: int) -> EnvConfig:
        return EnvConfig(task="lift", num_envs=n, image_size=cfg.image_size, render_threads=cfg.render_threads,
                         render_isolation=cfg.render_isolation, num_threads=1)  # fmt: skip

    rng = np.random.default_rng(seed)

    def moves(env) -> torch.Tensor:  # random end-effector targets near the arm's, grip open or closed
        ee = env.ee_positions()
        grip = rng.integers(0, 2, (len(ee), 1)).astype(np.float64)
        return torch.from_numpy(np.concatenate([ee + rng.uniform(-0.03, 0.03, ee.shape), grip], axis=1))

    frames, closed_restarts = 0, 0  # frames rendered; worker restarts of the evaluation batches closed so far
    saved_at, end = time.monotonic(), time.monotonic() + 60 * cfg.segment_minutes

    def save(train) -> None:
        restarts = closed_restarts + train.render_restarts
        write_text_atomic(progress_file, json.dumps({"segment": segment, "frames": frames, "worker_restarts": restarts,
                                                     "seed": seed}))  # fmt: skip

    with make_env(env_config(cfg.num_envs)) as train:
        train.reset(seed=seed)
        step = 0
        while time.monotonic() < end:
            train.step(moves(train))
            frames += cfg.num_envs
            step += 1
            if step % cfg.evaluate_every == 0:
                with make_env(env_config(cfg.eval_envs)) as evaluation:
                    evaluation.reset(seed=seed + step)
                    for _ in range(cfg.eval_steps):
                        evaluation.step(moves(evaluation))
                        frames += cfg.eval_envs
                    closed_restarts += evaluation.render_restarts
            if time.monotonic() - saved_at > 5:
                save(train)
                saved_at = time.monotonic()
        save(train)


if __name__ == "__main__":  # a segment: python -m vla_rl.bench_render_soak <config> <progress> <crash log> <k> <seed>
    from vla_core.lifetime import exit_with_parent

    exit_with_parent(os.getppid())  # a soak killed with SIGKILL leaves no segment running on
    config, progress_path, crash_log, segment_index, segment_seed = sys.argv[1:6]
    with open(crash_log, "w") as log:
        faulthandler.enable(log, all_threads=True)
        soak_segment(BenchRenderSoakConfig(**json.loads(config)), Path(progress_path), int(segment_index),
                     int(segment_seed))  # fmt: skip
