"""Reach: move the gripper to a green ball floating in the workspace.

Initial states are randomized: the ball's position and the arm's joints around home. The ball
is a visual-only mocap body with a disc on the table below it, so a single camera can tell
its height. Success is explicit: the grasp site is within ``success_distance`` of the ball.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

from sim.batched_success import WorldArrays, vector_norm
from sim.tasks.base import step_toward
from sim.tasks.scene import place_mocap_body, reset_arm_near_home, scene_path


@dataclass
class ReachTask:
    name: str = "reach"
    instruction: str = "move the gripper to the green ball"
    target_x_range: tuple[float, float] = (0.40, 0.65)
    target_y_range: tuple[float, float] = (-0.20, 0.20)
    # Kept below the gripper's start height (about 0.27 m), so no episode starts solved.
    target_z_range: tuple[float, float] = (0.04, 0.20)
    arm_joint_noise: float = 0.05  # radians, std of the joints around home
    success_distance: float = 0.02  # metres, grasp site to ball centre
    max_episode_steps: int = 50

    def xml_path(self) -> str:
        return scene_path("panda_reach.xml")

    def sample_initial_state(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Write a random initial state into ``data`` (then the caller runs mj_forward)."""
        reset_arm_near_home(model, data, rng, self.arm_joint_noise)
        x, y = rng.uniform(*self.target_x_range), rng.uniform(*self.target_y_range)
        place_mocap_body(model, data, "target", [x, y, rng.uniform(*self.target_z_range)])
        place_mocap_body(model, data, "target_base", [x, y, 0.001])

    def privileged_state(self, model: mujoco.MjModel, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """``target``: (3,) ball centre in the world frame."""
        return {"target": data.body("target").xpos.copy()}

    def success(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the grasp site is within ``success_distance`` of the ball's centre."""
        gap = worlds.site_xpos[:, model.site("grasp").id] - worlds.xpos[:, model.body("target").id]
        return vector_norm(gap) <= self.success_distance


class ReachExpert:
    """Scripted expert for :class:`ReachTask`: a capped straight-line move to the privileged ``target``.

    It has no phases, so ``reset`` has nothing to restart.
    """

    def __init__(self, num_envs: int, max_step: float = 0.025):
        self.max_step = max_step

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        """Nothing to restart: every action depends on the current state only."""

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3), privileged["target"] (N, 3) -> actions (N, 4), gripper open."""
        return step_toward(ee_pos, privileged["target"], np.zeros(len(ee_pos)), self.max_step)
