"""LIBERO's five suites as a batched env, built on LeRobot's LIBERO integration (``lerobot[libero]``).

Usage::

    from sim import make_env
    from sim.config import EnvConfig

    env = make_env(EnvConfig(task="libero_spatial", num_envs=10, cameras=["image", "image2"], image_size=256))
    obs = env.reset(seed=0)  # world i runs task i of the suite, from its fixed initial state 0
    obs, reward, terminated, truncated, info = env.step(torch.zeros(10, 7))

``EnvConfig.task`` is a suite (``libero_spatial``, ``libero_object``, ``libero_goal``, ``libero_10``,
``libero_90``: its tasks spread over the worlds, world i runs task i mod n_tasks) or one task of it
(``libero_spatial/3``: every world runs task 3). Needs the ``libero`` extra; `sim.libero_setup`
makes it work offline.

Each world is LeRobot's own ``LiberoEnv`` (``lerobot.envs.libero``) in a worker process
(`sim.subprocess_env`), and the parent turns the batched raw observations into features with
LeRobot's ``preprocess_observation`` and ``LiberoProcessorStep``: the code path of ``lerobot-eval``,
so a policy trained on ``lerobot/libero`` sees what it saw in training:

- ``observation.images.image`` (agentview) and ``observation.images.image2`` (wrist camera):
  (N, 3, S, S) float in [0, 1], rotated by 180 degrees (LIBERO renders upside down and the
  LeRobot LIBERO datasets store the rotated frames); ``EnvConfig.cameras`` picks which
  (``lerobot/libero`` has both at 256 px);
- ``observation.state`` (N, 8): end-effector position (3), end-effector orientation as an
  axis-angle vector (3), the two gripper finger positions (2);
- ``task``: the LIBERO task's language instruction.

Actions (N, 7) are LIBERO's (and ``lerobot/libero``'s) delta end-effector command for the OSC
controller, ``[dx, dy, dz, droll, dpitch, dyaw, gripper]`` in [-1, 1]; gripper -1 opens, +1 closes.

Initial states follow LIBERO's protocol: the fixed initial states shipped with each task (50 per
task). ``reset(seed)`` starts world k of the m worlds running a task at initial state
``(seed * m + k) mod 50`` and every autoreset moves it on by m, so from seed 0 the worlds of a task
walk through states 0, 1, ..., 49 without repeats. One seed per world picks the initial state
itself: ``reset(seed=[s, ...], worlds=[w, ...])`` starts world w at state ``s mod 50``; no seed goes
on to each world's next state; equal per-world seeds give equal starts. Each episode starts with
LeRobot's 10 no-op settling steps (``EnvConfig.settle_steps``; `sim.libero_protocol` names the protocols
that use other counts). A world's saved state (``get_state``) includes the fixture
poses its scene drew (see `LiberoWorld`), so a loaded world steps exactly as its source.

``task_names`` are the config's tasks as task names (``libero_spatial/0`` ... ``libero_spatial/9``
for a suite, so ``info["task_id"]`` is then the suite's task index; ``[libero_spatial/3]`` for one).

Episodes are truncated at LeRobot's per-suite limits (``TASK_SUITE_MAX_STEPS``:
280 spatial and object, 300 goal, 520 libero_10, 400 libero_90) unless
``EnvConfig.max_episode_steps`` is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np

from sim.config import EnvConfig, env_features, is_batch_seed, per_world_seeds
from sim.libero_setup import MISSING_EXTRA, prepare_libero
from sim.robosuite_env import ACTION_NAMES, STATE_NAMES, load_robosuite_state, save_robosuite_state
from sim.subprocess_env import SubprocessBatchedEnv
from vla_core.types import Worlds, world_indices

# Our camera names are LeRobot's LIBERO feature names (its default camera_name_mapping, inverted).
CAMERAS = {"image": "agentview_image", "image2": "robot0_eye_in_hand_image"}
CONTROL_FREQ = 20  # Hz; LIBERO's demonstrations and LeRobot's LiberoEnv run at 20 Hz
DEFAULT_SETTLE_STEPS = 10  # LeRobot's LiberoEnv (num_steps_wait) and openpi: no-op steps after a reset


def _lerobot_libero():
    """LeRobot's LIBERO module, imported after LIBERO's config is in place (else it asks on stdin)."""
    prepare_libero()
    try:
        from lerobot.envs import libero
    except ImportError as err:
        raise ImportError(MISSING_EXTRA) from err
    return libero


def suite_names() -> list[str]:
    """The LIBERO suites (those LeRobot has episode limits for)."""
    return list(_lerobot_libero().TASK_SUITE_MAX_STEPS)


def _suite(name: str):
    from libero.libero import benchmark  # importable: _lerobot_libero() ran first

    return benchmark.get_benchmark_dict()[name]()


@dataclass(frozen=True)
class LiberoTasks:
    """The tasks a config asks for: ``suite`` and its ``task_ids`` with their ``instructions``."""

    suite: str
    task_ids: list[int]
    instructions: list[str]


def resolve_libero_task(name: str) -> LiberoTasks:
    """``libero_spatial`` (all its tasks) or ``libero_spatial/3`` (one) -> the tasks; ValueError names the valid ones."""
    suites = suite_names()
    suite_name, _, task_id = name.partition("/")
    if suite_name not in suites:
        raise ValueError(f"unknown LIBERO suite {suite_name!r}; valid suites: {', '.join(suites)}")
    suite = _suite(suite_name)
    if not task_id:
        ids = list(range(suite.n_tasks))
    elif task_id.isdigit() and int(task_id) < suite.n_tasks:
        ids = [int(task_id)]
    else:
        raise ValueError(
            f"LIBERO suite {suite_name!r} has tasks {suite_name}/0 ... {suite_name}/{suite.n_tasks - 1}, got {name!r}"
        )
    return LiberoTasks(suite_name, ids, [suite.get_task(i).language for i in ids])


def _libero_env_class(libero):
    """LeRobot's ``LiberoEnv``, rendering only the cameras it reports.

    LeRobot builds LIBERO's ``OffScreenRenderEnv`` without ``camera_names``, so LIBERO renders its two
    default cameras every step whatever ``camera_name`` asks for; rendering is most of a step's time
    on a CPU (software OpenGL). This subclass passes the asked cameras, or with ``state_only`` none
    (LeRobot's class refuses an empty camera list: it is given one and drops it), and is otherwise
    LeRobot's class: the frames of a camera it renders are the ones LeRobot's gives.
    """

    class CameraLimitedLiberoEnv(libero.LiberoEnv):
        def __init__(self, *args, state_only: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            if state_only:
                self.camera_name = []
                self.observation_space = gym.spaces.Dict(
                    {k: v for k, v in self.observation_space.spaces.items() if k != "pixels"}
                )

        def _ensure_env(self) -> None:
            if self._env is not None:
                return
            cameras = [name.removesuffix("_image") for name in self.camera_name]  # robosuite's camera names
            env = libero.OffScreenRenderEnv(
                bddl_file_name=self._task_bddl_file, camera_heights=self.observation_height,
                camera_widths=self.observation_width, control_freq=self.control_freq, hard_reset=self.hard_reset,
                camera_names=cameras or ["agentview"], use_camera_obs=bool(cameras),
            )  # fmt: skip
            env.reset()
            self._env = env

    return CameraLimitedLiberoEnv


class LiberoWorld(gym.Wrapper):
    """One world: LeRobot's ``LiberoEnv``, whose state can be saved and loaded.

    LIBERO's scenes are robosuite envs (`sim.robosuite_env.save_robosuite_state`) whose fixed
    fixtures (cabinets, stoves) are placed at random each time a reset rebuilds the scene: their
    poses in the model (``body_pos``, ``body_quat``) are part of a world's state.
    """

    def get_state(self) -> dict[str, Any]:
        env = self._robosuite_env()
        model = env.sim.model._model
        return {"robosuite": save_robosuite_state(env), "body_pos": model.body_pos.copy(),
                "body_quat": model.body_quat.copy()}  # fmt: skip

    def set_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Load a state from :meth:`get_state`; returns the raw observation it had."""
        env = self._robosuite_env()
        model = env.sim.model._model
        model.body_pos[:], model.body_quat[:] = state["body_pos"], state["body_quat"]
        return self.env._format_raw_obs(load_robosuite_state(env, state["robosuite"]))

    def _robosuite_env(self):
        return self.env._env.env  # LiberoEnv -> LIBERO's OffScreenRenderEnv -> its robosuite env


def make_libero_world(
    suite_name: str, task_id: int, first_init_state: int, init_state_stride: int, cameras: list[str], image_size: int,
    episode_length: int, settle_steps: int = DEFAULT_SETTLE_STEPS,
) -> gym.Env:  # fmt: skip
    """One world: LeRobot's ``LiberoEnv`` (runs in a worker; the simulator starts at the first reset), which
    steps ``settle_steps`` no-op actions after each reset."""
    libero = _lerobot_libero()
    world = _libero_env_class(libero)(
        task_suite=_suite(suite_name),
        task_id=task_id,
        task_suite_name=suite_name,
        episode_length=episode_length,
        camera_name=[CAMERAS[c] for c in cameras] or [CAMERAS["image"]],
        state_only=not cameras,
        obs_type="pixels_agent_pos",  # images and the robot state lerobot/libero's observation.state is made of
        observation_width=image_size,
        observation_height=image_size,
        init_states=True,
        episode_index=first_init_state,
        n_envs=init_state_stride,
        control_freq=CONTROL_FREQ,
        control_mode="relative",
        num_steps_wait=settle_steps,
    )
    return LiberoWorld(world)


def lerobot_features(raw: dict[str, Any]) -> dict[str, Any]:
    """Batched raw ``LiberoEnv`` observations -> LeRobot's LIBERO features (see the module doc)."""
    from lerobot.envs.utils import preprocess_observation
    from lerobot.processor.env_processor import LiberoProcessorStep

    # uint8 (N, H, W, 3) pixels -> float (N, 3, H, W) observation.images.*; then the 180-degree
    # image rotation (the one flip) and the 8-dim observation.state.
    return LiberoProcessorStep().observation(preprocess_observation(raw))


class LiberoBatchedEnv(SubprocessBatchedEnv):
    """LIBERO tasks as a batched env (see the module doc): N worlds in N worker processes."""

    def __init__(self, config: EnvConfig):
        tasks = resolve_libero_task(config.task)
        unknown = [c for c in config.cameras if c not in CAMERAS]
        if unknown:
            raise ValueError(
                f"LIBERO cameras are image (agentview) and image2 (wrist), got {list(config.cameras)}; "
                "set --env.cameras='[image,image2]' (or [] for the state alone)"
            )
        n = config.num_envs
        self.suite = tasks.suite
        task_index = np.arange(n) % len(tasks.task_ids)  # (N,) each world's index into the config's tasks
        self.suite_task_ids = np.array(tasks.task_ids)[task_index]  # (N,) LIBERO's task number in the suite
        # World i is the k-th of the m worlds running its task: it starts at init state k and strides by m.
        self._rank = np.array([(self.suite_task_ids[:i] == t).sum() for i, t in enumerate(self.suite_task_ids)])
        self._worlds_per_task = np.array([(self.suite_task_ids == t).sum() for t in self.suite_task_ids])
        max_steps = config.max_episode_steps or _lerobot_libero().TASK_SUITE_MAX_STEPS[tasks.suite]
        settle = DEFAULT_SETTLE_STEPS if config.settle_steps < 0 else config.settle_steps
        make = partial(
            make_libero_world, tasks.suite, cameras=list(config.cameras), image_size=config.image_size,
            episode_length=max_steps, settle_steps=settle,
        )  # fmt: skip
        worlds = [
            partial(make, int(t), int(k), int(m))
            for t, k, m in zip(self.suite_task_ids, self._rank, self._worlds_per_task)
        ]
        super().__init__(
            worlds, lerobot_features, [tasks.instructions[t] for t in task_index], max_steps, config.cameras,
            1.0 / CONTROL_FREQ,
            features=env_features(config.cameras, config.image_size, STATE_NAMES, ACTION_NAMES),
            task_names=[f"{tasks.suite}/{t}" for t in tasks.task_ids], task_ids=task_index.tolist(),
        )  # fmt: skip

    def reset(self, seed: int | Sequence[int] | None = None, *, worlds: Worlds = None) -> dict[str, Any]:
        """New episodes in ``worlds`` (all by default) from LIBERO's fixed initial states: state
        ``(seed * m + k) mod 50`` for an int seed, the given state for per-world seeds, each world's
        next one for no seed (see the module doc)."""
        selected = world_indices(worlds, self.num_envs)
        if seed is not None:
            if is_batch_seed(seed):
                first = int(seed) * self._worlds_per_task[selected] + self._rank[selected]
            else:
                first = per_world_seeds(seed, len(selected))
            init_states = list(self._vector.get_attr("init_state_id"))
            for w, s in zip(selected, first):
                init_states[w] = int(s)
            self._vector.set_attr("init_state_id", init_states)
        return super().reset(seed, worlds=selected)
