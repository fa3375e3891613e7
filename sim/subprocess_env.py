"""N Gymnasium envs in subprocess workers behind the batched-env contract (`vla_core.types.BatchedEnv`).

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
  the caller's ``process_obs`` from the raw batched observation;
- a subset of worlds resets (Gymnasium's ``reset_mask``), each to its own seed, and a world's
  state is saved and loaded: in its worker, through the world's own ``get_state()`` (picklable)
  and ``set_state(state)`` (-> its raw observation), with the time limit's step count restored.

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

from sim.config import is_batch_seed, per_world_seeds
from vla_core.types import TASK, Worlds, image_key, world_indices

RawObs = dict[str, Any]  # a (nested) dict of numpy arrays with a leading batch dim
ProcessObs = Callable[[RawObs], dict[str, torch.Tensor]]


class _World(gym.Wrapper):
    """World ``index`` in its worker: time-limited, and able to save and load its state.

    A reset whose options carry ``world_states`` {index: (state, episode step)} loads this world's
    entry (its own ``set_state``) instead of starting a new episode.
    """

    def __init__(self, make_world: Callable[[], gym.Env], index: int, max_episode_steps: int):
        super().__init__(gym.wrappers.TimeLimit(make_world(), max_episode_steps=max_episode_steps))
        self.index = index

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        saved = (options or {}).get("world_states", {}).get(self.index)
        if saved is None:
            return self.env.reset(seed=seed)
        state, episode_step = saved
        raw = self.env.get_wrapper_attr("set_state")(state)
        self.env._elapsed_steps = episode_step  # the time limit's count: truncation comes when it would have
        return raw, {"is_success": False}

    def get_world_state(self) -> Any:
        return self.env.get_wrapper_attr("get_state")()


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
        features: LeRobot's features of the observations and actions (`vla_core.types.BatchedEnv`).
        task_names: the env's task list; task_ids: (N,) each world's index into it. By default each
            distinct instruction is a task.
    """

    def __init__(
        self,
        make_worlds: Sequence[Callable[[], gym.Env]],
        process_obs: ProcessObs,
        instructions: Sequence[str],
        max_episode_steps: int,
        cameras: Sequence[str],
        control_dt: float,
        *,
        features: dict[str, dict[str, Any]] | None = None,
        task_names: Sequence[str] | None = None,
        task_ids: Sequence[int] | None = None,
    ):
        if len(instructions) != len(make_worlds):
            raise ValueError(f"{len(make_worlds)} worlds need {len(make_worlds)} instructions, got {len(instructions)}")
        self.num_envs = len(make_worlds)
        self.instructions = list(instructions)
        self.max_episode_steps = max_episode_steps
        self.cameras = list(cameras)
        self.control_dt = control_dt
        self.device = torch.device("cpu")
        self.features = dict(features or {})
        if task_names is None:
            task_names = list(dict.fromkeys(self.instructions))
            task_ids = [task_names.index(text) for text in self.instructions]
        self.task_names = list(task_names)
        self._task_id = torch.as_tensor(np.asarray(task_ids, dtype=np.int64))  # (N,)
        self._process_obs = process_obs
        self._vector = gym.vector.AsyncVectorEnv(
            [partial(_World, make, i, max_episode_steps) for i, make in enumerate(make_worlds)],
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

    @property
    def world_tasks(self) -> torch.Tensor:
        """(N,) long: each world's task, an index into ``task_names`` (a world keeps its task)."""
        return self._task_id.clone()

    def reset(self, seed: int | Sequence[int] | None = None, *, worlds: Worlds = None) -> dict[str, Any]:
        """New episodes in ``worlds`` (all by default); returns every world's observation.

        World i's env is reset with seed ``seed + i`` (an int, Gymnasium's rule), its own seed (one
        int per selected world) or none (it goes on from its own random state).
        """
        selected = world_indices(worlds, self.num_envs)
        seeds: list[int | None] = [None] * self.num_envs
        if not is_batch_seed(seed):
            for w, s in zip(selected, per_world_seeds(seed, len(selected))):
                seeds[w] = s
        elif seed is not None:
            for w in selected:
                seeds[w] = int(seed) + int(w)
        raw = self._reset_worlds(selected, seeds, {})
        self.episode_step[selected] = 0
        self._gripper[selected] = -1.0
        return self._observe(raw)

    def get_state(self, worlds: Worlds = None) -> list[dict[str, Any]]:
        """One snapshot per selected world: {"world": the world's own state, "episode_step", "gripper"
        (its last gripper command, what holding keeps), "task_id" (a state loads only into a world of
        the same task)}."""
        world_states = self._vector.call("get_world_state")  # every worker answers; we keep the selected
        return [
            {"world": world_states[w], "episode_step": int(self.episode_step[w]), "gripper": float(self._gripper[w]),
             "task_id": int(self._task_id[w])}
            for w in world_indices(worlds, self.num_envs)
        ]  # fmt: skip

    def set_state(self, states: Sequence[dict[str, Any]], worlds: Worlds = None) -> dict[str, Any]:
        """Load ``states`` (from `get_state`) into ``worlds``, world ``worlds[j]`` gets ``states[j]``;
        returns every world's observation."""
        selected = world_indices(worlds, self.num_envs)
        if len(states) != len(selected):
            raise ValueError(f"{len(selected)} worlds need {len(selected)} states, got {len(states)}")
        wrong = [(int(w), s["task_id"]) for w, s in zip(selected, states) if s["task_id"] != self._task_id[w]]
        if wrong:
            raise ValueError(
                f"a state loads only into a world of its own task: (world, state's task_id) {wrong} do not match "
                f"the worlds' task_id {[int(self._task_id[w]) for w, _ in wrong]}"
            )
        saved = {int(w): (s["world"], s["episode_step"]) for w, s in zip(selected, states)}
        raw = self._reset_worlds(selected, [None] * self.num_envs, {"world_states": saved})
        for w, s in zip(selected, states):
            self.episode_step[w] = s["episode_step"]
            self._gripper[w] = s["gripper"]
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
            "task_id": self._task_id.clone(),
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
            raise ValueError(
                "this env renders no cameras (--env.cameras is empty): set --video_episodes=0 or name a camera"
            )
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

    def _reset_worlds(self, selected: np.ndarray, seeds: list[int | None], options: dict) -> RawObs:
        """Reset the ``selected`` worlds' envs with ``seeds`` (N,) and ``options``; the raw batch of
        every world's current observation (the others' unchanged, from the shared memory)."""
        if len(selected) == 0:
            return _copy_tree(self._vector.observations)
        mask = np.zeros(self.num_envs, dtype=bool)
        mask[selected] = True
        raw, _ = self._vector.reset(seed=seeds, options={**options, "reset_mask": mask})
        return raw

    def _process(self, raw: RawObs) -> dict[str, Any]:
        obs: dict[str, Any] = dict(self._process_obs(raw))
        obs[TASK] = list(self.instructions)
        return obs

    def _observe(self, raw: RawObs) -> dict[str, Any]:
        self._last_obs = self._process(raw)
        return self._last_obs
