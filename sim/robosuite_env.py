"""robosuite 1.4 tasks (Lift, Stack, PickPlaceCan) as a batched env, with LIBERO's conventions.

Usage::

    from sim import make_env
    from sim.config import EnvConfig

    env = make_env(EnvConfig(task="robosuite/Lift", num_envs=4, cameras=["agentview", "robot0_eye_in_hand"]))
    obs = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(torch.zeros(4, 7))

``EnvConfig.task`` is ``robosuite/<Task>`` with a task of :data:`TASKS`. robosuite comes with the
``libero`` extra. Each world is a Panda with robosuite's ``OSC_POSE`` controller at 20 Hz (the
robot and controller LIBERO is built on) in its own worker process (`sim.subprocess_env`);
object placements are random, drawn from numpy's global RNG of the worker, seeded by ``reset``.

- ``observation.images.<camera>``: (N, 3, S, S) float in [0, 1], one per ``EnvConfig.cameras``
  (:data:`CAMERAS`; an empty list runs physics only, several times faster). robosuite renders
  upside down (OpenGL rows); the image is flipped vertically once, in the worker, so it shows
  what the camera sees.
- ``observation.state`` (N, 8): end-effector position (3), end-effector orientation as an
  axis-angle vector (3), the two gripper finger positions (2): the layout of ``lerobot/libero``.
- ``task``: the instruction of :data:`TASKS`.

Actions (N, 7): ``[dx, dy, dz, droll, dpitch, dyaw, gripper]`` in [-1, 1], OSC_POSE's delta
end-effector command (as in LIBERO); gripper -1 opens, +1 closes. Success is robosuite's own
``_check_success()``; an episode ends on success or after :data:`MAX_EPISODE_STEPS`.

``task_names`` is ``[config.task]`` (every ``info["task_id"]`` is 0). Seeds: world i of a
``reset(seed)`` is seeded ``seed + i``; equal per-world seeds give equal placements. A saved
world (:func:`save_robosuite_state`) holds MuJoCo's integration state and robosuite's own (step
count, gripper command, observation samplers), so a loaded world observes and steps exactly as
the one it was saved from.
"""

from __future__ import annotations

import copy
import importlib.util
from functools import partial
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from sim.config import EnvConfig, env_features
from sim.subprocess_env import SubprocessBatchedEnv

PREFIX = "robosuite/"
TASKS = {  # robosuite environment name -> instruction
    "Lift": "lift the red cube",
    "Stack": "stack the red cube on top of the green cube",
    "PickPlaceCan": "pick up the can and place it in its bin",
}
MAX_EPISODE_STEPS = {"Lift": 300, "Stack": 500, "PickPlaceCan": 500}  # 15-25 s at 20 Hz: several times a demo
CAMERAS = ("agentview", "robot0_eye_in_hand", "frontview", "birdview", "sideview")  # single-arm scenes' cameras
CONTROL_FREQ = 20  # Hz
SCENE_SEED = 0  # seed of the random object sizes robosuite draws when it builds a scene
# observation.state and action of lerobot/libero's layout (the LIBERO backend's too)
STATE_NAMES = ["eef_x", "eef_y", "eef_z", "eef_axis_angle_x", "eef_axis_angle_y", "eef_axis_angle_z",
               "gripper_finger_left", "gripper_finger_right"]  # fmt: skip
ACTION_NAMES = ["dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper"]
STATE_DIM = len(STATE_NAMES)
MISSING_EXTRA = 'robosuite is not installed; it comes with the libero extra: pip install -e ".[libero]"'


class RobosuiteWorld(gym.Env):
    """One robosuite task as a Gymnasium env with LeRobot's raw observation layout.

    Observations: ``pixels`` {camera: (S, S, 3) uint8, upright} when there are cameras, and
    ``agent_pos`` (8,) float64. The simulator is built at the first reset, inside the worker.
    """

    metadata: ClassVar[dict] = {"render_modes": [], "render_fps": CONTROL_FREQ}

    def __init__(self, task: str, cameras: list[str], image_size: int):
        self.task, self.cameras, self.image_size = task, list(cameras), image_size
        observation: dict[str, spaces.Space] = {
            "agent_pos": spaces.Box(-np.inf, np.inf, shape=(STATE_DIM,), dtype=np.float64)
        }
        if self.cameras:
            frame = spaces.Box(0, 255, shape=(image_size, image_size, 3), dtype=np.uint8)
            observation["pixels"] = spaces.Dict({cam: frame for cam in self.cameras})
        self.observation_space = spaces.Dict(observation)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(7,), dtype=np.float32)
        self._env = None
        self._flip_rows = True

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if self._env is None:
            # robosuite draws some object sizes (Lift's cube: 2.0-2.2 cm) from numpy's global RNG when
            # it builds the scene, once per world: a fixed seed gives every world and run the same scene.
            # The RNG is put back after, so unseeded episodes still differ from world to world.
            outside = np.random.get_state()
            np.random.seed(SCENE_SEED)
            self._env = self._make()
            np.random.set_state(outside)
        if seed is not None:  # robosuite's placement samplers draw from numpy's global RNG
            np.random.seed(seed)
        return self._format(self._env.reset()), {"is_success": False}

    def get_state(self) -> dict[str, Any]:
        """This world's state (:func:`save_robosuite_state`); the worker's `SubprocessBatchedEnv` calls it."""
        return save_robosuite_state(self._env)

    def set_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Load a state from :meth:`get_state`; returns the raw observation it had."""
        return self._format(load_robosuite_state(self._env, state))

    def step(self, action: np.ndarray):
        raw, _, _, _ = self._env.step(action)
        success = bool(self._env._check_success())
        return self._format(raw), float(success), success, False, {"is_success": success}

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def _make(self):
        import robosuite
        from robosuite import load_controller_config, macros

        # OpenGL images have their first row at the bottom; flip unless robosuite already does.
        self._flip_rows = macros.IMAGE_CONVENTION == "opengl"
        return robosuite.make(
            self.task,
            robots="Panda",
            controller_configs=load_controller_config(default_controller="OSC_POSE"),
            has_renderer=False,
            has_offscreen_renderer=bool(self.cameras),
            use_camera_obs=bool(self.cameras),
            camera_names=self.cameras or "agentview",
            camera_heights=self.image_size,
            camera_widths=self.image_size,
            control_freq=CONTROL_FREQ,
            ignore_done=True,  # episode ends are the TimeLimit's and the success check's
            reward_shaping=False,
            hard_reset=False,  # rebuilding the model and renderer every episode costs seconds
        )

    def _format(self, raw: dict[str, np.ndarray]) -> dict[str, Any]:
        from robosuite.utils.transform_utils import quat2axisangle

        state = np.concatenate(
            [raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]]
        )
        obs: dict[str, Any] = {"agent_pos": state}
        if self.cameras:
            rows = slice(None, None, -1) if self._flip_rows else slice(None)
            obs["pixels"] = {cam: raw[f"{cam}_image"][rows] for cam in self.cameras}
        return obs


# What a robosuite observable keeps between samples: its clock, whether it sampled this period, its
# sampling delay and the value it reports (observations come from these, not from the simulator).
_OBSERVABLE_FIELDS = ("_time_since_last_sample", "_sampled", "_current_delay", "_current_observed_value")
# What the OSC controller keeps across steps: the episode's first pose (its null-space target) and
# the current goal.
_CONTROLLER_FIELDS = ("initial_joint", "initial_ee_pos", "initial_ee_ori_mat", "goal_pos", "goal_ori", "relative_ori",
                      "ori_ref")  # fmt: skip


def save_robosuite_state(env) -> dict[str, Any]:
    """Everything a robosuite env's observation and next steps depend on (robosuite or LIBERO).

    MuJoCo's integration state (physics, controls, the solver's warm start), robosuite's step count
    and clock, each arm controller's episode start pose and goal, each gripper's commanded opening
    (the Panda gripper moves it by a rate limit), and the observables' samplers and values with
    their cache.
    """
    import mujoco

    model, data = env.sim.model._model, env.sim.data._data
    physics = np.empty(mujoco.mj_stateSize(model, mujoco.mjtState.mjSTATE_INTEGRATION))
    mujoco.mj_getState(model, data, physics, mujoco.mjtState.mjSTATE_INTEGRATION)
    return {
        "physics": physics,
        "timestep": env.timestep,
        "cur_time": env.cur_time,
        "controllers": [
            copy.deepcopy({f: getattr(robot.controller, f) for f in _CONTROLLER_FIELDS}) for robot in env.robots
        ],
        "grippers": [np.array(robot.gripper.current_action) for robot in env.robots],
        "observables": {
            name: copy.deepcopy({f: getattr(o, f) for f in _OBSERVABLE_FIELDS}) for name, o in env._observables.items()
        },
        "obs_cache": copy.deepcopy(env._obs_cache),
    }


def load_robosuite_state(env, state: dict[str, Any]) -> dict[str, Any]:
    """Load a state from :func:`save_robosuite_state` into ``env``; returns its raw observations."""
    import mujoco

    model, data = env.sim.model._model, env.sim.data._data
    mujoco.mj_setState(model, data, state["physics"], mujoco.mjtState.mjSTATE_INTEGRATION)
    env.sim.forward()
    env.timestep, env.cur_time = state["timestep"], state["cur_time"]
    for robot, controller, grip in zip(env.robots, copy.deepcopy(state["controllers"]), state["grippers"]):
        for name, value in controller.items():
            setattr(robot.controller, name, value)
        robot.controller.new_update = True  # the controller rereads the arm's pose at the next action
        robot.gripper.current_action = grip.copy()
    for name, fields in copy.deepcopy(state["observables"]).items():
        for field_name, value in fields.items():
            setattr(env._observables[name], field_name, value)
    env._obs_cache = copy.deepcopy(state["obs_cache"])
    return env._get_observations()


def resolve_robosuite_task(name: str) -> str:
    """``robosuite/Lift`` -> ``Lift``; ValueError lists the valid names."""
    task = name.removeprefix(PREFIX)
    if not name.startswith(PREFIX) or task not in TASKS:
        raise ValueError(f"unknown robosuite task {name!r}; valid tasks: {', '.join(PREFIX + t for t in TASKS)}")
    return task


def lerobot_features(raw: dict[str, Any]) -> dict[str, Any]:
    """Batched raw observations -> ``observation.images.<camera>`` (N, 3, S, S) float and ``observation.state`` (N, 8)."""
    from lerobot.envs.utils import preprocess_observation

    return preprocess_observation(raw)


class RobosuiteBatchedEnv(SubprocessBatchedEnv):
    """robosuite tasks as a batched env (see the module doc): N worlds in N worker processes."""

    def __init__(self, config: EnvConfig):
        task = resolve_robosuite_task(config.task)
        unknown = [c for c in config.cameras if c not in CAMERAS]
        if unknown:
            raise ValueError(
                f"robosuite cameras are {', '.join(CAMERAS)}, got {unknown}; "
                "set --env.cameras='[agentview,robot0_eye_in_hand]' (or [] for physics only)"
            )
        if importlib.util.find_spec("robosuite") is None:
            raise ImportError(MISSING_EXTRA)
        self.task_name = task
        world = partial(RobosuiteWorld, task, list(config.cameras), config.image_size)
        super().__init__(
            [world] * config.num_envs, lerobot_features, [TASKS[task]] * config.num_envs,
            config.max_episode_steps or MAX_EPISODE_STEPS[task], config.cameras, 1.0 / CONTROL_FREQ,
            features=env_features(config.cameras, config.image_size, STATE_NAMES, ACTION_NAMES),
            task_names=[config.task], task_ids=[0] * config.num_envs,
        )  # fmt: skip
