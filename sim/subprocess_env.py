"""N Gymnasium envs in subprocess workers behind the batched-env contract (`vla_rl.types.BatchedEnv`).

For simulators that own their MuJoCo model, renderer and Python state per world (robosuite and
LIBERO): each world runs in its own worker process of a Gymnasium ``AsyncVectorEnv`` (forkserver
start, so every worker makes its own EGL context instead of inheriting the parent's). This module
adds what the contract asks on top of Gymnasium:

- actions (N, A) are sanitized in the parent: a row with NaN or inf becomes the hold action
  (:meth:`SubprocessBatchedEnv.hold_actions`) and is flagged in ``info["invalid_actions"]``;
  finite values outside the action space are clipped and flagged in ``info["clipped_actions"]``;
- episodes end at ``max_episode_steps`` (truncated) or on success (terminated), and the world
  resets in the same step: the returned observation is the next episode's first, the last one is
  in ``info["final_obs"]``, ``info["success"]`` (N,) bool is the success of the step just taken;
- observations are a dict of torch tensors under LeRobot's feature names plus ``task``, made by
  the caller's ``process_obs`` from the raw batched observation.

Worlds report success in their step info as ``is_success`` (LeRobot's convention) and reset with
``{"is_success": False}``. Workers start by re-importing the main module, so a script that builds
one of these envs needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F

from vla_rl.types import TASK, image_key

RawObs = dict[str, Any]  # a (nested) dict of numpy arrays with a leading batch dim
ProcessObs = Callable[[RawObs], dict[str, torch.Tensor]]


def _time_limited(make_world: Callable[[], gym.Env], max_episode_steps: int) -> gym.Env:
    return gym.wrappers.TimeLimit(make_world(), max_episode_steps=max_episode_steps)


def _copy_tree(batch: RawObs) -> RawObs:
    return {k: _copy_tree(v) if isinstance(v, dict) else v.copy() for k, v in batch.items()}


def _write_row(batch: RawObs, row: RawObs, i: int) -> None:
    """batch[...][i] = row[...], for every leaf of the nested observation dict."""
    for k, v in row.items():
        if isinstance(v, dict):
            _write_row(batch[k], v, i)
        else:
            batch[k][i] = v


class SubprocessBatchedEnv:
    """Batched env over N worker processes; one Gymnasium env (one world) per worker.

    Args:
        make_worlds: N picklable zero-argument callables, each building one world's env (called
            in its worker; ``make_worlds[0]`` is also called once in the parent to read the spaces,
            so it must not start a simulator before ``reset``).
        process_obs: raw batched observation -> ``observation.*`` tensors with a leading dim N.
        instructions: N instruction strings, the ``task`` of each world.
        max_episode_steps: steps after which an episode is truncated.
        cameras: the camera names of the ``observation.images.<camera>`` keys, for :meth:`render`.
        control_dt: seconds per step.
    """

    def __init__(
        self,
        make_worlds: Sequence[Callable[[], gym.Env]],
        process_obs: ProcessObs,
        instructions: Sequence[str],
        max_episode_steps: int,
        cameras: Sequence[str],
        control_dt: float,
    ):
        if len(instructions) != len(make_worlds):
            raise ValueError(f"{len(make_worlds)} worlds need {len(make_worlds)} instructions, got {len(instructions)}")
        self.num_envs = len(make_worlds)
        self.instructions = list(instructions)
        self.max_episode_steps = max_episode_steps
        self.cameras = list(cameras)
        self.control_dt = control_dt
        self.device = torch.device("cpu")
        self._process_obs = process_obs
        self._vector = gym.vector.AsyncVectorEnv(
            [partial(_time_limited, make, max_episode_steps) for make in make_worlds],
            context="forkserver",
            shared_memory=True,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        space = self._vector.single_action_space
        self.action_dim = int(space.shape[0])
        self.action_low = space.low.astype(np.float64)
        self.action_high = space.high.astype(np.float64)
        self.episode_step = np.zeros(self.num_envs, dtype=np.int64)
        self._gripper = np.full(self.num_envs, -1.0)  # last gripper command per world (-1 = open)
        self._last_obs: dict[str, Any] = {}

    # -- public API --------------------------------------------------------------------------

    def reset(self, seed: int | None = None) -> dict[str, Any]:
        """Reset every world (world i gets seed ``seed + i``); returns the first observations."""
        raw, _ = self._vector.reset(seed=seed)
        self.episode_step[:] = 0
        self._gripper[:] = -1.0
        return self._observe(raw)

    def step(self, actions: torch.Tensor | np.ndarray):
        """actions (N, A) -> obs, reward (N,), terminated (N,), truncated (N,), info.

        reward is 1.0 on the step that succeeds, else 0.0 (the benchmarks' sparse reward).
        """
        act = torch.as_tensor(actions, dtype=torch.float64).detach().cpu().numpy().copy()  # (N, A), ours to edit
        if act.shape != (self.num_envs, self.action_dim):
            raise ValueError(f"actions must have shape ({self.num_envs}, {self.action_dim}), got {act.shape}")
        invalid = ~np.isfinite(act).all(axis=1)
        act[invalid] = self.hold_actions().double().numpy()[invalid]
        clipped = ((act < self.action_low) | (act > self.action_high)).any(axis=1)
        act = np.clip(act, self.action_low, self.action_high)
        self._gripper = act[:, -1].copy()

        raw, _, terminated, truncated, info = self._vector.step(act.astype(np.float32))
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool) & ~terminated
        done = terminated | truncated
        success = np.asarray(info["is_success"], dtype=bool).copy()  # reset info (False) where done
        obs = final_obs = self._observe(raw)
        if done.any():  # Gymnasium hands back the done worlds' last observations one by one
            success[done] = np.asarray(info["final_info"]["is_success"], dtype=bool)[done]
            final_raw = _copy_tree(raw)
            for i in np.flatnonzero(done):
                _write_row(final_raw, info["final_obs"][i], i)
            final_obs = self._process(final_raw)
        self.episode_step += 1
        self.episode_step[done] = 0
        self._gripper[done] = -1.0
        info_out = {
            "success": torch.from_numpy(success),
            "invalid_actions": torch.from_numpy(invalid),
            "clipped_actions": torch.from_numpy(clipped),
            "final_obs": final_obs,
        }
        reward = torch.from_numpy(success.astype(np.float32))
        return obs, reward, torch.from_numpy(terminated), torch.from_numpy(truncated), info_out

    def hold_actions(self) -> torch.Tensor:
        """(N, A) actions that hold every arm still: zero end-effector deltas, gripper as last commanded.

        For the delta end-effector (OSC) controllers of robosuite and LIBERO a zero pose delta is
        "stay"; the last dimension is the gripper (-1 open, +1 closed).
        """
        hold = torch.zeros(self.num_envs, self.action_dim)
        hold[:, -1] = torch.from_numpy(self._gripper).float()
        return hold

    def render(self, world: int = 0, camera: str | None = None, size: int = 256) -> np.ndarray:
        """(size, size, 3) uint8 frame of one world from its latest observation, for videos."""
        if not self.cameras:
            raise ValueError("this env renders no cameras")
        image = self._last_obs[image_key(camera or self.cameras[0])][world : world + 1]  # (1, 3, H, W)
        image = F.interpolate(image, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        return (image[0].permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).numpy()

    def close(self) -> None:
        self._vector.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _process(self, raw: RawObs) -> dict[str, Any]:
        obs: dict[str, Any] = dict(self._process_obs(raw))
        obs[TASK] = list(self.instructions)
        return obs

    def _observe(self, raw: RawObs) -> dict[str, Any]:
        self._last_obs = self._process(raw)
        return self._last_obs
