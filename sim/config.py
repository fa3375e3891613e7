"""Configuration of the batched simulated environments (no simulator import here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Backend = Literal["cpu", "warp"]


@dataclass
class EnvConfig:
    """A batch of simulated worlds running one task."""

    # Task name: a MuJoCo tabletop task (`sim.tasks.TASKS`), a LIBERO suite or task (libero_spatial,
    # libero_spatial/3; `sim.libero_env`) or a robosuite task (robosuite/Lift; `sim.robosuite_env`).
    task: str = "lift"
    # Physics backend. cpu = MuJoCo with mujoco.rollout threads; warp = MuJoCo Warp, all worlds
    # in one process on `device` (needs the `gpu` extra). See `sim.factory.make_env`.
    backend: Backend = "cpu"
    device: str = "cpu"  # torch device of the observations; the cpu backend runs on "cpu" only
    num_envs: int = 16  # worlds stepped as one batch
    image_size: int = 64  # square camera image side, pixels
    # Cameras rendered each step, as named in the observation.images.<camera> keys; empty = physics
    # only (no images). MJCF camera names, except LIBERO's: image (agentview) and image2 (wrist).
    cameras: list[str] = field(default_factory=lambda: ["front"])
    substeps: int = 25  # physics steps per control step (0.002 s each: 20 Hz control)
    num_threads: int = 0  # physics threads; 0 = one per CPU core
    max_episode_steps: int = 0  # 0 = the task's own limit
