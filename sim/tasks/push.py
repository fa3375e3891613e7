"""Push: push the red cube across the table into the green goal disc, gripper closed.

Initial states are randomized: the cube's position and yaw, the goal's position (a visual-only
mocap disc ``goal_distance_range`` away from the cube) and the arm's joints around home.
Success is explicit: the cube's centre is within ``goal_radius`` of the goal's centre, in the
table plane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

from sim.batched_success import WorldArrays, vector_norm
from sim.tasks.base import step_toward
from sim.tasks.scene import place_free_body, place_mocap_body, reset_arm_near_home, scene_path


@dataclass
class PushTask:
    name: str = "push"
    instruction: str = "push the red cube to the green target"
    cube_x_range: tuple[float, float] = (0.45, 0.60)
    cube_y_range: tuple[float, float] = (-0.12, 0.12)
    cube_yaw_range: float = 0.5  # radians, uniform in [-r, r]
    goal_distance_range: tuple[float, float] = (0.10, 0.16)  # metres from the cube, any direction
    goal_x_range: tuple[float, float] = (0.38, 0.68)  # the goal stays where the gripper can push to
    goal_y_range: tuple[float, float] = (-0.22, 0.22)
    goal_radius: float = 0.03  # metres, cube centre to goal centre for success (the disc is 0.04)
    arm_joint_noise: float = 0.05  # radians, std of the joints around home
    max_episode_steps: int = 150

    def xml_path(self) -> str:
        return scene_path("panda_push.xml")

    def sample_initial_state(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Write a random initial state into ``data`` (then the caller runs mj_forward)."""
        reset_arm_near_home(model, data, rng, self.arm_joint_noise)
        cube = np.array([rng.uniform(*self.cube_x_range), rng.uniform(*self.cube_y_range)])
        place_free_body(model, data, "cube", [*cube, 0.02], rng.uniform(-self.cube_yaw_range, self.cube_yaw_range))
        low, high = np.array([self.goal_x_range, self.goal_y_range]).T
        while True:  # a random direction whose goal lies inside the goal box
            angle = rng.uniform(-np.pi, np.pi)
            goal = cube + rng.uniform(*self.goal_distance_range) * np.array([np.cos(angle), np.sin(angle)])
            if np.all((low <= goal) & (goal <= high)):
                break
        place_mocap_body(model, data, "goal", [*goal, 0.001])

    def privileged_state(self, model: mujoco.MjModel, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """``cube``: (3,) cube centre; ``goal``: (3,) goal disc centre (on the table); world frame."""
        return {"cube": data.body("cube").xpos.copy(), "goal": data.body("goal").xpos.copy()}

    def success(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the cube's centre is within ``goal_radius`` of the goal's, in the table plane."""
        gap = worlds.xpos[:, model.body("cube").id, :2] - worlds.xpos[:, model.body("goal").id, :2]
        return vector_norm(gap) <= self.goal_radius


class PushExpert:
    """Scripted expert for :class:`PushTask` using the privileged ``cube`` and ``goal`` positions.

    Phases per world: hover above the point behind the cube (on the goal-to-cube line), descend
    there, then push: the target stays on the line through the cube's centre toward the goal,
    ``advance`` metres past the contact point, so the fingers both drive the cube forward and
    steer back onto the line as the cube turns. If the cube slips sideways off the fingers the
    script lifts and starts again from behind it. The gripper stays closed, so the two fingers
    make one blunt pusher.
    """

    APPROACH, DESCEND, PUSH, RETREAT = range(4)

    def __init__(
        self,
        num_envs: int,
        max_step: float = 0.025,
        push_step: float = 0.012,
        hover: float = 0.08,
        push_height: float = 0.025,
        standoff: float = 0.05,
        contact: float = 0.03,
        advance: float = 0.02,
        max_lateral: float = 0.015,
    ):
        self.max_step = max_step  # metres per step while moving freely
        self.push_step = push_step  # metres per step while pushing: slow, so the cube does not spin away
        self.hover = hover  # height of the grasp site while moving above the table
        self.push_height = push_height  # grasp-site height while pushing: fingertips 1 cm above the table
        self.standoff = standoff  # distance behind the cube centre where the pusher comes down
        self.contact = contact  # cube centre to pusher centre when they touch (cube half side + finger)
        self.advance = advance  # how far past the contact point the push target leads
        self.max_lateral = max_lateral  # pusher offset from the push line that triggers a retreat
        self.phase = np.zeros(num_envs, dtype=np.int64)

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        mask = slice(None) if env_mask is None else env_mask
        self.phase[mask] = self.APPROACH

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3), privileged["cube"], ["goal"] (N, 3) -> actions (N, 4), gripper closed."""
        cube, goal_disc = privileged["cube"][:, :2], privileged["goal"][:, :2]
        n = ee_pos.shape[0]
        goal = np.empty((n, 3))
        step = np.full(n, self.max_step)
        for i in range(n):
            direction = goal_disc[i] - cube[i]
            direction /= max(np.linalg.norm(direction), 1e-9)
            behind = cube[i] - self.standoff * direction
            offset = ee_pos[i, :2] - cube[i]
            lateral = abs(offset @ np.array([-direction[1], direction[0]]))
            if self.phase[i] == self.APPROACH:
                goal[i] = [*behind, self.hover]
                if np.linalg.norm(ee_pos[i] - goal[i]) < 0.01:
                    self.phase[i] = self.DESCEND
            elif self.phase[i] == self.DESCEND:
                goal[i] = [*behind, self.push_height]
                if np.linalg.norm(ee_pos[i] - goal[i]) < 0.008:
                    self.phase[i] = self.PUSH
            elif self.phase[i] == self.PUSH:
                goal[i] = [*(cube[i] + (self.advance - self.contact) * direction), self.push_height]
                step[i] = self.push_step
                if lateral > self.max_lateral or offset @ direction > -0.5 * self.contact:
                    self.phase[i] = self.RETREAT
            else:
                goal[i] = [*ee_pos[i, :2], self.hover]
                if ee_pos[i, 2] > self.hover - 0.01:
                    self.phase[i] = self.APPROACH
        return step_toward(ee_pos, goal, np.ones(n), step)
