"""`vla-rl bench sim`: env-steps/s of each simulator backend, against two baselines run alongside.

For every N in ``num_envs`` (plus ``gpu_num_envs`` when a backend runs on a GPU), in the same
process and run, with the same task, model, N and ``substeps`` physics steps per control step.
What each side computes per control step, per world:

- ``raw_rollout``: the physics alone, the ceiling. One `mujoco.rollout` call over the N worlds
  (the same thread count as the cpu backend) runs ``substeps`` ``mj_step`` each, with constant
  controls (each world's servo targets and mocap poses at reset, so the arms hold still), and the
  states reached are copied in as the next call's initial states. As the cpu backend calls it:
  one `Rollout` (thread pool) for the whole run, inputs and outputs allocated once, and
  ``skip_checks=True``. No controller, no pass after the physics, no observation.
- ``gym_async``: gymnasium's `AsyncVectorEnv` over N :class:`GymTaskEnv` (one world each, one
  worker process each). Each worker does what the cpu backend does for one world: clip the
  action, ``mj_jacSite`` and one `sim.ik` step to servo targets, ``substeps`` ``mj_step``
  (warm start zeroed, as `mujoco.rollout` starts), the same position pass after the physics
  (`sim.poses.forward_positions`: ``mj_kinematics``, ``mj_comPos``, ``mj_camlight``,
  ``mj_collision``; ``mj_forward`` on scenes with tendons, flexes or sensors), the task's success
  check and the (11,) state vector (and the camera frame). On top: the vector env's pipes and
  shared memory.
- each backend (``cpu``: `MujocoBatchedEnv`; ``warp``: MuJoCo Warp) through ``env.step``,
  physics only (``EnvConfig.cameras=[]``) and, when ``include_render``, with the camera. The cpu
  backend does the work above with the IK batched over the worlds and the physics in one
  `mujoco.rollout` call (a few pipelined blocks at large N), plus reading each world's state
  out (``mj_getState``) and writing the result back (``mj_setState``).

Every method holds its worlds still with constant actions (each arm's current end-effector
pose), times ``steps`` control steps after ``warmup_steps`` and reports env-steps/s = N x
control steps / seconds, the fastest of ``repeats`` runs. Episodes never end during a
measurement. Results go to JSON; the last line printed is
``sim_overhead_vs_rollout=<x> speedup_vs_gym_async=<y> render_speedup_vs_gym_async=<z>
libero_speedup_vs_lerobot_async=<w>`` where

- sim_overhead_vs_rollout = raw_rollout / first backend, physics only, at the largest N
  measured on CPU (1.0 = no overhead over the bare physics);
- speedup_vs_gym_async = first backend / gym_async, physics only, at N = 16 (or the largest N
  gym_async ran at, if 16 was not measured);
- render_speedup_vs_gym_async = the same with the camera rendered every step (``include_render``),
  both sides rendering every world's frame: gymnasium in its N worker processes, the backend on
  ``render_threads`` threads of its own process (`sim.render.ParallelRenderers`).

- libero_speedup_vs_lerobot_async = vla-rl's LIBERO env / LeRobot's LiberoEnv under gymnasium's
  AsyncVectorEnv, with cameras, at the largest N both ran (the LIBERO rows' section below states that
  protocol; ``--libero_task=''`` skips the LIBERO rows: "nan").

With the camera, each backend is also measured rendering on one thread (method
``<backend>_serial_render``), the baseline the render threads are measured against.

Protocol history (runs as README.md reports them: ranges over runs, not their final lines):

- 2026-11-29: the first version: raw `mujoco.rollout` ran many control steps per call, and each
  gymnasium worker ended its step with a full ``mj_forward``; the final line had the first two
  ratios. Whether it was fixed before its first result is not recorded. Its figures (README.md of
  2026-11-29, since replaced): ``sim_overhead_vs_rollout`` 1.2-1.3, ``speedup_vs_gym_async``
  about 1.8; with the camera at N = 16, gymnasium the faster (about 920 against 790 env-steps/s).
- 2026-12-01, an amendment after those figures were published: every side does the same MuJoCo
  work per control step, as above (raw rollout: one call per control step, made as the cpu
  backend makes it; gymnasium: the batched env's position pass). Four runs with
  ``--include_render=false``: ``sim_overhead_vs_rollout`` 1.12-1.14, ``speedup_vs_gym_async``
  1.76-1.91.
- 2026-12-01, added after the camera figure above was published, with the render threads it
  measures: ``render_speedup_vs_gym_async`` in the final line and the ``<backend>_serial_render``
  baseline. Four runs at N = 16 with the camera: ``render_speedup_vs_gym_async`` 1.30-1.42.
- 2026-12-02, added before its first result: the LIBERO rows and ``libero_speedup_vs_lerobot_async``
  at the end of the final line (protocol in the LIBERO rows' section below).
- 2026-12-07, added before its first run: ``--render_isolation`` (``thread``, the design so far; ``process``,
  render worker processes, `sim.render.ProcessRenderers`). It chooses the renderer that ships: ``process`` must
  keep ``render_speedup_vs_gym_async`` >= 1.3 at N = 16, the median of 3 runs of ``vla-rl bench sim
  --num_envs='[16]' --render_isolation=<each> --libero_task=''``, the two alternating (thread, process, thread,
  ...), on a machine whose other jobs are stopped for the runs; each run has its own gymnasium baseline. If
  ``process`` clears it, it becomes the default (it removes the race rather than living with it); if not,
  ``thread`` stays and the miss is reported.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium
import mujoco
import numpy as np
import torch
from mujoco import rollout
from tqdm import tqdm

from sim.arm import ACTION_HIGH, ACTION_LOW, EE_IN_STATE, STATE_NAMES, arm_state, hold_actions
from sim.batched_success import is_success
from sim.config import Backend, RenderIsolation
from sim.ik import ArmController
from sim.poses import position_pass
from sim.render import Renderers
from sim.tasks import get_task

SPEEDUP_NUM_ENVS = 16  # N at which speedup_vs_gym_async is read


@dataclass
class BenchSimConfig:
    """Throughput of the batched simulators against mujoco.rollout and gymnasium's AsyncVectorEnv."""

    task: str = "lift"  # task whose scene is stepped; see `sim.tasks.TASKS`
    backends: list[Backend] = field(default_factory=lambda: ["cpu"])  # cpu and/or warp; the first gives the final line
    num_envs: list[int] = field(default_factory=lambda: [1, 16, 256])  # world counts N measured
    gpu_num_envs: list[int] = field(default_factory=lambda: [4096])  # extra N for backends on a CUDA device
    steps: int = 40  # timed control steps per measurement; raise for steadier numbers
    repeats: int = 3  # timed runs per measurement; the fastest counts (slower ones measured interference)
    warmup_steps: int = 2  # untimed control steps before each measurement
    substeps: int = 25  # physics steps per control step (0.002 s each)
    num_threads: int = 0  # physics threads of the cpu backend and raw rollout; 0 = one per CPU core
    include_render: bool = True  # also measure with the camera rendered every step (backends and gym)
    render_threads: int = 0  # the backends' render threads (`EnvConfig.render_threads`); 0 = one per CPU core
    # render in threads of the backend's process or in as many worker processes (`EnvConfig.render_isolation`)
    render_isolation: RenderIsolation = "thread"
    render_max_envs: int = 256  # skip rendering measurements above this N (rendering dominates there)
    gym_max_envs: int = 16  # skip gym_async above this N (it runs one process per world)
    camera: str = "front"  # camera rendered in the with-render measurements
    image_size: int = 64  # rendered image side, pixels
    warp_device: str = "cuda"  # torch device of the warp backend
    seed: int = 0  # seed of the initial states
    # LIBERO rows (their protocol: the "LIBERO rows" section of this module): vla-rl's LIBERO env against
    # LeRobot's LiberoEnv under gymnasium's AsyncVectorEnv, with and without cameras; "" = no LIBERO rows
    libero_task: str = "libero_spatial/0"
    libero_num_envs: list[int] = field(default_factory=lambda: [1, 4, 16])
    libero_cameras: list[str] = field(default_factory=lambda: ["image", "image2"])
    libero_image_size: int = 256
    libero_steps: int = 10  # timed control steps per LIBERO measurement (a LIBERO step is slow on a CPU)
    libero_repeats: int = 1
    libero_warmup_steps: int = 2
    output_json: str = "outputs/bench/sim.json"  # where the results are written


# -- gymnasium baseline -------------------------------------------------------------------------


class GymTaskEnv(gymnasium.Env):
    """One world of a tabletop task as a plain `gymnasium.Env`: the baseline for `AsyncVectorEnv`.

    The same scene, action, controller and physics as one world of `MujocoBatchedEnv`: a 4-D
    end-effector target [x, y, z, grip] clipped to the workspace, one `sim.ik` step to servo
    targets, ``substeps`` calls of ``mj_step``, then the batched env's position pass
    (`sim.poses.forward_positions`, or ``mj_forward`` where it does so) so the next control
    step reads the kinematics of the state reached. Observation: the (11,) state vector (7 joints, gripper
    width, end-effector xyz), or with ``camera`` a dict of it and the (S, S, 3) uint8 image.
    """

    metadata = {"render_modes": []}  # noqa: RUF012 (gymnasium reads this class attribute)
    ACTION_LOW, ACTION_HIGH = ACTION_LOW, ACTION_HIGH  # the arm's workspace (`sim.arm`)

    def __init__(
        self,
        task: str = "lift",
        substeps: int = 25,
        max_episode_steps: int = 0,
        camera: str | None = None,
        image_size: int = 64,
    ):
        self.task = get_task(task)
        self.substeps = substeps
        self.max_episode_steps = max_episode_steps or self.task.max_episode_steps
        self.camera, self.image_size = camera, image_size
        self.model = mujoco.MjModel.from_xml_path(self.task.xml_path())
        self.data = mujoco.MjData(self.model)
        self._renderers = Renderers(self.model)  # a renderer is made at first use, inside the worker process
        self._site = self.model.site("grasp").id
        self._controller = ArmController.from_model(self.model)
        self._forward_positions = position_pass(self.model)  # the pass MujocoBatchedEnv runs
        self._jacp = np.zeros((3, self.model.nv))
        self._jacr = np.zeros((3, self.model.nv))
        self._t = 0
        state_space = gymnasium.spaces.Box(-np.inf, np.inf, (len(STATE_NAMES),), np.float32)  # sim.arm's layout
        if camera is None:
            self.observation_space = state_space
        else:
            image_space = gymnasium.spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)
            self.observation_space = gymnasium.spaces.Dict({"state": state_space, "image": image_space})
        self.action_space = gymnasium.spaces.Box(self.ACTION_LOW, self.ACTION_HIGH, dtype=np.float64)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.task.sample_initial_state(self.model, self.data, self.np_random)
        mujoco.mj_forward(self.model, self.data)
        self._t = 0
        return self._observe(), {}

    def step(self, action):
        d, m = self.data, self.model
        act = np.array(action, dtype=np.float64)
        if not np.isfinite(act).all():  # hold the pose, as MujocoBatchedEnv does
            act = hold_actions(torch.from_numpy(self.ee_position()[None]))[0].numpy()
        act = np.clip(act, self.ACTION_LOW, self.ACTION_HIGH)
        mujoco.mj_jacSite(m, d, self._jacp, self._jacr, self._site)
        jac = np.concatenate([self._jacp[:, :7], self._jacr[:, :7]])[None]  # (1, 6, 7)
        q = d.qpos[None, :7].copy()
        site_pos, site_xmat = d.site_xpos[None, self._site], d.site_xmat[None, self._site]  # (1, 3), (1, 9)
        self._controller.servo_targets(act[None], q, jac, site_pos, site_xmat, out=d.ctrl[None])
        # mujoco.rollout starts every call (every control step) from zero warm-start accelerations;
        # doing the same here keeps this env's trajectories identical to the batched env's.
        d.qacc_warmstart[:] = 0.0
        mujoco.mj_step(m, d, nstep=self.substeps)
        self._forward_positions(m, d)
        self._t += 1
        success = is_success(self.task, m, d)
        terminated = success or not np.isfinite(d.qpos).all()
        truncated = self._t >= self.max_episode_steps and not terminated
        return self._observe(), float(success), terminated, truncated, {"success": success}

    def ee_position(self) -> np.ndarray:
        """(3,) end-effector (grasp site) position."""
        return self.data.site_xpos[self._site].copy()

    def close(self):
        self._renderers.close()

    def _observe(self):
        d = self.data
        state = arm_state(d.qpos[None, :9], d.site_xpos[None, self._site], out=np.empty((1, 11), np.float32))[0]
        if self.camera is None:
            return state
        return {"state": state, "image": self._renderers.frame(d, self.camera, self.image_size)}


# -- measurements -------------------------------------------------------------------------------


def _timed(label: str, cfg: BenchSimConfig, n: int, step) -> tuple[float, float]:
    """(env-steps/s, seconds) of ``cfg.steps`` calls of ``step()`` on N worlds: the fastest of
    ``cfg.repeats`` runs (as timeit does: the slower runs measure other processes too)."""
    best = float("inf")
    with tqdm(total=cfg.steps * cfg.repeats, desc=label, unit="step", leave=False) as bar:
        for _ in range(cfg.repeats):
            start = time.perf_counter()
            for _ in range(cfg.steps):
                step()
                bar.update()
            best = min(best, time.perf_counter() - start)
    return n * cfg.steps / best, best


def _initial_states(task, model: mujoco.MjModel, n: int, seed: int) -> list[mujoco.MjData]:
    """N worlds drawn from the task's reset distribution, each from its own stream of ``seed``."""
    datas = []
    for child in np.random.SeedSequence(seed).spawn(n):
        d = mujoco.MjData(model)
        task.sample_initial_state(model, d, np.random.default_rng(child))
        mujoco.mj_forward(model, d)
        datas.append(d)
    return datas


def raw_rollout_rate(cfg: BenchSimConfig, n: int) -> tuple[float, float]:
    """(env-steps/s, seconds of the fastest run) of bare `mujoco.rollout` on N worlds, constant controls.

    The controls are each world's servo targets and mocap poses at reset (the arm holds still).
    Each control step is one rollout call of ``substeps`` steps from the states the last one
    reached, made as `MujocoBatchedEnv` makes it: one `Rollout` for the run, buffers allocated
    once, ``skip_checks=True``.
    """
    task = get_task(cfg.task)
    model = mujoco.MjModel.from_xml_path(task.xml_path())
    datas = _initial_states(task, model, n, cfg.seed)
    state_spec = mujoco.mjtState.mjSTATE_FULLPHYSICS
    control_spec = mujoco.mjtState.mjSTATE_CTRL | mujoco.mjtState.mjSTATE_MOCAP_POS | mujoco.mjtState.mjSTATE_MOCAP_QUAT
    nstate = mujoco.mj_stateSize(model, state_spec)
    init = np.empty((n, nstate))
    control = np.empty((n, cfg.substeps, mujoco.mj_stateSize(model, control_spec)))
    reached = np.empty((n, cfg.substeps, nstate))  # skip_checks: every shape in full, nothing tiled
    for i, d in enumerate(datas):
        mujoco.mj_getState(model, d, init[i], state_spec)
        mujoco.mj_getState(model, d, control[i, 0], control_spec)
    control[:, 1:] = control[:, :1]
    models = [model] * n
    nthread = min(cfg.num_threads or os.cpu_count() or 1, n)
    thread_data = [mujoco.MjData(model) for _ in range(nthread)]

    with rollout.Rollout(nthread=nthread) as runner:

        def step() -> None:
            runner.rollout(
                models, thread_data, init, control, control_spec=control_spec, nstep=cfg.substeps,
                state=reached, skip_checks=True,
            )  # fmt: skip
            init[:] = reached[:, -1]

        for _ in range(cfg.warmup_steps):
            step()
        return _timed(f"raw_rollout N={n}", cfg, n, step)


def gym_async_rate(cfg: BenchSimConfig, n: int, render: bool) -> tuple[float, float]:
    """(env-steps/s, seconds) of gymnasium's AsyncVectorEnv over N one-world GymTaskEnv workers."""
    make = partial(
        GymTaskEnv, cfg.task, cfg.substeps, max_episode_steps=10**9,
        camera=cfg.camera if render else None, image_size=cfg.image_size,
    )  # fmt: skip
    # forkserver: workers fork from a clean server process, not from this threaded one. The server
    # imports this module once, so each worker starts in milliseconds instead of re-importing it.
    multiprocessing.set_forkserver_preload([__name__])
    envs = gymnasium.vector.AsyncVectorEnv([make] * n, context="forkserver")
    try:
        obs, _ = envs.reset(seed=cfg.seed)
        state = obs["state"] if render else obs
        hold = hold_actions(torch.from_numpy(state[:, EE_IN_STATE]).double()).numpy()  # (N, 4)
        for _ in range(cfg.warmup_steps):
            envs.step(hold)
        return _timed(f"gym_async N={n}{' render' if render else ''}", cfg, n, lambda: envs.step(hold))
    finally:
        envs.close()


def backend_rate(
    cfg: BenchSimConfig, backend: str, n: int, render: bool, render_threads: int | None = None
) -> tuple[float, float]:
    """(env-steps/s, seconds) of ``env.step`` of one backend's batched env on N worlds, rendering on
    ``render_threads`` threads (None: ``cfg.render_threads``)."""
    from sim.config import EnvConfig
    from sim.factory import make_env

    device = cfg.warp_device if backend == "warp" else "cpu"
    env_cfg = EnvConfig(
        task=cfg.task, backend=backend, device=device, num_envs=n, image_size=cfg.image_size,
        cameras=[cfg.camera] if render else [], substeps=cfg.substeps, num_threads=cfg.num_threads,
        render_threads=cfg.render_threads if render_threads is None else render_threads, max_episode_steps=10**9,
        render_isolation=cfg.render_isolation,
    )  # fmt: skip
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step() -> None:
        env.step(hold)
        sync()  # a GPU backend may return before its kernels finish

    with make_env(env_cfg) as env:
        env.reset(seed=cfg.seed)
        hold = env.hold_actions()
        for _ in range(cfg.warmup_steps):
            step()
        return _timed(f"{backend} N={n}{' render' if render else ''}", cfg, n, step)


# -- LIBERO rows ----------------------------------------------------------------------------------
#
# The LIBERO rows of `vla-rl bench sim`: env-steps/s of vla-rl's LIBERO env against LeRobot's
# ``LiberoEnv`` under gymnasium's ``AsyncVectorEnv`` (as ``lerobot-eval`` builds it), in the same run.
#
# Protocol (fixed 2026-12-02, before its first result):
#
# - Task ``libero_task`` (``libero_spatial/0``), N in ``libero_num_envs`` (1, 4, 16) worlds of it, world i
#   from the task's initial state i; the hold action every step (zero end-effector deltas, gripper
#   open), so no episode ends within ``libero_warmup_steps + libero_steps`` (< 220).
# - With cameras: ``libero_cameras`` at ``libero_image_size`` (``image`` and ``image2`` at 256 px, what
#   LIBERO policies read), and without cameras (the state alone).
# - ``libero``: ``LiberoBatchedEnv.step`` (`sim.libero_env`), which includes turning the raw batch into
#   LeRobot's features in the parent (``preprocess_observation`` and ``LiberoProcessorStep``, the
#   180-degree rotation), its time limit and its action checks.
# - ``libero_lerobot_async``: LeRobot's ``make_env`` for LIBERO (``lerobot.envs.factory``, what
#   ``lerobot-eval`` calls: gymnasium's ``AsyncVectorEnv``, one ``LiberoEnv`` per worker process) with the
#   same task, initial states, image size and cameras, stepped with the same actions, then the same
#   ``preprocess_observation`` and ``LiberoProcessorStep`` (what ``lerobot-eval``'s rollout does after each
#   step). LeRobot's ``LiberoEnv`` has no camera-free mode (it refuses an empty camera list, and renders
#   LIBERO's two default cameras whatever it is asked for): its row "without cameras" asks for the
#   agentview camera alone, the least a LeRobot user can ask.
# - Env start and first reset untimed; ``libero_warmup_steps`` untimed steps; then ``libero_steps``
#   timed steps, the fastest of ``libero_repeats`` runs; env-steps/s = N x steps / seconds.
# - Ratios (in ``summary["libero"]``): ``libero_speedup_vs_lerobot_async`` = ``libero`` / LeRobot's with
#   cameras at the largest N both measured; ``libero_state_speedup_vs_lerobot_async`` the same without.
# - A LIBERO world holds about :data:`WORLD_GIB` of memory (its scene's textures in software OpenGL,
#   MuJoCo, robosuite, torch): an N whose worlds would not fit in the memory available at its start is
#   skipped and listed in ``result["skipped"]`` with the reason, rather than killing the run.
#
# Amendments 2026-12-02, to the runner, not to what is measured: the first attempt stopped after the
# N = 4 rows with cameras (LeRobot's workers asked for LIBERO's config on stdin: it is now written before
# any worker server starts; its figures, 3.96 / 4.29 steps/s at N = 1 and 1.96 / 2.09 at N = 4 for
# vla-rl / LeRobot, agree with the later run); the second was killed by the kernel at N = 16 on a 24 GB
# machine, before any N = 16 figure: the memory check above.

WORLD_GIB = 2.9  # resident memory of one LIBERO world with its scene built (measured: 2.8 GB at 256 px)


def available_gib() -> float:
    """Memory available for new processes now (Linux's MemAvailable), GiB."""
    with open("/proc/meminfo") as meminfo:
        kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    return kib / 2**20


def _lerobot_vector_env(cfg, n: int, cameras: list[str]):
    """LeRobot's own LIBERO vector env of ``cfg.libero_task`` on N workers (``lerobot.envs.factory.make_env``)."""
    from lerobot.envs.configs import LiberoEnv as LiberoEnvConfig
    from lerobot.envs.factory import make_env

    from sim.libero_env import CAMERAS, resolve_libero_task

    tasks = resolve_libero_task(cfg.libero_task)
    names = ",".join(CAMERAS[c] for c in cameras) if cameras else CAMERAS["image"]  # LeRobot needs one
    env_cfg = LiberoEnvConfig(task=tasks.suite, task_ids=tasks.task_ids[:1], camera_name=names,
                              observation_height=cfg.libero_image_size, observation_width=cfg.libero_image_size)  # fmt: skip
    return make_env(env_cfg, n_envs=n, use_async_envs=True)[tasks.suite][tasks.task_ids[0]]


def _libero_time(label: str, cfg, n: int, step) -> tuple[float, float]:
    for _ in range(cfg.libero_warmup_steps):
        step()
    return _timed(label, replace(cfg, steps=cfg.libero_steps, repeats=cfg.libero_repeats), n, step)


def libero_lerobot_rate(cfg, n: int, cameras: list[str]) -> tuple[float, float]:
    """(env-steps/s, seconds) of LeRobot's LIBERO vector env on N worlds, with LeRobot's per-step processing."""
    from sim.libero_env import lerobot_features
    from sim.libero_setup import prepare_libero

    prepare_libero()
    vec = _lerobot_vector_env(cfg, n, cameras)
    try:
        vec.reset(seed=list(range(n)))
        hold = np.zeros((n, 7), dtype=np.float32)
        hold[:, -1] = -1.0  # gripper open

        def step() -> None:
            raw = vec.step(hold)[0]
            lerobot_features(raw)

        return _libero_time(f"libero_lerobot_async N={n}{' cameras' if cameras else ''}", cfg, n, step)
    finally:
        vec.close()


def libero_rate(cfg, n: int, cameras: list[str]) -> tuple[float, float]:
    """(env-steps/s, seconds) of ``LiberoBatchedEnv.step`` on N worlds of the task."""
    from sim.config import EnvConfig
    from sim.factory import make_env

    env_cfg = EnvConfig(task=cfg.libero_task, num_envs=n, cameras=list(cameras), image_size=cfg.libero_image_size)
    with make_env(env_cfg) as env:
        env.reset(seed=0)
        hold = torch.zeros(n, env.action_dim)
        hold[:, -1] = -1.0
        return _libero_time(f"libero N={n}{' cameras' if cameras else ''}", cfg, n, lambda: env.step(hold))


def measure_libero(cfg, record, skipped: list[dict[str, Any]]) -> None:
    """Every LIBERO row, each passed to ``record(method, n, render, (rate, seconds))``; an N whose worlds
    would not fit in memory goes to ``skipped``."""
    for n in cfg.libero_num_envs:
        need, free = n * WORLD_GIB, available_gib()
        if need > free:
            skipped.append({"methods": ["libero", "libero_lerobot_async"], "num_envs": n,
                            "reason": f"{n} LIBERO worlds need about {need:.0f} GiB; {free:.0f} GiB available"})  # fmt: skip
            continue
        for cameras in (list(cfg.libero_cameras), []):
            record("libero", n, bool(cameras), libero_rate(cfg, n, cameras))
            record("libero_lerobot_async", n, bool(cameras), libero_lerobot_rate(cfg, n, cameras))


def libero_ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ours over LeRobot's, with and without cameras, at the largest N both measured (None: not measured)."""

    def at(method: str, n: int, render: bool) -> float | None:
        key = (method, n, render)
        return next((r["env_steps_per_s"] for r in rows if (r["method"], r["num_envs"], r["render"]) == key), None)

    out: dict[str, Any] = {}
    for render, name in ((True, "libero_speedup_vs_lerobot_async"), (False, "libero_state_speedup_vs_lerobot_async")):
        both = [r["num_envs"] for r in rows if r["method"] == "libero" and r["render"] == render
                and at("libero_lerobot_async", r["num_envs"], render) is not None]  # fmt: skip
        n = max(both, default=None)
        out[name] = round(at("libero", n, render) / at("libero_lerobot_async", n, render), 3) if n else None
        out[f"{name.removesuffix('_vs_lerobot_async')}_num_envs"] = n
    return out


# -- the benchmark ------------------------------------------------------------------------------


def bench_sim(cfg: BenchSimConfig) -> dict[str, Any]:
    """Measure every method at every N (see the module docstring); write and return the results."""
    from sim.factory import BACKENDS

    if not cfg.backends:
        raise ValueError("backends is empty; choose from: " + ", ".join(BACKENDS))
    for backend in cfg.backends:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if cfg.steps < 1 or cfg.repeats < 1 or not cfg.num_envs or min(cfg.num_envs) < 1:
        raise ValueError("steps and repeats must be >= 1 and num_envs a non-empty list of world counts >= 1")
    get_task(cfg.task)  # unknown task names fail here, before any measurement
    if cfg.libero_task:
        from sim.libero_setup import prepare_libero

        # Before any worker server starts: LeRobot's LIBERO workers import LIBERO as they unpickle their
        # env, and LIBERO asks on stdin for a config unless the environment names one.
        prepare_libero()

    on_gpu = {b: b == "warp" and cfg.warp_device.startswith("cuda") for b in cfg.backends}
    sizes = {b: sorted(set(cfg.num_envs) | (set(cfg.gpu_num_envs) if on_gpu[b] else set())) for b in cfg.backends}
    all_sizes = sorted(set().union(*sizes.values()))

    rows: list[dict[str, Any]] = []

    def record(method: str, n: int, render: bool, measured: tuple[float, float]) -> None:
        rate, seconds = measured
        steps, repeats = (
            (cfg.libero_steps, cfg.libero_repeats) if method.startswith("libero") else (cfg.steps, cfg.repeats)
        )
        rows.append({"method": method, "num_envs": n, "render": render, "env_steps_per_s": round(rate, 1),
                     "seconds": round(seconds, 6), "steps": steps, "repeats": repeats})  # fmt: skip

    for n in all_sizes:
        record("raw_rollout", n, False, raw_rollout_rate(cfg, n))
        if n <= cfg.gym_max_envs:
            record("gym_async", n, False, gym_async_rate(cfg, n, render=False))
            if cfg.include_render and n <= cfg.render_max_envs:
                record("gym_async", n, True, gym_async_rate(cfg, n, render=True))
        for backend in cfg.backends:
            if n not in sizes[backend]:
                continue
            record(backend, n, False, backend_rate(cfg, backend, n, render=False))
            if cfg.include_render and n <= cfg.render_max_envs:
                record(backend, n, True, backend_rate(cfg, backend, n, render=True))
                if n > 1 and (cfg.render_threads or os.cpu_count() or 1) > 1:
                    record(f"{backend}_serial_render", n, True, backend_rate(cfg, backend, n, True, render_threads=1))
    skipped: list[dict[str, Any]] = []
    if cfg.libero_task:
        measure_libero(cfg, record, skipped)

    result = {
        "config": asdict(cfg),
        "machine": {
            "cpu_count": os.cpu_count(),
            "physics_threads": cfg.num_threads or os.cpu_count(),
            "render_threads": cfg.render_threads or os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "mujoco": mujoco.__version__,
            "gymnasium": gymnasium.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "results": rows,
        "skipped": skipped,
        "summary": {b: _ratios(rows, b, on_gpu[b]) for b in cfg.backends},
    }
    if cfg.libero_task:
        result["summary"]["libero"] = libero_ratios(rows)
    out = Path(cfg.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


def _rate(rows: list[dict], method: str, n: int, render: bool = False) -> float | None:
    key = (method, n, render)
    return next((r["env_steps_per_s"] for r in rows if (r["method"], r["num_envs"], r["render"]) == key), None)


def _ratios(rows: list[dict], backend: str, on_gpu: bool) -> dict[str, Any]:
    """The headline ratios of one backend (None where a side was not measured)."""
    ours_n = {r["num_envs"] for r in rows if r["method"] == backend and not r["render"]}
    raw_n = {r["num_envs"] for r in rows if r["method"] == "raw_rollout"} & ours_n
    gym_n = {r["num_envs"] for r in rows if r["method"] == "gym_async" and not r["render"]} & ours_n
    n_raw = max(raw_n, default=None)
    n_gym = SPEEDUP_NUM_ENVS if SPEEDUP_NUM_ENVS in gym_n else max(gym_n, default=None)
    overhead = _rate(rows, "raw_rollout", n_raw) / _rate(rows, backend, n_raw) if n_raw else None
    speedup = _rate(rows, backend, n_gym) / _rate(rows, "gym_async", n_gym) if n_gym else None
    ours_render_n = {r["num_envs"] for r in rows if r["method"] == backend and r["render"]}
    gym_render_n = {r["num_envs"] for r in rows if r["method"] == "gym_async" and r["render"]} & ours_render_n
    n_render = SPEEDUP_NUM_ENVS if SPEEDUP_NUM_ENVS in gym_render_n else max(gym_render_n, default=None)
    render_speedup = (
        _rate(rows, backend, n_render, True) / _rate(rows, "gym_async", n_render, True) if n_render else None
    )
    return {
        # raw rollout runs on the CPU: for a GPU backend this ratio compares against the CPU's physics ceiling
        "sim_overhead_vs_rollout": round(overhead, 3) if overhead else None,
        "overhead_num_envs": n_raw,
        "speedup_vs_gym_async": round(speedup, 3) if speedup else None,
        "speedup_num_envs": n_gym,
        "render_speedup_vs_gym_async": round(render_speedup, 3) if render_speedup else None,
        "render_speedup_num_envs": n_render,
        "on_gpu": on_gpu,
    }


def format_summary(result: dict[str, Any]) -> str:
    """A human table of the results, then the final line of the first backend's ratios."""
    rows = result["results"]
    lines = [f"{'method':<19} {'N':>6} {'render':>6} {'env-steps/s':>12} {'vs raw_rollout':>15}"]
    for r in rows:
        raw = _rate(rows, "raw_rollout", r["num_envs"])
        rel = f"{r['env_steps_per_s'] / raw:.2f}x" if raw else "-"
        render = str(r["render"]).lower()
        lines.append(f"{r['method']:<19} {r['num_envs']:>6} {render:>6} {r['env_steps_per_s']:>12.1f} {rel:>15}")
    lines += [f"skipped {s['methods']} at N={s['num_envs']}: {s['reason']}" for s in result.get("skipped", [])]
    lines.append(f"results: {result['config']['output_json']}")
    lines.append(final_line(result))
    return "\n".join(lines)


def final_line(result: dict[str, Any]) -> str:
    """``sim_overhead_vs_rollout=<x> speedup_vs_gym_async=<y> render_speedup_vs_gym_async=<z>
    libero_speedup_vs_lerobot_async=<w>``: the first backend's ratios, then LIBERO's with cameras
    (the LIBERO rows' section below); "nan" where unmeasured."""
    s = result["summary"][result["config"]["backends"][0]]

    def fmt(x):
        return f"{x:.2f}" if x is not None else "nan"

    overhead, speedup = fmt(s["sim_overhead_vs_rollout"]), fmt(s["speedup_vs_gym_async"])
    render = fmt(s.get("render_speedup_vs_gym_async"))
    libero = fmt(result["summary"].get("libero", {}).get("libero_speedup_vs_lerobot_async"))
    return (
        f"sim_overhead_vs_rollout={overhead} speedup_vs_gym_async={speedup} render_speedup_vs_gym_async={render} "
        f"libero_speedup_vs_lerobot_async={libero}"
    )
