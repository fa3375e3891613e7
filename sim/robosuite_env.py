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
"""

from __future__ import annotations

import importlib.util
from functools import partial
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from sim.config import EnvConfig
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
STATE_DIM = 8
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
            self._env = self._make()
        if seed is not None:  # robosuite's placement samplers draw from numpy's global RNG
            np.random.seed(seed)
        return self._format(self._env.reset()), {"is_success": False}

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
        )  # fmt: skip
