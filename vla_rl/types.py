"""The few shared contracts every part of vla-rl meets at.

Observation batches are plain dicts of tensors with a leading batch dimension and use
LeRobot's feature names, so LeRobot policies and datasets plug in unchanged:

- ``observation.images.<camera>``: float32 in [0, 1], shape (B, C, H, W)
- ``observation.state``: float32, shape (B, S)
- ``task``: list of B instruction strings

Delay augmentation (built by :class:`vla_rl.runtime.ActionChunkExecutor`) adds:

- ``observation.committed_actions``: (B, D_max, A) actions that execute before a new chunk can start
- ``observation.committed_mask``: (B, D_max) bool, True where the row above is a real action
- ``observation.delay_steps``: (B,) long, the inference delay in control steps
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

OBS_STATE = "observation.state"
OBS_IMAGES = "observation.images"
OBS_COMMITTED_ACTIONS = "observation.committed_actions"
OBS_COMMITTED_MASK = "observation.committed_mask"
OBS_DELAY_STEPS = "observation.delay_steps"
TASK = "task"
ACTION = "action"

Observation = dict[str, Any]
"""A batch of observations: tensors with a leading batch dim, plus ``task`` (list[str])."""


def image_key(camera: str) -> str:
    """LeRobot feature name of a camera, e.g. ``observation.images.front``."""
    return f"{OBS_IMAGES}.{camera}"


@dataclass
class ActionChunk:
    """H future actions per batch element.

    actions: (B, H, A) float; ``actions[b, j]`` is meant for control step ``obs_step[b] + j``.
    obs_step: (B,) long; the control step whose observation the chunk was conditioned on.
    """

    actions: torch.Tensor
    obs_step: torch.Tensor

    def __post_init__(self) -> None:
        if self.actions.ndim != 3:
            raise ValueError(f"ActionChunk.actions must be (B, H, A), got shape {tuple(self.actions.shape)}")
        if self.obs_step.shape != self.actions.shape[:1]:
            raise ValueError(
                f"ActionChunk.obs_step must be (B,)={tuple(self.actions.shape[:1])}, got {tuple(self.obs_step.shape)}"
            )

    @property
    def horizon(self) -> int:
        return self.actions.shape[1]


@runtime_checkable
class Policy(Protocol):
    """A policy maps an observation batch to a chunk of future actions."""

    def predict_chunk(self, obs: Observation, obs_step: torch.Tensor | None = None) -> ActionChunk:
        """obs: observation batch of size B; obs_step: (B,) step index (zeros when None)."""
        ...


@runtime_checkable
class BatchedEnv(Protocol):
    """N worlds stepped as one batch, with autoreset.

    ``step`` returns obs, reward (N,), terminated (N,), truncated (N,), info; ``info["success"]``
    is an (N,) bool tensor. After a world terminates or truncates, the returned obs for that
    world is already the first observation of its next episode; the final observation lives in
    ``info["final_obs"]``.
    """

    num_envs: int
    action_dim: int
    device: torch.device

    def reset(self, seed: int | None = None) -> Observation: ...

    def step(
        self, actions: torch.Tensor
    ) -> tuple[Observation, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]: ...
