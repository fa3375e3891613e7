"""N MuJoCo worlds of one tabletop task, stepped as one batch on CPU.

Physics runs through ``mujoco.rollout`` (native threads, one call for all worlds per control
step). The action is an end-effector target ``[x, y, z, grip]`` in the world frame (metres;
grip 0 = open, 1 = closed); a damped-least-squares IK controller turns it into joint position
targets for the arm's servos, keeping the gripper pointing down at a fixed yaw. The task
(``sim.tasks``) supplies the scene, the reset distribution, the success check and the
privileged state its scripted expert reads.
"""

from __future__ import annotations

import os
from typing import Any

import mujoco
import numpy as np
import torch
from mujoco import rollout

from sim.config import EnvConfig
from vla_rl.types import OBS_STATE, TASK, image_key

ACTION_NAMES = ["ee_x", "ee_y", "ee_z", "grip"]
STATE_NAMES = [f"joint{i}" for i in range(1, 8)] + ["gripper_width", "ee_x", "ee_y", "ee_z"]


class MujocoBatchedEnv:
    """Batched env (see `vla_rl.types.BatchedEnv`) for the MuJoCo tabletop tasks, on CPU.

    Observations: ``observation.images.<camera>`` (N, 3, S, S) float in [0, 1];
    ``observation.state`` (N, 11) = 7 joint angles, gripper width, end-effector xyz; ``task``.
    """

    # End-effector workspace the action is clipped to (metres, world frame).
    ACTION_LOW = np.array([0.25, -0.35, 0.0, 0.0])
    ACTION_HIGH = np.array([0.80, 0.35, 0.40, 1.0])
    MAX_EE_STEP = 0.04  # metres the IK target may lead the end effector by, per control step

    def __init__(self, config: EnvConfig):
        from sim.tasks import get_task

        self.config = config
        self.task = get_task(config.task)
        self.num_envs = config.num_envs
        self.action_dim = 4
        self.state_dim = len(STATE_NAMES)
        self.device = torch.device("cpu")
        self.max_episode_steps = config.max_episode_steps or self.task.max_episode_steps
        self.control_dt = 0.002 * config.substeps

        self.model = mujoco.MjModel.from_xml_path(self.task.xml_path())
        self.data = [mujoco.MjData(self.model) for _ in range(self.num_envs)]
        nthread = config.num_threads or os.cpu_count() or 1
        self._thread_data = [mujoco.MjData(self.model) for _ in range(min(nthread, self.num_envs))]
        self._rollout = rollout.Rollout(nthread=len(self._thread_data))
        self._state_spec = mujoco.mjtState.mjSTATE_FULLPHYSICS
        self._nstate = mujoco.mj_stateSize(self.model, self._state_spec)
        # Tasks place goal markers and fixtures (bins, cabinets) per world as mocap bodies. Their
        # poses are inputs, not physics state, so they travel to the rollout threads with the controls.
        self._control_spec = (
            mujoco.mjtState.mjSTATE_CTRL | mujoco.mjtState.mjSTATE_MOCAP_POS | mujoco.mjtState.mjSTATE_MOCAP_QUAT
        )
        self._ncontrol = mujoco.mj_stateSize(self.model, self._control_spec)
        self._renderer: mujoco.Renderer | None = None
        self._video_renderers: dict[int, mujoco.Renderer] = {}
        for cam in config.cameras:
            if mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, cam) < 0:
                raise ValueError(f"camera {cam!r} is not in the {config.task!r} scene; it has 'front'")

        self._site = self.model.site("grasp").id
        self._arm_range = self.model.jnt_range[:7].copy()
        home = self.model.key("home")
        self._home_q = home.qpos[:7].copy()
        probe = mujoco.MjData(self.model)
        mujoco.mj_resetDataKeyframe(self.model, probe, home.id)
        mujoco.mj_forward(self.model, probe)
        self._target_rot = probe.site_xmat[self._site].reshape(3, 3).copy()  # gripper down, fixed yaw

        self.episode_step = np.zeros(self.num_envs, dtype=np.int64)
        self._seeds: list[np.random.Generator] = []

    # -- public API --------------------------------------------------------------------------

    def reset(self, seed: int | None = None) -> dict[str, Any]:
        """Reset every world; world i draws its episodes from its own stream of ``seed``."""
        children = np.random.SeedSequence(seed).spawn(self.num_envs)
        self._seeds = [np.random.default_rng(s) for s in children]
        for i in range(self.num_envs):
            self._reset_world(i)
        return self._observe()

    def step(self, actions: torch.Tensor | np.ndarray):
        """actions (N, 4) -> obs, reward (N,), terminated (N,), truncated (N,), info."""
        act = np.asarray(torch.as_tensor(actions, dtype=torch.float64).cpu(), dtype=np.float64)
        if act.shape != (self.num_envs, self.action_dim):
            raise ValueError(f"actions must have shape ({self.num_envs}, {self.action_dim}), got {act.shape}")
        invalid = ~np.isfinite(act).all(axis=1)
        # A non-finite action holds the current end-effector pose instead of crashing the batch.
        act[invalid] = np.concatenate([self.ee_positions()[invalid], np.zeros((invalid.sum(), 1))], axis=1)
        act = np.clip(act, self.ACTION_LOW, self.ACTION_HIGH)

        ctrl = np.stack([self._ik_control(i, act[i]) for i in range(self.num_envs)])
        self._physics(ctrl)

        self.episode_step += 1
        success = np.array([self.task.is_success(self.model, d) for d in self.data])
        diverged = ~np.array([np.isfinite(d.qpos).all() for d in self.data])
        terminated = success | diverged
        truncated = (self.episode_step >= self.max_episode_steps) & ~terminated
        final_obs = self._observe()
        done = terminated | truncated
        for i in np.flatnonzero(done):
            self._reset_world(i)
        obs = self._observe() if done.any() else final_obs
        info = {
            "success": torch.from_numpy(success),
            "diverged": torch.from_numpy(diverged),
            "invalid_actions": torch.from_numpy(invalid),
            "final_obs": final_obs,
        }
        to_t = torch.from_numpy
        return obs, to_t(success.astype(np.float32)), to_t(terminated), to_t(truncated), info

    def ee_positions(self) -> np.ndarray:
        """(N, 3) end-effector (grasp site) positions."""
        return np.stack([d.site_xpos[self._site] for d in self.data])

    def hold_actions(self) -> torch.Tensor:
        """(N, 4) actions that keep every arm where it is and its gripper as commanded.

        Sent when no action is queued (for instance while the first chunk is still being inferred).
        """
        grip = np.array([1.0 - d.ctrl[7] / 0.04 for d in self.data])
        return torch.from_numpy(np.concatenate([self.ee_positions(), grip[:, None]], axis=1)).float()

    def privileged_state(self) -> dict[str, np.ndarray]:
        """The task's privileged state of every world, for scripted experts: name -> (N, ...)."""
        per_world = [self.task.privileged_state(self.model, d) for d in self.data]
        return {name: np.stack([state[name] for state in per_world]) for name in per_world[0]}

    def render(self, world: int = 0, camera: str | None = None, size: int = 256) -> np.ndarray:
        """(size, size, 3) uint8 frame of one world, for videos."""
        if size not in self._video_renderers:
            self._video_renderers[size] = mujoco.Renderer(self.model, size, size)
        renderer = self._video_renderers[size]
        renderer.update_scene(self.data[world], camera or self.config.cameras[0])
        return renderer.render().copy()

    def close(self) -> None:
        for renderer in [self._renderer, *self._video_renderers.values()]:
            if renderer is not None:
                renderer.close()
        self._renderer = None
        self._video_renderers.clear()
        self._rollout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _reset_world(self, i: int) -> None:
        d = self.data[i]
        self.task.sample_initial_state(self.model, d, self._seeds[i])
        mujoco.mj_forward(self.model, d)
        self.episode_step[i] = 0

    def _ik_control(self, i: int, action: np.ndarray) -> np.ndarray:
        """One damped-least-squares IK step toward the target: (4,) action -> (nu,) servo targets."""
        d = self.data[i]
        q = d.qpos[:7]
        pos_err = action[:3] - d.site_xpos[self._site]
        norm = np.linalg.norm(pos_err)
        if norm > self.MAX_EE_STEP:
            pos_err *= self.MAX_EE_STEP / norm
        rot = d.site_xmat[self._site].reshape(3, 3)
        rot_err = 0.5 * sum(np.cross(rot[:, k], self._target_rot[:, k]) for k in range(3))
        jacp = np.zeros((3, self.model.nv))
        jacr = np.zeros((3, self.model.nv))
        mujoco.mj_jacSite(self.model, d, jacp, jacr, self._site)
        jac = np.concatenate([jacp[:, :7], jacr[:, :7]])  # (6, 7)
        err = np.concatenate([pos_err, rot_err])
        jjt = jac @ jac.T + 1e-4 * np.eye(6)
        dq = jac.T @ np.linalg.solve(jjt, err)
        # Pull the redundant DoF toward home so the elbow does not drift over long episodes.
        null = np.eye(7) - jac.T @ np.linalg.solve(jjt, jac)
        dq += null @ (0.1 * (self._home_q - q))
        ctrl = np.empty(self.model.nu)
        ctrl[:7] = np.clip(q + dq, self._arm_range[:, 0], self._arm_range[:, 1])
        ctrl[7:9] = 0.04 * (1.0 - action[3])  # finger opening per side
        return ctrl

    def _physics(self, ctrl: np.ndarray) -> None:
        """Advance every world by ``substeps`` physics steps with constant controls (N, nu)."""
        init = np.empty((self.num_envs, self._nstate))
        control = np.empty((self.num_envs, 1, self._ncontrol))  # ctrl, then mocap poses
        for i, d in enumerate(self.data):
            d.ctrl[:] = ctrl[i]
            mujoco.mj_getState(self.model, d, init[i], self._state_spec)
            mujoco.mj_getState(self.model, d, control[i, 0], self._control_spec)
        state, _ = self._rollout.rollout(
            self.model,
            self._thread_data,
            init,
            control,
            control_spec=self._control_spec,
            nstep=self.config.substeps,
        )
        for i, d in enumerate(self.data):
            mujoco.mj_setState(self.model, d, state[i, -1], self._state_spec)
            mujoco.mj_forward(self.model, d)

    def _observe(self) -> dict[str, Any]:
        n, size = self.num_envs, self.config.image_size
        obs: dict[str, Any] = {}
        if self._renderer is None:
            self._renderer = mujoco.Renderer(self.model, size, size)
        for cam in self.config.cameras:
            frames = np.empty((n, size, size, 3), dtype=np.uint8)
            for i, d in enumerate(self.data):
                self._renderer.update_scene(d, cam)
                self._renderer.render(out=frames[i])
            obs[image_key(cam)] = torch.from_numpy(frames).permute(0, 3, 1, 2).float().div_(255.0)
        state = np.empty((n, self.state_dim), dtype=np.float32)
        for i, d in enumerate(self.data):
            state[i, :7] = d.qpos[:7]
            state[i, 7] = d.qpos[7] + d.qpos[8]
            state[i, 8:] = d.site_xpos[self._site]
        obs[OBS_STATE] = torch.from_numpy(state)
        obs[TASK] = [self.task.instruction] * n
        return obs
