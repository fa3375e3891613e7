"""N MuJoCo worlds of one tabletop task, stepped as one batch on CPU.

Physics runs through ``mujoco.rollout`` (native threads; the worlds go in a few blocks per
control step, so the per-world Python work overlaps the physics). The action is an end-effector
target ``[x, y, z, grip]`` in the world frame (metres; grip 0 = open, 1 = closed); a
damped-least-squares IK controller (``sim.ik``, batched over the worlds) turns it into joint
position targets for the arm's servos, keeping the gripper pointing down at a fixed yaw. The
task (``sim.tasks``) supplies the scene, the reset distribution, the success check and the
privileged state its scripted expert reads.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import mujoco
import numpy as np
import torch
from mujoco import rollout

from sim.arm import ACTION_HIGH, ACTION_LOW, ACTION_NAMES, STATE_NAMES, arm_state, commanded_grip, hold_actions
from sim.batched_success import HostWorlds
from sim.config import EnvConfig, env_features, reseed
from sim.events import EventSchedules, check_control_period, draw_events
from sim.ik import ArmController
from sim.poses import position_pass
from sim.render import Renderers, camera_renderers
from sim.variations import VariedWorlds, scene_with_distractors
from vla_core.types import OBS_STATE, TASK, Worlds, image_key, world_indices


class MujocoBatchedEnv:
    """Batched env (see `vla_core.types.BatchedEnv`) for the MuJoCo tabletop tasks, on CPU.

    Observations: ``observation.images.<camera>`` (N, 3, S, S) float in [0, 1], one per camera
    in ``config.cameras`` (none when it is empty: physics only); ``observation.state`` (N, 11) =
    7 joint angles, gripper width, end-effector xyz; ``task``. One task: ``task_names`` is
    ``[config.task]`` and every world's ``info["task_id"]`` is 0. Deterministic: a world reset
    with a seed, or loaded from a saved state, then stepped, repeats itself bit for bit.

    After each step ``data[i]`` holds world i's state and its position-dependent quantities
    (`sim.poses.forward_positions`); run ``mujoco.mj_forward`` on it for accelerations or forces.
    """

    ACTION_LOW, ACTION_HIGH = ACTION_LOW, ACTION_HIGH  # the arm's workspace (`sim.arm`)
    PIPELINE_BLOCKS = 4  # blocks of worlds per control step, so loading results overlaps physics
    MIN_BLOCK_WORLDS = 64  # smaller blocks cost more in thread hand-offs than they overlap

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
        check_control_period(self.task, self.control_dt)

        xml = self.task.xml_path()
        self.model = (
            scene_with_distractors(xml) if config.variation == "distractors" else mujoco.MjModel.from_xml_path(xml)
        )
        self.data = [mujoco.MjData(self.model) for _ in range(self.num_envs)]
        nthread = config.num_threads or os.cpu_count() or 1
        self._thread_data = [mujoco.MjData(self.model) for _ in range(min(nthread, self.num_envs))]
        self._rollout = rollout.Rollout(nthread=len(self._thread_data))
        # Blocks of worlds pipelined through the rollout (see `_advance`); one block when N is small.
        nblocks = max(1, min(self.PIPELINE_BLOCKS, self.num_envs // self.MIN_BLOCK_WORLDS))
        bounds = np.linspace(0, self.num_envs, nblocks + 1).round().astype(int)
        self._blocks = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="rollout") if nblocks > 1 else None
        self._forward_positions = position_pass(self.model)
        spec, size = mujoco.mjtState, partial(mujoco.mj_stateSize, self.model)
        self._state_spec = spec.mjSTATE_FULLPHYSICS
        # Tasks place goal markers and fixtures (bins, cabinets) per world as mocap bodies. Their
        # poses are inputs, not physics state, so they travel to the rollout threads with the controls.
        self._control_spec = spec.mjSTATE_CTRL | spec.mjSTATE_MOCAP_POS | spec.mjSTATE_MOCAP_QUAT
        self._nstate, self._ncontrol = size(self._state_spec), size(self._control_spec)
        # One mj_getState per world reads both (gather spec), one mj_setState writes the state and
        # ctrl back (store spec). State vectors list their elements in mjtState bit order, and the
        # plugin state comes last: gather = [physics | ctrl, mocap poses | plugin] and
        # store = [physics | ctrl | plugin], where FULLPHYSICS = [physics | plugin].
        self._gather_spec = self._state_spec | self._control_spec
        self._store_spec = self._state_spec | spec.mjSTATE_CTRL
        self._nphysics = self._nstate - size(spec.mjSTATE_PLUGIN)
        self._qpos_in_state = size(spec.mjSTATE_TIME)  # the time comes first, then qpos, then qvel
        self._qvel_in_state = self._qpos_in_state + self.model.nq
        # Per-step buffers, (N, ...) each: the gathered and stored vectors, rollout inputs and
        # outputs, the site Jacobians.
        self._gathered = np.empty((self.num_envs, self._nstate + self._ncontrol))
        self._stored = np.empty((self.num_envs, self._nstate + self.model.nu))
        self._init_state = np.empty((self.num_envs, self._nstate))
        self._control = np.empty((self.num_envs, config.substeps, self._ncontrol))
        self._rollout_state = np.empty((self.num_envs, config.substeps, self._nstate))
        self._ctrl = np.empty((self.num_envs, self.model.nu))
        # What observations and rewards read, per world, as of its last physics step or reset:
        # qpos[:9] (arm joints, then the fingers), the grasp site position, the task's success.
        self._obs_qpos = np.empty((self.num_envs, 9))
        self._obs_ee = np.empty((self.num_envs, 3))
        self._success = np.zeros(self.num_envs, dtype=bool)
        self._failure = np.zeros(self.num_envs, dtype=bool)  # the task's failure rule, where it has one
        # Each world's model: the one model, or with a variation (`sim.variations`) a copy per world.
        self._varied = VariedWorlds(config.variation, self.task, self.model, self.num_envs)
        self._models = self._varied.models
        self._jacp = np.zeros((self.num_envs, 3, self.model.nv))
        self._jacr = np.zeros((self.num_envs, 3, self.model.nv))
        self._renderers = Renderers(self.model)  # single frames (videos)
        for cam in config.cameras:
            if mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, cam) < 0:
                raise ValueError(f"camera {cam!r} is not in the {config.task!r} scene; it has 'front'")
        self._camera_renderers = camera_renderers(self.model, config)

        self._site = self.model.site("grasp").id
        self._controller = ArmController.from_model(self.model)

        self.features = env_features(config.cameras, config.image_size, STATE_NAMES, ACTION_NAMES)
        self.task_names = [config.task]
        self._task_id = torch.zeros(self.num_envs, dtype=torch.long)
        self.episode_step = np.zeros(self.num_envs, dtype=np.int64)
        # Each world's random stream of initial states (fresh until a reset seeds it).
        self._seeds = [np.random.default_rng() for _ in range(self.num_envs)]
        # The current episodes' scheduled events (`sim.events`; None for a task without), and where
        # one fired at the last step.
        self._events = EventSchedules.of(self.task, self.model, self.num_envs)
        self._fired = np.zeros(self.num_envs, dtype=bool)
        # A saved world: everything its integration reads (`mujoco.mjtState.mjSTATE_INTEGRATION`:
        # physics, controls, mocap poses, the solver's warm start), so a loaded world steps as it did.
        self._saved_spec = mujoco.mjtState.mjSTATE_INTEGRATION

    # -- public API --------------------------------------------------------------------------

    def reset(self, seed: int | Sequence[int] | None = None, *, worlds: Worlds = None) -> dict[str, Any]:
        """New episodes in ``worlds`` (all by default); returns every world's observation.

        World i draws its episodes from its own random stream: stream i of ``seed`` (an int), the
        stream of its own seed (one int per world: equal seeds, equal episodes), or, with no seed,
        the stream it already had (see `vla_core.types.BatchedEnv`).
        """
        selected = world_indices(worlds, self.num_envs)
        reseed(self._seeds, seed, selected)
        for i in selected:
            self._reset_world(i)
        return self._observe()

    def get_state(self, worlds: Worlds = None) -> list[dict[str, Any]]:
        """One snapshot per selected world: {"physics": MuJoCo's integration state, "episode_step"},
        and "events" (`sim.events.EventSchedules.snapshot`) for a task with scheduled events."""
        selected, states = world_indices(worlds, self.num_envs), []
        for i in selected:
            physics = np.empty(mujoco.mj_stateSize(self.model, self._saved_spec))
            mujoco.mj_getState(self.model, self.data[i], physics, self._saved_spec)
            states.append({"physics": physics, "episode_step": int(self.episode_step[i])})
            if self.config.variation:
                states[-1]["variation"] = self._varied.snapshot(i)
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
        for i, state in zip(selected, states):
            d = self.data[i]
            self._varied.load(i, state.get("variation"))
            mujoco.mj_setState(self.model, d, state["physics"], self._saved_spec)
            mujoco.mj_forward(self._models[i], d)
            self.episode_step[i] = state["episode_step"]
            self._obs_qpos[i] = d.qpos[:9]
            self._obs_ee[i] = d.site_xpos[self._site]
        if self._events is not None:
            self._events.load(selected, [state["events"] for state in states])
        return self._observe()

    def step(self, actions: torch.Tensor | np.ndarray):
        """actions (N, 4) -> obs, reward (N,), terminated (N,), truncated (N,), info.

        info: ``success``, ``diverged`` (a blown-up world, reset), ``invalid_actions`` (a row with
        NaN or inf, which holds the pose), ``clipped_actions`` (a finite row outside the workspace,
        clipped to it), ``events`` (a scheduled event of the task fired at the end of this step,
        `sim.events`; never for a task without), each (N,) bool, ``task_id`` (N,) long and ``final_obs``.
        """
        act = np.asarray(torch.as_tensor(actions, dtype=torch.float64).cpu(), dtype=np.float64)
        if act.shape != (self.num_envs, self.action_dim):
            raise ValueError(f"actions must have shape ({self.num_envs}, {self.action_dim}), got {act.shape}")
        invalid = ~np.isfinite(act).all(axis=1)
        if invalid.any():  # a non-finite action holds the end-effector pose instead of crashing the batch
            act[invalid] = hold_actions(torch.from_numpy(self.ee_positions()[invalid])).numpy()
        # Finite rows outside the workspace are clipped to it and counted, as the other backends do;
        # a held (invalid) row is counted as invalid only.
        clipped = ~invalid & ((act < self.ACTION_LOW) | (act > self.ACTION_HIGH)).any(axis=1)
        act = np.clip(act, self.ACTION_LOW, self.ACTION_HIGH)
        return self._finish_step(self._advance(act), invalid, clipped)

    def step_servo_targets(self, targets: np.ndarray):
        """Step every world with the arm's servo targets given per physics substep, instead of an end-effector
        action through the IK controller: what a joint trajectory follower at the physics rate drives
        (`vla-rl sim-robot --input=trajectory`). Returns what :meth:`step` returns.

        targets: (N, substeps, 9) finite, the 7 arm joints (rad) then the 2 fingers (m each) in `sim.arm`'s
        ``SERVO_JOINTS`` order, substep j's held through it; MuJoCo clamps each to its servo's ctrlrange.
        ``info["invalid_actions"]`` and ``info["clipped_actions"]`` are all False: there is no action.
        """
        targets = np.asarray(targets, dtype=np.float64)
        shape = (self.num_envs, self.config.substeps, 9)
        if targets.shape != shape or not np.isfinite(targets).all():
            raise ValueError(f"servo targets must be finite with shape {shape}, got {targets.shape}")
        none = np.zeros(self.num_envs, dtype=bool)
        return self._finish_step(self._advance(None, targets), none, none)

    def _finish_step(self, final_state: np.ndarray, invalid: np.ndarray, clipped: np.ndarray):
        """Count the step, judge success and the ends, reset the worlds that ended, observe: :meth:`step`'s return."""
        self.episode_step += 1
        success = self._success.copy()
        qpos = final_state[:, self._qpos_in_state : self._qpos_in_state + self.model.nq]
        # MuJoCo resets an unstable world to qpos0 by itself (and warns); its clock restarting
        # is how that shows in the rollout's output. Such a world is flagged and reset properly.
        expected_time = self._init_state[:, 0] + self.config.substeps * self.model.opt.timestep
        restarted = np.abs(final_state[:, 0] - expected_time) > 1e-6
        diverged = ~np.isfinite(qpos).all(axis=1) | restarted
        terminated = success | self._failure | diverged
        truncated = (self.episode_step >= self.max_episode_steps) & ~terminated
        final_obs = self._observe()
        done = terminated | truncated
        for i in np.flatnonzero(done):
            self._reset_world(i)
        obs = final_obs
        if done.any():  # only the worlds just reset are observed (rendered) again
            reset = np.flatnonzero(done)
            obs = {key: value.clone() if torch.is_tensor(value) else list(value) for key, value in final_obs.items()}
            for key, value in self._observe(reset).items():
                if torch.is_tensor(value):
                    obs[key][torch.from_numpy(reset)] = value
                else:
                    for i, item in zip(reset, value, strict=True):
                        obs[key][i] = item
        info = {
            "success": torch.from_numpy(success),
            "diverged": torch.from_numpy(diverged),
            "invalid_actions": torch.from_numpy(invalid),
            "clipped_actions": torch.from_numpy(clipped),
            "events": torch.from_numpy(self._fired.copy()),
            "task_id": self._task_id.clone(),
            "final_obs": final_obs,
        }
        to_t = torch.from_numpy
        return obs, to_t(success.astype(np.float32)), to_t(terminated), to_t(truncated), info

    def ee_positions(self) -> np.ndarray:
        """(N, 3) end-effector (grasp site) positions."""
        ee = np.empty((self.num_envs, 3))
        for i, d in enumerate(self.data):  # row copies: several times faster than np.stack here
            ee[i] = d.site_xpos[self._site]
        return ee

    def hold_actions(self) -> torch.Tensor:
        """(N, 4) actions that keep every arm where it is and its gripper as commanded.

        Sent when no action is queued (for instance while the first chunk is still being inferred).
        """
        finger = torch.tensor([d.ctrl[7] for d in self.data], dtype=torch.float64)  # (N,) the left finger's target
        return hold_actions(torch.from_numpy(self.ee_positions()), commanded_grip(finger)).float()

    def privileged_state(self) -> dict[str, np.ndarray]:
        """The task's privileged state of every world, for scripted experts: name -> (N, ...)."""
        per_world = [self.task.privileged_state(self.model, d) for d in self.data]
        return {name: np.stack([state[name] for state in per_world]) for name in per_world[0]}

    def render(self, world: int = 0, camera: str | None = None, size: int = 256) -> np.ndarray:
        """(size, size, 3) uint8 frame of one world, for videos."""
        camera = camera or (self.config.cameras or ["front"])[0]
        return self._renderers.frame(self.data[world], camera, size, model=self._models[world]).copy()

    @property
    def render_restarts(self) -> int:
        """Render worker processes started again after dying (`sim.render.ProcessRenderers`; 0 with threads)."""
        return getattr(self._camera_renderers, "restarts", 0)

    def variation_record(self, world: int) -> dict[str, Any]:
        """What the variation drew for ``world``'s current episode (`sim.variations`; {} in distribution)."""
        return self._varied.record(world)

    def close(self) -> None:
        self._renderers.close()
        self._camera_renderers.close()
        if self._stepper is not None:
            self._stepper.shutdown()
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
        if self._events is not None:  # drawn from the same stream, after the initial state
            self._events.load([i], [draw_events(self.task, self.model, d, self._seeds[i])])
        if self.config.variation:  # drawn from the same stream, after the events
            self._varied.apply(i, d, self._seeds[i])
            mujoco.mj_forward(self._models[i], d)
        self.episode_step[i] = 0
        self._obs_qpos[i] = d.qpos[:9]
        self._obs_ee[i] = d.site_xpos[self._site]

    def _advance(self, act: np.ndarray | None, servo: np.ndarray | None = None) -> np.ndarray:
        """Control and ``substeps`` physics steps for every world: (N, 4) clipped actions in (or, with ``act``
        None, the servo targets (N, substeps, 9) per substep), the (N, nstate) FULLPHYSICS states reached out
        (``self.data`` holds them, positions forwarded).

        The worlds go through ``mujoco.rollout`` in blocks. Its threads release the GIL, so while
        they step block b this thread prepares the controls of the blocks after it and loads the
        results of the blocks before it: the per-world Python work overlaps the physics instead
        of adding to it. Each world's result is the same whatever the blocks.
        """
        if self._stepper is None:
            block = self._blocks[0]
            self._prepare(block, act, servo)
            self._rollout_block(block)
            self._load_results(block)
        else:
            running = []
            for block in self._blocks:
                self._prepare(block, act, servo)
                running.append(self._stepper.submit(self._rollout_block, block))
            for block, job in zip(self._blocks, running):
                job.result()
                self._load_results(block)
        return self._rollout_state[:, -1]

    def _prepare(self, block: slice, act: np.ndarray | None, servo: np.ndarray | None = None) -> None:
        """One IK step (``sim.ik``, batched) for the worlds of ``block``, or their given ``servo`` targets (N,
        substeps, 9) per substep; fills their rollout inputs.

        One pass over the worlds reads what the controller and the rollout need; the math is batched.
        """
        model, site, worlds = self.model, self._site, self.data[block]
        gathered, jacp, jacr = self._gathered[block], self._jacp[block], self._jacr[block]
        site_pos, site_rot = np.empty((len(worlds), 3)), np.empty((len(worlds), 9))
        for j, d in enumerate(worlds):
            site_pos[j] = d.site_xpos[site]
            site_rot[j] = d.site_xmat[site]
            mujoco.mj_jacSite(model, d, jacp[j], jacr[j], site)
            mujoco.mj_getState(model, d, gathered[j], self._gather_spec)
        init, control, k, nc = self._init_state[block], self._control[block], self._nphysics, self._ncontrol
        init[:, :k] = gathered[:, :k]
        init[:, k:] = gathered[:, k + nc :]
        control[:] = gathered[:, None, k : k + nc]  # ctrl, then the mocap poses, for every substep

        ctrl = self._ctrl[block]  # (B, nu)
        if servo is not None:  # the last substep's targets stay in ctrl, as an action's do
            ctrl[:, :9] = servo[block, -1]
            control[:, :, :9] = servo[block]
            return
        q = init[:, self._qpos_in_state : self._qpos_in_state + 7]  # (B, 7)
        jac = np.concatenate([jacp[:, :, :7], jacr[:, :, :7]], axis=1)  # (B, 6, 7)
        self._controller.servo_targets(act[block], q, jac, site_pos, site_rot, out=ctrl)
        control[:, :, : model.nu] = ctrl[:, None, :]

    def _rollout_block(self, block: slice) -> None:
        """Step the worlds of ``block`` through ``mujoco.rollout`` (inputs and outputs preallocated)."""
        self._rollout.rollout(
            self._models[block],
            self._thread_data,
            self._init_state[block],
            self._control[block],
            control_spec=self._control_spec,
            nstep=self.config.substeps,
            state=self._rollout_state[block],
            skip_checks=True,  # shapes are fixed at construction
        )

    def _load_results(self, block: slice) -> None:
        """Write the states the rollout reached, and the servo targets, into the worlds of
        ``block``; forward them and read what the observation and the reward need."""
        model, site, task, stored = self.model, self._site, self.task, self._stored
        final = self._rollout_state[block, -1]  # (B, nstate)
        k, nu = self._nphysics, model.nu
        stored[block, :k] = final[:, :k]
        stored[block, k : k + nu] = self._ctrl[block]
        stored[block, k + nu :] = final[:, k:]
        if self._events is not None:  # the events due at the end of this step set their velocities
            qvel = stored[block, self._qvel_in_state : self._qvel_in_state + model.nv]  # a view
            self._fired[block] = self._events.fire(self.episode_step[block] + 1, qvel, block)
        self._obs_qpos[block] = final[:, self._qpos_in_state : self._qpos_in_state + 9]
        ee = self._obs_ee
        for i in range(block.start, block.stop):
            d = self.data[i]
            mujoco.mj_setState(model, d, stored[i], self._store_spec)
            self._forward_positions(self._models[i], d)  # a varied world's own sizes collide
            ee[i] = d.site_xpos[site]
        worlds = HostWorlds(model, self.data[block])
        self._success[block] = task.success(model, worlds)
        if hasattr(task, "failure"):
            self._failure[block] = task.failure(model, worlds) & ~self._success[block]

    def _observe(self, worlds: np.ndarray | None = None) -> dict[str, Any]:
        """The observation of ``worlds`` (indices; None = all), in that order."""
        index = np.arange(self.num_envs) if worlds is None else worlds
        n, size = len(index), self.config.image_size
        datas = [self.data[i] for i in index]
        obs: dict[str, Any] = {}
        for cam in self.config.cameras:
            models = [self._models[i] for i in index] if self.config.variation else None
            frames = self._camera_renderers.frames(datas, cam, size, np.empty((n, size, size, 3), dtype=np.uint8),
                                                   models)  # fmt: skip
            # uint8 -> [0, 1] in numpy, on this thread: torch would run it on its OpenMP pool, whose
            # threads then spin-wait on the cores that the physics and render threads need next
            # (measured: 0.75 ms per env-step against 1.0 at N = 16 with a 64 px camera on 2 cores).
            images = np.divide(frames.transpose(0, 3, 1, 2), np.float32(255.0), dtype=np.float32)
            obs[image_key(cam)] = torch.from_numpy(images)
        state = np.empty((n, self.state_dim), dtype=np.float32)
        obs[OBS_STATE] = torch.from_numpy(arm_state(self._obs_qpos[index], self._obs_ee[index], out=state))
        if hasattr(self.task, "instructions_of"):  # the instruction is the world's own state (`reach_switch`)
            obs[TASK] = self.task.instructions_of(self.model, np.stack([self.data[i].qpos for i in index]))
        else:
            obs[TASK] = [self.task.instruction] * n
        return obs
