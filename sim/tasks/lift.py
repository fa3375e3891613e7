"""Lift: pick the red cube up off the table.

Initial states are randomized: the cube's position and yaw, and the arm's joints around home.
Success is explicit: the cube's centre is at least ``lift_height`` above the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

from sim.batched_success import WorldArrays
from sim.tasks.base import step_toward
from sim.tasks.scene import place_free_body, reset_arm_near_home, scene_path


@dataclass
class LiftTask:
    name: str = "lift"
    instruction: str = "pick up the red cube"
    cube_x_range: tuple[float, float] = (0.45, 0.60)
    cube_y_range: tuple[float, float] = (-0.12, 0.12)
    cube_yaw_range: float = 0.5  # radians, uniform in [-r, r]
    arm_joint_noise: float = 0.05  # radians, std of the joints around home
    lift_height: float = 0.10  # metres, cube centre above the table for success
    max_episode_steps: int = 100

    def xml_path(self) -> str:
        return scene_path("panda_lift.xml")

    def sample_initial_state(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Write a random initial state into ``data`` (then the caller runs mj_forward)."""
        reset_arm_near_home(model, data, rng, self.arm_joint_noise)
        yaw = rng.uniform(-self.cube_yaw_range, self.cube_yaw_range)
        pos = [rng.uniform(*self.cube_x_range), rng.uniform(*self.cube_y_range), 0.02]
        place_free_body(model, data, "cube", pos, yaw)

    def privileged_state(self, model: mujoco.MjModel, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """``cube``: (3,) cube centre in the world frame."""
        return {"cube": data.body("cube").xpos.copy()}

    def success(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the cube's centre is at least ``lift_height`` above the table."""
        return worlds.xpos[:, model.body("cube").id, 2] >= self.lift_height


class LiftExpert:
    """Scripted expert for :class:`LiftTask` using the privileged ``cube`` positions.

    Phases per world: approach above the cube, descend, close the gripper, lift. Each action is
    the next end-effector target, at most ``max_step`` metres from the current position, so the
    demonstrations are smooth enough to imitate.
    """

    APPROACH, DESCEND, CLOSE, LIFT = range(4)

    def __init__(self, num_envs: int, max_step: float = 0.025, hover: float = 0.10, close_steps: int = 6):
        self.max_step = max_step
        self.hover = hover
        self.close_steps = close_steps
        self.phase = np.zeros(num_envs, dtype=np.int64)
        self.timer = np.zeros(num_envs, dtype=np.int64)
        self.grasp_xy = np.zeros((num_envs, 2))

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        mask = slice(None) if env_mask is None else env_mask
        self.phase[mask] = self.APPROACH
        self.timer[mask] = 0

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3), privileged["cube"] (N, 3) -> actions (N, 4) = [x, y, z, grip], grip 1 closed."""
        cube_pos = privileged["cube"]
        n = ee_pos.shape[0]
        goal = np.empty((n, 3))
        grip = np.zeros(n)
        for i in range(n):
            phase = self.phase[i]
            if phase == self.APPROACH:
                goal[i] = cube_pos[i] + [0.0, 0.0, self.hover]
                if np.linalg.norm(ee_pos[i] - goal[i]) < 0.01:
                    self.phase[i] = self.DESCEND
            elif phase == self.DESCEND:
                goal[i] = cube_pos[i] + [0.0, 0.0, -0.005]
                if np.linalg.norm(ee_pos[i] - goal[i]) < 0.008:
                    self.phase[i] = self.CLOSE
                    self.grasp_xy[i] = ee_pos[i, :2]
            elif phase == self.CLOSE:
                goal[i] = ee_pos[i]
                grip[i] = 1.0
                self.timer[i] += 1
                if self.timer[i] >= self.close_steps:
                    self.phase[i] = self.LIFT
            else:
                goal[i] = [*self.grasp_xy[i], 0.25]
                grip[i] = 1.0
        return step_toward(ee_pos, goal, grip, self.max_step)
