"""What a tabletop task and its scripted expert provide, and the action shaping experts share."""

from __future__ import annotations

from typing import Any, Protocol

import mujoco
import numpy as np

from sim.batched_success import WorldArrays


class Task(Protocol):
    """A tabletop task: a scene, a reset distribution, privileged state and a success rule."""

    name: str
    instruction: str  # the language instruction its observations carry (a switching task's first; see below)
    max_episode_steps: int

    def xml_path(self) -> str:
        """The task's scene file (it includes the shared arm and has a ``home`` keyframe)."""
        ...

    def sample_initial_state(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Write a random initial state into ``data`` (then the caller runs mj_forward)."""
        ...

    def privileged_state(self, model: mujoco.MjModel, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """Simulator-only facts a scripted expert needs, name -> array (e.g. ``cube`` (3,))."""
        ...

    def success(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the task's success rule, the one every backend runs (numpy or torch, as ``worlds``)."""
        ...

    # A task may also define ``failure(model, worlds) -> (N,) bool``, read like ``success``: the episode ends there
    # (terminated, no success), e.g. `reach_switch`'s touch of the ball the instruction does not name. And
    # ``instructions_of(model, qpos) -> list[str]`` when the instruction in force is the world's own state.


class Expert(Protocol):
    """A scripted expert for N worlds (built as ``Expert(num_envs)``), with per-world phase state."""

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        """Restart the script in the worlds where ``env_mask`` (N,) bool is True (all if None)."""
        ...

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3), privileged name -> (N, ...) -> actions (N, 4) = [x, y, z, grip]."""
        ...


def step_toward(ee_pos: np.ndarray, goal: np.ndarray, grip: np.ndarray, max_step: float | np.ndarray) -> np.ndarray:
    """Actions (N, 4) that move each end effector at most ``max_step`` metres toward its goal.

    ee_pos, goal: (N, 3); grip: (N,) with 0 open, 1 closed; max_step: scalar or (N,). Capping
    the step keeps the demonstrations smooth enough to imitate.
    """
    delta = goal - ee_pos
    norm = np.linalg.norm(delta, axis=1, keepdims=True)
    max_step = np.broadcast_to(np.asarray(max_step, dtype=np.float64), (len(ee_pos),))[:, None]
    delta *= np.minimum(1.0, max_step / np.maximum(norm, 1e-9))
    return np.concatenate([ee_pos + delta, grip[:, None]], axis=1)
