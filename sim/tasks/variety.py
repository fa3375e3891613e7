"""Demonstrations that vary within the training workspace: any scripted expert, made less uniform.

A scripted expert does the same thing from the same state, so a policy imitating it learns one mode and a
sampler drawing from that policy has almost nothing to choose among (steering a frozen base needs "diversity
beyond dominant demonstration modes", RL²). `VariedExpert` wraps an expert and, per episode of each world,
draws three things from its own stream:

- an **approach detour**: a constant offset of up to ``detour`` metres per axis (z only upward) added to the
  expert's position target, fading linearly to nothing over the episode's first ``detour_steps`` steps, so the
  hand takes a different path to the same place (the expert is closed loop and corrects what remains);
- a **pace**: the step the expert asked for, scaled by a factor uniform in [``pace_low``, 1];
- per-step **noise**: Gaussian, ``noise`` metres per axis, on the position target.

The grip is never changed, so the expert's phases run as written. Everything is 0 (or 1) by default: the
wrapped expert exactly. The recording keeps its settings (`vla_rl.record`'s ``variety``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.arm import ACTION_HIGH, ACTION_LOW


@dataclass
class ExpertVariety:
    """Per-episode variety of a recorded expert (the defaults: none, the expert as written)."""

    detour: float = 0.0  # metres per axis of the approach detour's offset (z only upward); 0 = none
    detour_steps: int = 15  # control steps over which the detour fades to nothing
    pace_low: float = 1.0  # each episode's steps scaled by U[pace_low, 1]; 1 = the expert's pace
    noise: float = 0.0  # metres, std of the Gaussian noise on each step's position target

    def __post_init__(self) -> None:
        if self.detour < 0 or self.noise < 0 or self.detour_steps < 1 or not 0 < self.pace_low <= 1:
            raise ValueError(
                f"--variety: detour and noise must be >= 0, detour_steps >= 1 and pace_low in (0, 1], got {self}"
            )

    @property
    def active(self) -> bool:
        return self.detour > 0 or self.noise > 0 or self.pace_low < 1


class VariedExpert:
    """``expert`` (any scripted expert: ``act(ee_pos, privileged)`` -> (N, 4) targets, ``reset(mask)``) with
    ``variety``, drawn from ``np.random.default_rng(seed)``: the same seed gives the same demonstrations."""

    def __init__(self, expert, variety: ExpertVariety, num_envs: int, seed: int):
        self.expert, self.variety = expert, variety
        self.rng = np.random.default_rng(seed)
        self.offset = np.zeros((num_envs, 3))
        self.pace = np.ones(num_envs)
        self.step = np.zeros(num_envs, dtype=np.int64)
        self._draw(np.ones(num_envs, dtype=bool))

    def _draw(self, mask: np.ndarray) -> None:
        n, v = int(mask.sum()), self.variety
        offset = self.rng.uniform(-v.detour, v.detour, size=(n, 3))
        offset[:, 2] = np.abs(offset[:, 2])  # never down into the table
        self.offset[mask] = offset
        self.pace[mask] = self.rng.uniform(v.pace_low, 1.0, size=n)
        self.step[mask] = 0

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        mask = np.ones(len(self.step), dtype=bool) if env_mask is None else np.asarray(env_mask, dtype=bool)
        self.expert.reset(env_mask)
        self._draw(mask)

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3) -> actions (N, 4): the expert's, its position target moved as the episode's draws say."""
        actions = np.array(self.expert.act(ee_pos, privileged), dtype=np.float64)
        fade = np.clip(1.0 - self.step / self.variety.detour_steps, 0.0, 1.0)[:, None]
        step = (actions[:, :3] - ee_pos) * self.pace[:, None]
        noise = self.rng.normal(0.0, self.variety.noise, size=step.shape) if self.variety.noise > 0 else 0.0
        # the workspace's bounds, as the env would clip it: the dataset keeps what the arm was asked to do
        actions[:, :3] = np.clip(ee_pos + step + fade * self.offset + noise, ACTION_LOW[:3], ACTION_HIGH[:3])
        self.step += 1
        return actions
