"""Pick and place: put the red cube into the shallow green bin.

Initial states are randomized: the cube's position and yaw, the bin's position (a mocap body,
at least ``min_separation`` from the cube) and the arm's joints around home. Success is
explicit: the cube rests inside the bin's walls, low on its floor, and the fingers have let go.

:class:`PickPlaceExpert` also solves ``stack``: both tasks publish the same privileged keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

from sim.batched_success import WorldArrays, touches_gripper
from sim.tasks.base import step_toward
from sim.tasks.scene import place_free_body, place_mocap_body, reset_arm_near_home, sample_xy_apart, scene_path

CUBE_HALF = 0.02  # metres, half the red cube's side (the scene files' cube geom)


@dataclass
class PickPlaceTask:
    name: str = "pick_place"
    instruction: str = "put the red cube in the green bin"
    cube_x_range: tuple[float, float] = (0.42, 0.62)
    cube_y_range: tuple[float, float] = (-0.20, 0.20)
    cube_yaw_range: float = 0.5  # radians, uniform in [-r, r]
    bin_x_range: tuple[float, float] = (0.42, 0.62)
    bin_y_range: tuple[float, float] = (-0.20, 0.20)
    min_separation: float = 0.15  # metres between cube and bin centres: the cube starts clear of the walls
    bin_inner_half: float = 0.065  # metres, half the inner side of the bin (panda_pick_place.xml)
    bin_floor_top: float = 0.009  # metres, height of the bin floor's top face
    release_clearance: float = 0.015  # metres the expert drops the cube from, above the floor
    arm_joint_noise: float = 0.05  # radians, std of the joints around home
    max_episode_steps: int = 150

    def xml_path(self) -> str:
        return scene_path("panda_pick_place.xml")

    def sample_initial_state(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Write a random initial state into ``data`` (then the caller runs mj_forward)."""
        reset_arm_near_home(model, data, rng, self.arm_joint_noise)
        cube = np.array([rng.uniform(*self.cube_x_range), rng.uniform(*self.cube_y_range)])
        place_free_body(model, data, "cube", [*cube, CUBE_HALF], rng.uniform(-self.cube_yaw_range, self.cube_yaw_range))
        bin_xy = sample_xy_apart(rng, self.bin_x_range, self.bin_y_range, cube, self.min_separation)
        place_mocap_body(model, data, "bin", [*bin_xy, 0.0])

    def privileged_state(self, model: mujoco.MjModel, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """``cube``: (3,) cube centre; ``place_target``: (3,) where the cube's centre is let go,
        ``release_clearance`` above the middle of the bin's floor; world frame."""
        bin_pos = data.body("bin").xpos
        release = [bin_pos[0], bin_pos[1], self.bin_floor_top + CUBE_HALF + self.release_clearance]
        return {"cube": data.body("cube").xpos.copy(), "place_target": np.array(release)}

    def success(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the cube's centre is inside the bin's walls (5 mm of play), at most 1 cm above
        resting on its floor, and no finger touches the cube."""
        bin_id = model.body("bin").id
        offset = worlds.xpos[:, model.body("cube").id] - worlds.xpos[:, bin_id]  # (N, 3)
        local = (worlds.xmat[:, bin_id] * offset[:, :, None]).sum(axis=1)  # R^T offset: in the bin's frame
        inside = (abs(local[:, :2]) <= self.bin_inner_half - CUBE_HALF + 0.005).all(axis=1)
        resting = local[:, 2] <= self.bin_floor_top + CUBE_HALF + 0.01
        return inside & resting & ~touches_gripper(model, worlds, "cube")


class PickPlaceExpert:
    """Scripted expert that carries the privileged ``cube`` to the privileged ``place_target``.

    Phases per world: approach above the cube, descend, close, lift, carry above the target,
    lower until the cube's centre reaches the target, open, back away upward. Carrying and
    lowering steer the *cube* onto the target (the end effector moves by the cube's error), so
    an off-centre grasp still lands where it should. A cube that drops out of the fingers on
    the way is approached and grasped again.
    """

    APPROACH, DESCEND, CLOSE, LIFT, CARRY, LOWER, RELEASE, RETREAT = range(8)

    def __init__(
        self,
        num_envs: int,
        max_step: float = 0.025,
        hover: float = 0.10,
        carry_height: float = 0.15,
        close_steps: int = 6,
        open_steps: int = 4,
    ):
        self.max_step = max_step  # metres per step
        self.hover = hover  # metres above the cube to start the descent from
        self.carry_height = carry_height  # grasp-site height while carrying: above bin walls and the blue cube
        self.close_steps = close_steps
        self.open_steps = open_steps
        self.phase = np.zeros(num_envs, dtype=np.int64)
        self.timer = np.zeros(num_envs, dtype=np.int64)

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        mask = slice(None) if env_mask is None else env_mask
        self.phase[mask] = self.APPROACH
        self.timer[mask] = 0

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3), privileged["cube"], ["place_target"] (N, 3) -> actions (N, 4), grip 1 closed."""
        cube, target = privileged["cube"], privileged["place_target"]
        n = ee_pos.shape[0]
        goal = np.empty((n, 3))
        grip = np.zeros(n)
        for i in range(n):
            phase = self.phase[i]
            cube_error = target[i] - cube[i]
            if phase in (self.LIFT, self.CARRY, self.LOWER) and np.linalg.norm(cube[i] - ee_pos[i]) > 0.03:
                phase = self.phase[i] = self.APPROACH  # dropped: grasp it again
            if phase == self.APPROACH:
                goal[i] = cube[i] + [0.0, 0.0, self.hover]
                if np.linalg.norm(ee_pos[i] - goal[i]) < 0.01:
                    self.phase[i] = self.DESCEND
            elif phase == self.DESCEND:
                goal[i] = cube[i] + [0.0, 0.0, -0.005]
                if np.linalg.norm(ee_pos[i] - goal[i]) < 0.008:
                    self.phase[i], self.timer[i] = self.CLOSE, 0
            elif phase == self.CLOSE:
                goal[i] = ee_pos[i]
                grip[i] = 1.0
                self.timer[i] += 1
                if self.timer[i] >= self.close_steps:
                    self.phase[i] = self.LIFT
            elif phase == self.LIFT:
                goal[i] = [*ee_pos[i, :2], self.carry_height]
                grip[i] = 1.0
                if ee_pos[i, 2] > self.carry_height - 0.01:
                    self.phase[i] = self.CARRY
            elif phase == self.CARRY:
                goal[i] = [*(ee_pos[i, :2] + cube_error[:2]), self.carry_height]
                grip[i] = 1.0
                if np.linalg.norm(cube_error[:2]) < 0.008:
                    self.phase[i] = self.LOWER
            elif phase == self.LOWER:
                goal[i] = ee_pos[i] + cube_error
                grip[i] = 1.0
                if np.linalg.norm(cube_error) < 0.006:
                    self.phase[i], self.timer[i] = self.RELEASE, 0
            elif phase == self.RELEASE:
                goal[i] = ee_pos[i]
                self.timer[i] += 1
                if self.timer[i] >= self.open_steps:
                    self.phase[i] = self.RETREAT
            else:
                goal[i] = [*ee_pos[i, :2], self.carry_height]
        return step_toward(ee_pos, goal, grip, self.max_step)
