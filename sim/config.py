"""Configuration of the batched simulated environments (no simulator import here)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EnvConfig:
    """A batch of simulated worlds running one task."""

    task: str = "lift"  # task name; see `sim.tasks.TASKS`
    num_envs: int = 16  # worlds stepped as one batch
    image_size: int = 64  # square camera image side, pixels
    cameras: list[str] = field(default_factory=lambda: ["front"])  # MJCF camera names rendered each step
    substeps: int = 25  # physics steps per control step (0.002 s each: 20 Hz control)
    num_threads: int = 0  # physics threads; 0 = one per CPU core
    max_episode_steps: int = 0  # 0 = the task's own limit
