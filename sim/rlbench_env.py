"""RLBench tasks as a batched env: N worlds, each an RLBench ``Environment`` (one CoppeliaSim) in its own
worker process (`sim.subprocess_env`).

Usage::

    from sim import make_env
    from sim.config import EnvConfig

    env = make_env(EnvConfig(task="rlbench/close_jar", num_envs=4, cameras=["front", "wrist"], image_size=128))
    obs = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(env.hold_actions())

``EnvConfig.task`` is ``rlbench/<task>``, the task's module in ``rlbench.tasks`` (`sim.rlbench_protocol`
lists PerAct's 18). Needs CoppeliaSim 4.1, PyRep and RLBench (:data:`MISSING_RLBENCH`); nothing of them is
imported outside the worker functions, so building the env where they are missing fails with one message.

Actions (N, 8), by ``EnvConfig.rlbench_action_mode`` (RLBench's ``MoveArmThenGripper``: the arm moves,
then the gripper acts; ``gripper_action_modes.Discrete``: > 0.5 opens, otherwise closes):

- ``keypose`` (PerAct's setting): ``[x, y, z, qx, qy, qz, qw, gripper_open]``, an end-effector pose in the
  world frame, quaternion scalar last (RLBench's order, see `sim.rlbench_protocol`), reached by
  ``arm_action_modes.EndEffectorPoseViaPlanning`` (a planned path; one step is one keypose). The
  quaternion is normalized before it is sent (RLBench refuses a non-unit one); positions are clipped
  to PerAct's scene bounds (:data:`KEYPOSE_LOW`, :data:`KEYPOSE_HIGH`).
- ``joint``: ``[q1 .. q7, gripper_open]``, absolute joint targets (``arm_action_modes.JointPosition``),
  clipped to the Panda's joint limits; one step is one CoppeliaSim step (0.05 s).

Observations: ``observation.images.<camera>`` (N, 3, S, S) float in [0, 1] from ``Observation.<camera>_rgb``
(cameras of :data:`CAMERAS`), ``observation.state`` (N, 8) in the action's own form (keypose:
``gripper_pose`` and ``gripper_open``; joint: ``joint_positions`` and ``gripper_open``), so the hold action
is the state itself; ``task`` is RLBench's first description of the episode's variation (what PerAct
conditions on), refreshed whenever a world starts an episode.

Success is RLBench's (``reward >= 1``, PerAct's rule), except on ``close_jar``, where the corrected
predicate `sim.rlbench_protocol.close_jar_success` replaces the PerAct fork's. An action RLBench cannot
carry out (no IK solution, no path, a target outside the workspace) ends the episode as a failure, as
PerAct's evaluation does. Episodes end on success or after ``max_episode_steps`` (default: 25 keyposes,
PerAct's; 200 joint steps, ours).

Seeds: world w of ``reset(seed)`` gets seed ``seed * N + w`` (so the rounds seed, seed + 1, ... of an
evaluation never repeat an episode); one int per world is used as given. Without
``rlbench_demo_root`` the seed seeds numpy's and Python's RNGs in the worker, from which RLBench draws
the variation (unless ``rlbench_variation`` fixes it) and the object placement; with it, the seed is the
number of a stored episode (``<root>/<task>/all_variations/episodes/episode<seed>``), which the world
resets to (``TaskEnvironment.reset_to_demo``, PerAct's evaluation), and an autoreset moves on by N.
``get_state``/``set_state`` are refused (see :meth:`RLBenchBatchedEnv.get_state`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, NamedTuple

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from sim.config import EnvConfig, env_features, is_batch_seed
from sim.rlbench_protocol import (
    PERACT,
    PERACT_TASKS,
    CloseJarObjects,
    close_jar_success,
    resolve_rlbench_task,
    task_class_name,
)
from sim.subprocess_env import SubprocessBatchedEnv
from vla_core.robot import SIM_PANDA
from vla_core.types import OBS_STATE, TASK, Worlds, image_key, world_indices

CAMERAS = ("front", "left_shoulder", "right_shoulder", "wrist", "overhead")  # RLBench's five cameras
ACTION_MODES = ("keypose", "joint")
ACTION_NAMES = {
    "keypose": ["x", "y", "z", "qx", "qy", "qz", "qw", "gripper_open"],
    "joint": [f"joint{i}" for i in range(1, 8)] + ["gripper_open"],
}
STATE_NAMES = ACTION_NAMES  # the state is in the action's form: holding is commanding the state
# PerAct's scene bounds (conf/eval.yaml rlbench.scene_bounds, m, world frame): where its keyposes lie.
KEYPOSE_LOW = np.array([-0.3, -0.5, 0.6, -1.0, -1.0, -1.0, -1.0, 0.0])
KEYPOSE_HIGH = np.array([0.7, 0.5, 1.6, 1.0, 1.0, 1.0, 1.0, 1.0])
# The Panda's joint limits (rad; the robot of RLBench's scenes), then the gripper command.
JOINT_LOW = np.array([SIM_PANDA.joint_limits[f"joint{i}"][0] for i in range(1, 8)] + [0.0])
JOINT_HIGH = np.array([SIM_PANDA.joint_limits[f"joint{i}"][1] for i in range(1, 8)] + [1.0])
# Seconds per step: a joint step is one CoppeliaSim step of RLBench's scene (0.05 s); a keypose has no
# fixed duration (a planned path), so its 1 s is nominal: it turns latencies into steps and sets video fps.
CONTROL_DT = {"keypose": 1.0, "joint": 0.05}
MAX_EPISODE_STEPS = {"keypose": PERACT.episode_length, "joint": 200}  # PerAct's 25 keyposes; 10 s of joint steps
MISSING_RLBENCH = (
    "RLBench tasks need CoppeliaSim 4.1, PyRep and RLBench, none of which a package registry provides: "
    "download CoppeliaSim 4.1 (coppeliarobotics.com, Ubuntu build), set COPPELIASIM_ROOT=<its folder>, "
    "LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$COPPELIASIM_ROOT and QT_QPA_PLATFORM_PLUGIN_PATH=$COPPELIASIM_ROOT, "
    "then pip install git+https://github.com/stepjam/PyRep.git (the PyPI 'pyrep' is another project) and "
    "RLBench from GitHub: git+https://github.com/stepjam/RLBench.git, or for PerAct's setting its fork "
    "MohitShridhar/RLBench, branch peract"
)


def require_rlbench() -> None:
    """Raise ImportError(:data:`MISSING_RLBENCH`) unless RLBench is importable and CoppeliaSim is configured."""
    if importlib.util.find_spec("rlbench") is None or not os.environ.get("COPPELIASIM_ROOT"):
        raise ImportError(MISSING_RLBENCH)


# -- the conversions at RLBench's boundary (pure numpy, tested without the simulator) --------------


def to_rlbench_action(action: Any, mode: str) -> np.ndarray:
    """Our action (8,) -> the (8,) array ``MoveArmThenGripper.action`` takes: the arm mode's 7 numbers
    (``EndEffectorPoseViaPlanning``: x, y, z, qx, qy, qz, qw with a unit quaternion; ``JointPosition``:
    7 joint targets), then ``Discrete``'s one (1.0 open where the command is > 0.5, else 0.0).

    Raises ValueError for a keypose whose quaternion has (nearly) no length: it names no rotation.
    """
    a = np.asarray(action, dtype=np.float64).reshape(-1)
    if a.shape != (8,):
        raise ValueError(f"an RLBench {mode} action has 8 numbers, got {a.shape[0]}")
    command = a.copy()
    if mode == "keypose":
        norm = np.linalg.norm(a[3:7])
        if norm < 1e-6:
            raise ValueError(f"the keypose quaternion {a[3:7].tolist()} has no length; it names no rotation")
        command[3:7] = a[3:7] / norm
    command[7] = 1.0 if a[7] > 0.5 else 0.0  # Discrete's own threshold, applied here so the record shows it
    return command


def raw_observation(obs: Any, mode: str, cameras: Sequence[str]) -> dict[str, Any]:
    """An RLBench ``Observation`` -> this world's raw observation: ``robot_state`` (8,) float64 (keypose:
    ``gripper_pose`` x, y, z, qx, qy, qz, qw; joint: ``joint_positions``; then ``gripper_open``) and,
    with cameras, ``pixels`` {camera: (S, S, 3) uint8} from ``<camera>_rgb``."""
    arm = obs.gripper_pose if mode == "keypose" else obs.joint_positions
    state = np.concatenate([np.asarray(arm, dtype=np.float64).reshape(7), [float(obs.gripper_open)]])
    raw: dict[str, Any] = {"robot_state": state}
    if cameras:
        raw["pixels"] = {cam: _as_uint8(getattr(obs, f"{cam}_rgb")) for cam in cameras}
    return raw


def _as_uint8(image: Any) -> np.ndarray:
    """(S, S, 3) RGB as uint8: RLBench's observations hold uint8; PyRep's sensors return floats in [0, 1]."""
    array = np.asarray(image)
    if array.dtype == np.uint8:
        return array
    return (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def lerobot_observation(raw: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Batched raw observations -> ``observation.images.<camera>`` (N, 3, S, S) float in [0, 1] and
    ``observation.state`` (N, 8) float32."""
    obs = {OBS_STATE: torch.as_tensor(np.asarray(raw["robot_state"]), dtype=torch.float32)}
    for cam, pixels in raw.get("pixels", {}).items():
        obs[image_key(cam)] = torch.from_numpy(np.ascontiguousarray(pixels)).permute(0, 3, 1, 2).float() / 255.0
    return obs


# -- one world, in its worker process ---------------------------------------------------------------


@dataclass(frozen=True)
class WorldSpec:
    """What one world needs to build and run its task (picklable: it travels to the worker)."""

    task: str  # module of rlbench.tasks, e.g. close_jar
    mode: str  # keypose or joint
    cameras: tuple[str, ...]
    image_size: int
    variation: int  # -1 = drawn each episode
    demo_root: str  # "" = new random scenes; else stored episodes to reset to
    stride: int  # worlds in the batch: an autoreset from stored episodes moves on by this many


class Launched(NamedTuple):
    """A started RLBench task: its ``TaskEnvironment``, the errors its ``step`` raises for an action it cannot
    carry out, the close_jar objects (None for other tasks) and how to shut the simulator down."""

    task_env: Any
    action_errors: tuple[type[BaseException], ...]
    close_jar_objects: Callable[[], CloseJarObjects] | None
    shutdown: Callable[[], None]


def launch_rlbench(spec: WorldSpec) -> Launched:
    """Start CoppeliaSim headless with ``spec``'s task (imports RLBench and PyRep; call it in the worker)."""
    from pyrep.errors import ConfigurationPathError, IKError
    from pyrep.objects.proximity_sensor import ProximitySensor
    from rlbench.action_modes.action_mode import MoveArmThenGripper
    from rlbench.action_modes.arm_action_modes import EndEffectorPoseViaPlanning, JointPosition
    from rlbench.action_modes.gripper_action_modes import Discrete
    from rlbench.backend.exceptions import InvalidActionError
    from rlbench.environment import Environment
    from rlbench.observation_config import ObservationConfig

    obs_config = ObservationConfig()
    obs_config.set_all(False)  # render and read only what the observation holds
    obs_config.gripper_pose = obs_config.joint_positions = obs_config.gripper_open = True
    for cam in spec.cameras:
        camera = getattr(obs_config, f"{cam}_camera")
        camera.rgb, camera.image_size = True, (spec.image_size, spec.image_size)
    arm = EndEffectorPoseViaPlanning() if spec.mode == "keypose" else JointPosition(absolute_mode=True)
    env = Environment(
        MoveArmThenGripper(arm_action_mode=arm, gripper_action_mode=Discrete()),
        dataset_root=spec.demo_root, obs_config=obs_config, headless=True,
    )  # fmt: skip
    env.launch()
    task_class = getattr(importlib.import_module(f"rlbench.tasks.{spec.task}"), task_class_name(spec.task))
    task_env = env.get_task(task_class)
    objects = None
    if spec.task == "close_jar":
        task = task_env._task  # the CloseJar instance: its lid and the robot it was built with

        def objects() -> CloseJarObjects:
            return CloseJarObjects(task.lid, ProximitySensor("success"), task.robot.gripper)

    return Launched(task_env, (InvalidActionError, IKError, ConfigurationPathError), objects, env.shutdown)


class RLBenchWorld(gym.Env):
    """One RLBench task as a Gymnasium env (see the module doc); the simulator starts at the first reset.

    ``launch`` builds the task (:func:`launch_rlbench`; a stand-in object in the tests, where
    CoppeliaSim cannot run). Observations: ``robot_state`` (8,) and, with cameras, ``pixels``.
    """

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(self, spec: WorldSpec, launch: Callable[[WorldSpec], Launched] = launch_rlbench):
        self.spec, self._launch = spec, launch
        observation: dict[str, spaces.Space] = {"robot_state": spaces.Box(-np.inf, np.inf, (8,), np.float64)}
        if spec.cameras:
            frame = spaces.Box(0, 255, (spec.image_size, spec.image_size, 3), np.uint8)
            observation["pixels"] = spaces.Dict({cam: frame for cam in spec.cameras})
        self.observation_space = spaces.Dict(observation)
        low, high = (KEYPOSE_LOW, KEYPOSE_HIGH) if spec.mode == "keypose" else (JOINT_LOW, JOINT_HIGH)
        self.action_space = spaces.Box(low.astype(np.float32), high.astype(np.float32), dtype=np.float32)
        self._sim: Launched | None = None
        self._episode: int | None = None  # the stored episode of the current one (with demo_root)
        self._raw: dict[str, Any] = {}
        self.description = spec.task  # the current episode's instruction
        self.failed_actions = 0  # actions RLBench could not carry out, over this world's life

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if self._sim is None:
            self._sim = self._launch(self.spec)
        task_env = self._sim.task_env
        if self.spec.demo_root:  # PerAct's evaluation: stored episode k, its variation and its scene
            self._episode = seed if seed is not None else (self._episode or 0) + self.spec.stride
            task_env.set_variation(-1)  # -1: the episodes of all variations, as they are stored
            (demo,) = task_env.get_demos(1, live_demos=False, random_selection=False, from_episode_number=self._episode)
            task_env.set_variation(demo.variation_number)
            descriptions, obs = task_env.reset_to_demo(demo)
        else:
            if seed is not None:  # RLBench draws variations and placements from these global RNGs
                np.random.seed(seed % 2**32)
                random.seed(seed)
            if self.spec.variation >= 0:
                task_env.set_variation(self.spec.variation)
            else:
                task_env.sample_variation()
            descriptions, obs = task_env.reset()
        self.description = descriptions[0]  # PerAct conditions on the first description
        self._raw = raw_observation(obs, self.spec.mode, self.spec.cameras)
        return self._raw, {"is_success": False}

    def step(self, action: np.ndarray):
        sim = self._sim
        try:
            obs, reward, _ = sim.task_env.step(to_rlbench_action(action, self.spec.mode))
        except (ValueError, *sim.action_errors):  # PerAct's evaluation: the episode ends, failed
            self.failed_actions += 1
            return self._raw, 0.0, True, False, {"is_success": False}
        self._raw = raw_observation(obs, self.spec.mode, self.spec.cameras)
        if sim.close_jar_objects is not None:
            success = close_jar_success(sim.close_jar_objects())
        else:
            success = reward >= 1.0  # PerAct's rule (RLBench's reward is 1.0 where every condition holds)
        return self._raw, float(success), success, False, {"is_success": success}

    def instruction(self) -> str:
        return self.description

    def close(self) -> None:
        if self._sim is not None:
            self._sim.shutdown()
            self._sim = None


# -- the batch --------------------------------------------------------------------------------------


def check_rlbench_config(config: EnvConfig, task: str) -> None:
    """The RLBench fields of ``config``, for ``task``; ValueError naming the fix."""
    if config.rlbench_action_mode not in ACTION_MODES:
        raise ValueError(f"--env.rlbench_action_mode must be keypose or joint, got {config.rlbench_action_mode!r}")
    unknown = [c for c in config.cameras if c not in CAMERAS]
    if unknown:
        raise ValueError(f"RLBench cameras are {', '.join(CAMERAS)}, got {unknown}; set --env.cameras='[front,wrist]'")
    count = PERACT_TASKS.get(task)
    if config.rlbench_variation < -1 or (count is not None and config.rlbench_variation >= count):
        bound = f"0..{count - 1}" if count else ">= 0"
        raise ValueError(f"--env.rlbench_variation={config.rlbench_variation}: use -1 (drawn) or a variation {bound}")
    if config.rlbench_demo_root and config.rlbench_variation != -1:
        raise ValueError(
            "stored episodes carry their own variation; drop --env.rlbench_variation or --env.rlbench_demo_root"
        )


class RLBenchBatchedEnv(SubprocessBatchedEnv):
    """RLBench tasks as a batched env (see the module doc): N worlds in N worker processes.

    ``launch`` replaces :func:`launch_rlbench` in every world (the tests' stand-in; the factory never
    passes it), which also skips the check that RLBench is installed.
    """

    def __init__(self, config: EnvConfig, *, launch: Callable[[WorldSpec], Launched] | None = None):
        task = resolve_rlbench_task(config.task)
        check_rlbench_config(config, task)
        if launch is None:
            require_rlbench()
            launch = launch_rlbench
        mode, n = config.rlbench_action_mode, config.num_envs
        spec = WorldSpec(task, mode, tuple(config.cameras), config.image_size, config.rlbench_variation,
                         config.rlbench_demo_root, n)  # fmt: skip
        self.task_name, self.action_mode = task, mode
        super().__init__(
            [partial(RLBenchWorld, spec, launch)] * n, lerobot_observation, [task] * n,
            config.max_episode_steps or MAX_EPISODE_STEPS[mode], config.cameras, CONTROL_DT[mode],
            features=env_features(config.cameras, config.image_size, STATE_NAMES[mode], ACTION_NAMES[mode]),
            task_names=[config.task], task_ids=[0] * n,
        )  # fmt: skip

    def reset(self, seed: int | Sequence[int] | None = None, *, worlds: Worlds = None) -> dict[str, Any]:
        """New episodes in ``worlds``; world w of ``reset(seed)`` (an int) gets ``seed * N + w`` (see the module doc)."""
        selected = world_indices(worlds, self.num_envs)
        if seed is not None and is_batch_seed(seed):
            seed = [int(seed) * self.num_envs + int(w) for w in selected]
        obs = super().reset(seed, worlds=selected)
        self._refresh_instructions(obs)
        return obs

    def step(self, actions: torch.Tensor | np.ndarray):
        """As `SubprocessBatchedEnv.step`; the worlds that started an episode report its instruction
        (``info["final_obs"]`` keeps the ended episode's)."""
        obs, reward, terminated, truncated, info = super().step(actions)
        if (terminated | truncated).any():
            self._refresh_instructions(obs)
        return obs, reward, terminated, truncated, info

    def hold_actions(self) -> torch.Tensor:
        """(N, 8): every world's current state, which is the action that keeps it there (keypose: the
        current pose and gripper; joint: the current joint positions and gripper)."""
        return self._last_obs[OBS_STATE].clone()

    def get_state(self, worlds: Worlds = None) -> list[dict[str, Any]]:
        """Refused: RLBench (through PyRep) restores a task's object poses but not CoppeliaSim's dynamics,
        the gripper's attached objects or the planner's state, so a loaded world would not evolve as the
        saved one."""
        raise NotImplementedError(
            "RLBench worlds cannot be saved and loaded (CoppeliaSim's dynamic state is not exposed through "
            "PyRep); start worlds alike with reset(seed=[s, s, ...], worlds=[...]) (equal per-world seeds give "
            "equal scenes) instead of get_state/set_state"
        )

    def set_state(self, states: Sequence[dict[str, Any]], worlds: Worlds = None) -> dict[str, Any]:
        """Refused, as :meth:`get_state`."""
        self.get_state(worlds)
        return {}

    def failed_actions(self) -> list[int]:
        """Per world, the actions RLBench could not carry out (each ended its episode as a failure)."""
        return [int(n) for n in self._vector.get_attr("failed_actions")]

    def _refresh_instructions(self, obs: dict[str, Any]) -> None:
        self.instructions = [str(text) for text in self._vector.call("instruction")]
        obs[TASK] = list(self.instructions)
