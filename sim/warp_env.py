"""N MuJoCo Warp worlds of one tabletop task in one process, as torch tensors on one device.

The twin of `sim.mujoco_env.MujocoBatchedEnv`: the same scenes, reset distribution (the task's
own ``sample_initial_state``, with the same per-world RNG streams), IK controller, substeps,
success rule, reward and autoreset, so a policy sees the same environment on either backend.
Physics state lives in Warp arrays on ``EnvConfig.device``; observations, actions, the IK
controller and the success rule read and write them as zero-copy torch views, so a step makes
no host round-trip for physics-only observations (``cameras=[]``). Warp runs in float32, the
cpu backend in float64 (see ``tests/test_warp_backend.py`` for how far they drift apart).

Three things do cross to the host, each documented where it happens: resets (the task samples
initial states with numpy on a CPU MjData, then they are uploaded), camera images and videos
(the rendered worlds' state is copied to a CPU MjData for MuJoCo's renderer), and the scripted
experts' helpers ``ee_positions`` / ``privileged_state`` (numpy, like the cpu backend's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mujoco
import numpy as np
import torch

from sim.arm import ACTION_HIGH, ACTION_LOW, ACTION_NAMES, STATE_NAMES, arm_state, commanded_grip, hold_actions
from sim.batched_success import DeviceWorlds
from sim.config import EnvConfig, env_features, reseed
from sim.events import EventSchedules, check_control_period, draw_events
from sim.ik import ArmController
from sim.render import Renderers, camera_renderers
from vla_core.types import OBS_STATE, TASK, Worlds, image_key, world_indices

try:
    import mujoco_warp as mjw
    import warp as wp
except ImportError as err:  # the `gpu` extra is optional
    raise ImportError('the warp backend needs MuJoCo Warp: install the gpu extra with pip install -e ".[gpu]"') from err

# Contact and constraint-row slots per world: Warp sizes its arrays once and drops what does not
# fit. Scripted-expert episodes of every task peak at 14 contacts and 57 constraint rows per
# world (push, on the cpu backend); these leave twice that.
NCONMAX = 32
NJMAX = 128


class WarpBatchedEnv:
    """Batched env (see `vla_core.types.BatchedEnv`) for the MuJoCo tabletop tasks on MuJoCo Warp.

    Observations: ``observation.state`` (N, 11) float32 on ``device`` = 7 joint angles, gripper
    width, end-effector (grasp site) xyz; ``observation.images.<camera>`` (N, 3, S, S) float in
    [0, 1] for each configured camera (rendered on the host); ``task``. Actions (N, 4): the
    end-effector target ``[x, y, z, grip]`` of `MujocoBatchedEnv`. Features, task list, seeds and
    saved states as `MujocoBatchedEnv`'s. Deterministic on the CPU device; on a GPU, Warp's
    contact kernels gather with atomics, so a loaded world may part from its original at float32
    rounding once contacts appear.
    """

    ACTION_LOW, ACTION_HIGH = ACTION_LOW, ACTION_HIGH  # the arm's workspace (`sim.arm`)

    def __init__(self, config: EnvConfig):
        from sim.tasks import get_task

        self.config = config
        self.task = get_task(config.task)
        self.num_envs = n = config.num_envs
        self.action_dim = 4
        self.state_dim = len(STATE_NAMES)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:  # Warp needs the ordinal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_episode_steps = config.max_episode_steps or self.task.max_episode_steps
        self.control_dt = 0.002 * config.substeps
        check_control_period(self.task, self.control_dt)

        self.model = mujoco.MjModel.from_xml_path(self.task.xml_path())
        for cam in config.cameras:
            if mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, cam) < 0:
                raise ValueError(f"camera {cam!r} is not in the {config.task!r} scene; it has 'front'")
        self._host = mujoco.MjData(self.model)  # scratch world for resets, rendering and experts
        self._renderers = Renderers(self.model)  # single frames (videos)
        self._camera_renderers = camera_renderers(self.model, config)
        self._camera_hosts: list[mujoco.MjData] = []  # one host copy per world for the camera images, made at first use

        self._site = self.model.site("grasp").id  # the end effector
        wp.init()  # idempotent; the device lookup below needs Warp's runtime
        self._wp_device = wp.device_from_torch(self.device)
        with self._warp_scope():
            self._m = mjw.put_model(self.model)
            # MuJoCo collides box with box by its dedicated mjc_BoxBox; Warp by default through
            # its general convex CCD, which finds half the contacts between a finger and a cube
            # grasped askew, so the cube twisted in the grasp twice as fast as on the cpu backend.
            # Disabling native CCD selects Warp's box-box primitive, with MuJoCo's contact set.
            # (Warp applies this switch process-wide, to every Warp model stepped afterwards.)
            self._m.opt.disableflags |= mjw.DisableBit.NATIVECCD
            self._d = mjw.make_data(self.model, nworld=n, nconmax=NCONMAX, njmax=NJMAX)
            self._jacp = wp.zeros((n, 3, self.model.nv), dtype=float)
            self._jacr = wp.zeros((n, 3, self.model.nv), dtype=float)
            self._jac_point = wp.zeros(n, dtype=wp.vec3)
            self._jac_body = wp.array(np.full(n, self.model.site_bodyid[self._site]), dtype=int)

        # Zero-copy torch views of the Warp arrays: writing them writes the simulation.
        d, view = self._d, wp.to_torch
        # What a reset writes, by MjData field name: qpos (N, nq), qvel (N, nv), ctrl (N, nu) and,
        # in scenes with mocap bodies, mocap_pos (N, nmocap, 3), mocap_quat (N, nmocap, 4). Empty
        # Warp arrays have no torch view, hence the condition.
        self._state = {"qpos": view(d.qpos), "qvel": view(d.qvel), "ctrl": view(d.ctrl)}
        if self.model.nmocap:
            self._state |= {"mocap_pos": view(d.mocap_pos), "mocap_quat": view(d.mocap_quat)}
        # Zeroed by a reset, as by mj_resetDataKeyframe: the solver's warm start and the time.
        self._cold = [view(d.qacc_warmstart), view(d.time)] + ([view(d.act)] if self.model.na else [])
        self._qpos, self._ctrl = self._state["qpos"], self._state["ctrl"]
        self._site_xpos, self._site_xmat = view(d.site_xpos), view(d.site_xmat)  # (N, nsite, 3) (N, nsite, 3, 3)
        self._jacp_t, self._jacr_t, self._jac_point_t = view(self._jacp), view(self._jacr), view(self._jac_point)
        self._world = DeviceWorlds(
            qpos=self._qpos,
            xpos=view(d.xpos),
            xmat=view(d.xmat),
            site_xpos=self._site_xpos,
            contact_geom=view(d.contact.geom),
            contact_worldid=view(d.contact.worldid),
            nacon=view(d.nacon),
            geom_bodyid=torch.as_tensor(self.model.geom_bodyid, dtype=torch.long, device=self.device),
        )

        f64 = {"dtype": torch.float64, "device": self.device}
        self._low, self._high = torch.tensor(self.ACTION_LOW, **f64), torch.tensor(self.ACTION_HIGH, **f64)
        self._controller = ArmController.from_model(self.model).to_torch(self.device)

        self.features = env_features(config.cameras, config.image_size, STATE_NAMES, ACTION_NAMES)
        self.task_names = [config.task]
        self._task_id = torch.zeros(n, dtype=torch.long, device=self.device)
        self.episode_step = torch.zeros(n, dtype=torch.long, device=self.device)
        # Each world's random stream of initial states (fresh until a reset seeds it).
        self._seeds = [np.random.default_rng() for _ in range(n)]
        # The current episodes' scheduled events (`sim.events`; None for a task without): drawn on
        # the host at reset, kept and fired on the device.
        self._events = EventSchedules.of(self.task, self.model, n)
        if self._events is not None:
            self._events = self._events.to_torch(self.device, self._state["qvel"].dtype)
        # A saved world: what a reset writes plus what it zeroes (the solver's warm start, the time,
        # actuator activations), so a loaded world steps as the one it was saved from.
        self._saved_fields = {**self._state, "qacc_warmstart": view(d.qacc_warmstart), "time": view(d.time)}
        if self.model.na:
            self._saved_fields["act"] = view(d.act)

    # -- public API --------------------------------------------------------------------------

    def reset(self, seed: int | Sequence[int] | None = None, *, worlds: Worlds = None) -> dict[str, Any]:
        """New episodes in ``worlds`` (all by default), seeded as `MujocoBatchedEnv.reset`; returns
        every world's observation."""
        selected = world_indices(worlds, self.num_envs)
        reseed(self._seeds, seed, selected)
        if len(selected):
            self._reset_worlds(selected)
        return self._observe()

    def get_state(self, worlds: Worlds = None) -> list[dict[str, Any]]:
        """One snapshot per selected world: {"fields": MjData field name -> host array, "episode_step"},
        and "events" for a task with scheduled events (as the cpu backend's). Host round-trip: one
        device-to-host copy per field."""
        selected = world_indices(worlds, self.num_envs)
        idx = torch.as_tensor(selected, device=self.device)
        fields = {name: t[idx].cpu().numpy() for name, t in self._saved_fields.items()}
        steps = self.episode_step[idx].tolist()
        states = [
            {"fields": {name: v[k] for name, v in fields.items()}, "episode_step": s} for k, s in enumerate(steps)
        ]
        if self._events is not None:
            for state, events in zip(states, self._events.snapshot(selected)):
                state["events"] = events
        return states

    def set_state(self, states: Sequence[dict[str, Any]], worlds: Worlds = None) -> dict[str, Any]:
        """Load ``states`` (from `get_state`) into ``worlds``, world ``worlds[j]`` gets ``states[j]``;
        returns every world's observation."""
        selected = world_indices(worlds, self.num_envs)
        if len(states) != len(selected):
            raise ValueError(f"{len(selected)} worlds need {len(selected)} states, got {len(states)}")
        idx = torch.as_tensor(selected, device=self.device)
        for name, target in self._saved_fields.items():
            values = np.stack([state["fields"][name] for state in states])
            target[idx] = torch.as_tensor(values, dtype=target.dtype).to(self.device)
        self.episode_step[idx] = torch.as_tensor([state["episode_step"] for state in states], device=self.device)
        if self._events is not None:
            self._events.load(selected, [state["events"] for state in states])
        with self._warp_scope():
            mjw.forward(self._m, self._d)  # the other worlds' kinematics are recomputed unchanged
        return self._observe()

    def step(self, actions: torch.Tensor | np.ndarray):
        """actions (N, 4) -> obs, reward (N,), terminated (N,), truncated (N,), info; all on ``device``,
        info's keys as `MujocoBatchedEnv.step`'s."""
        act = torch.as_tensor(actions).to(self.device, torch.float64)
        if act.shape != (self.num_envs, self.action_dim):
            raise ValueError(f"actions must have shape ({self.num_envs}, {self.action_dim}), got {tuple(act.shape)}")
        invalid = ~torch.isfinite(act).all(dim=1)
        # A non-finite action holds the current end-effector pose instead of crashing the batch.
        act = torch.where(invalid[:, None], hold_actions(self._ee().double()), act)
        # Finite rows outside the workspace are clipped to it and counted, as the other backends do.
        clipped = ~invalid & ((act < self._low) | (act > self._high)).any(dim=1)
        act = act.clamp(self._low, self._high)

        self._ctrl.copy_(self._ik_control(act))
        with self._warp_scope():
            for _ in range(self.config.substeps):
                mjw.step(self._m, self._d)
            # mj_step leaves positions one integration ahead of the kinematics; forward makes
            # site poses, jacobians and contacts match the new state, as the cpu backend's mj_forward.
            mjw.forward(self._m, self._d)

        self.episode_step += 1
        # The events due at the end of this step set their velocities (`sim.events`, on the device).
        events = (
            self._no_events() if self._events is None else self._events.fire(self.episode_step, self._state["qvel"])
        )
        success = self._success()
        diverged = ~torch.isfinite(self._qpos).all(dim=1)
        terminated = success | self._failure(success) | diverged
        truncated = (self.episode_step >= self.max_episode_steps) & ~terminated
        final_obs = self._observe()
        done = terminated | truncated
        # Host sync of N bools: the next episodes' initial states are drawn on the host.
        done_worlds = torch.nonzero(done).flatten().cpu().numpy()
        if len(done_worlds):
            self._reset_worlds(done_worlds)
        obs = self._observe() if len(done_worlds) else final_obs
        info = {
            "success": success,
            "diverged": diverged,
            "invalid_actions": invalid,
            "clipped_actions": clipped,
            "events": events,
            "task_id": self._task_id.clone(),
            "final_obs": final_obs,
        }
        return obs, success.float(), terminated, truncated, info

    def ee_positions(self) -> np.ndarray:
        """(N, 3) end-effector (grasp site) positions, copied to the host for numpy experts."""
        return self._ee().double().cpu().numpy()

    def hold_actions(self) -> torch.Tensor:
        """(N, 4) actions on ``device`` that keep every arm where it is and its gripper as commanded."""
        return hold_actions(self._ee(), commanded_grip(self._ctrl[:, 7])).float()

    def privileged_state(self) -> dict[str, np.ndarray]:
        """The task's privileged state of every world, for scripted experts: name -> (N, ...).

        Host round-trip: each world's state is copied to a CPU MjData and read by the task.
        """
        worlds = self._host_worlds(range(self.num_envs))
        per_world = [self.task.privileged_state(self.model, self._host) for _ in worlds]
        return {name: np.stack([state[name] for state in per_world]) for name in per_world[0]}

    def render(self, world: int = 0, camera: str | None = None, size: int = 256) -> np.ndarray:
        """(size, size, 3) uint8 frame of one world, for videos (rendered on the host)."""
        next(self._host_worlds([world]))
        return self._renderers.frame(self._host, camera or (self.config.cameras or ["front"])[0], size).copy()

    @property
    def render_restarts(self) -> int:
        """Render worker processes started again after dying (`sim.render.ProcessRenderers`; 0 with threads)."""
        return getattr(self._camera_renderers, "restarts", 0)

    def close(self) -> None:
        self._renderers.close()
        self._camera_renderers.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _warp_scope(self):
        """Launch Warp work on the env's device and, on CUDA, on torch's current stream, so Warp
        kernels and the torch ops around them run in order without explicit syncs."""
        if self._wp_device.is_cuda:
            return wp.ScopedStream(wp.stream_from_torch(self.device))
        return wp.ScopedDevice(self._wp_device)

    def _ee(self) -> torch.Tensor:
        """(N, 3) float32 grasp-site positions on ``device``."""
        return self._site_xpos[:, self._site]

    def _reset_worlds(self, worlds: np.ndarray) -> None:
        """Draw new episodes for ``worlds`` (host, the task's sampler) and upload them."""
        states: dict[str, list[np.ndarray]] = {name: [] for name in self._state}
        events = []
        for i in worlds:
            self.task.sample_initial_state(self.model, self._host, self._seeds[i])
            for name, values in states.items():
                values.append(getattr(self._host, name).copy())
            if self._events is not None:  # drawn from the same stream, after the initial state
                events.append(draw_events(self.task, self.model, self._host, self._seeds[i]))
        self._upload(worlds, {name: np.stack(values) for name, values in states.items()})
        if self._events is not None:
            self._events.load(worlds, events)
        self.episode_step[torch.as_tensor(worlds, device=self.device)] = 0

    def _upload(self, worlds: np.ndarray, states: dict[str, np.ndarray]) -> None:
        """Overwrite ``worlds`` (k,) with host states, MjData field name -> (k, ...) array (qpos,
        qvel, ctrl, and mocap_pos, mocap_quat where the scene has mocap bodies), start their
        solver cold and recompute the kinematics."""
        idx = torch.as_tensor(worlds, device=self.device)
        for name, target in self._state.items():
            target[idx] = torch.as_tensor(states[name], dtype=target.dtype).to(self.device)
        for target in self._cold:
            target[idx] = 0.0
        with self._warp_scope():
            mjw.forward(self._m, self._d)  # the other worlds' kinematics are recomputed unchanged

    def _host_worlds(self, worlds, hosts: list[mujoco.MjData] | None = None) -> Iterator[int]:
        """Yield each of ``worlds`` after loading its state into the scratch MjData ``self._host``
        (or into ``hosts[k]``, the k-th world's own) with its kinematics computed. Host round-trip:
        one device-to-host copy for all of them."""
        idx = torch.as_tensor(list(worlds), device=self.device)
        states = {name: t[idx].cpu().numpy() for name, t in self._state.items()}
        for k, world in enumerate(idx.tolist()):
            h = self._host if hosts is None else hosts[k]
            for name, values in states.items():
                getattr(h, name)[:] = values[k]
            mujoco.mj_kinematics(self.model, h)
            mujoco.mj_comPos(self.model, h)
            mujoco.mj_camlight(self.model, h)
            yield world

    def _no_events(self) -> torch.Tensor:
        """(N,) bool, all False: where an event fired, for a task without events."""
        return torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)

    def _success(self) -> torch.Tensor:
        """(N,) bool: the task's success rule on the device state."""
        return self.task.success(self.model, self._world)

    def _failure(self, success: torch.Tensor) -> torch.Tensor:
        """(N,) bool: the task's failure rule on the device state (none: all False), never where it succeeded."""
        if not hasattr(self.task, "failure"):
            return torch.zeros_like(success)
        return self.task.failure(self.model, self._world) & ~success

    def _ik_control(self, action: torch.Tensor) -> torch.Tensor:
        """(N, 4) clipped float64 actions -> (N, nu) servo targets: one IK step per world (``sim.ik``).

        The cpu backend's controller on the device: the grasp-site jacobian comes from Warp, the
        damped least squares runs in float64 torch.
        """
        self._jac_point_t.copy_(self._ee())
        with self._warp_scope():
            mjw.jac(self._m, self._d, self._jacp, self._jacr, self._jac_point, self._jac_body)
        jac = torch.cat([self._jacp_t[:, :, :7], self._jacr_t[:, :, :7]], dim=1).double()  # (N, 6, 7)
        site_xmat = self._site_xmat[:, self._site].reshape(-1, 9).double()  # (N, 9)
        q = self._qpos[:, :7].double()  # (N, 7)
        ctrl = self._ctrl.double()  # (N, nu) a copy; the arm's 9 servos are overwritten
        self._controller.servo_targets(action, q, jac, self._ee().double(), site_xmat, out=ctrl)
        return ctrl

    def _observe(self) -> dict[str, Any]:
        obs: dict[str, Any] = {}
        if self.config.cameras:
            obs |= self._render_cameras()
        state = torch.empty(self.num_envs, self.state_dim, dtype=torch.float32, device=self.device)
        obs[OBS_STATE] = arm_state(self._qpos[:, :9], self._ee(), out=state)
        if hasattr(self.task, "instructions_of"):  # the instruction is the world's own state: one copy to the host
            obs[TASK] = self.task.instructions_of(self.model, self._qpos.cpu().numpy())
        else:
            obs[TASK] = [self.task.instruction] * self.num_envs
        return obs

    def _render_cameras(self) -> dict[str, torch.Tensor]:
        """name -> (N, 3, S, S) images. Host round-trip: every world is copied to a CPU MjData and
        rendered by MuJoCo's renderer, then the batch is moved to ``device``."""
        n, size = self.num_envs, self.config.image_size
        if not self._camera_hosts:
            self._camera_hosts = [mujoco.MjData(self.model) for _ in range(n)]
        for _ in self._host_worlds(range(n), self._camera_hosts):  # loads each world into its own copy
            pass
        frames = {
            cam: self._camera_renderers.frames(
                self._camera_hosts, cam, size, np.empty((n, size, size, 3), dtype=np.uint8)
            )
            for cam in self.config.cameras
        }
        return {
            image_key(cam): torch.from_numpy(f).to(self.device).permute(0, 3, 1, 2).float().div_(255.0)
            for cam, f in frames.items()
        }
