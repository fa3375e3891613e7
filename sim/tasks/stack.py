"""Stack: put the red cube on top of the blue cube.

Initial states are randomized: both cubes' positions (at least ``min_separation`` apart) and
yaws, and the arm's joints around home. The blue cube is larger and heavier, so it stays put
when the red one lands on it. Success is explicit: the red cube rests centred on the blue
cube's top face, the blue cube still stands on the table, and the fingers have let go.

The expert is :class:`sim.tasks.pick_place.PickPlaceExpert`: the place target is just above
the blue cube.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

from sim.batched_success import WorldArrays, touches_gripper, vector_norm
from sim.tasks.pick_place import CUBE_HALF
from sim.tasks.scene import place_free_body, reset_arm_near_home, sample_xy_apart, scene_path

BASE_HALF = 0.025  # metres, half the blue cube's side (panda_stack.xml)


@dataclass
class StackTask:
    name: str = "stack"
    instruction: str = "stack the red cube on the blue cube"
    x_range: tuple[float, float] = (0.42, 0.62)  # both cubes' centres
    y_range: tuple[float, float] = (-0.18, 0.18)
    yaw_range: float = 0.5  # radians, uniform in [-r, r]
    min_separation: float = 0.10  # metres between the cubes' centres
    release_clearance: float = 0.01  # metres the expert drops the red cube from, above the blue one
    xy_tolerance: float = 0.015  # metres, red centre off the blue centre, in the table plane
    height_tolerance: float = 0.005  # metres, red centre off resting height on the blue top
    arm_joint_noise: float = 0.05  # radians, std of the joints around home
    max_episode_steps: int = 150

    def xml_path(self) -> str:
        return scene_path("panda_stack.xml")

    def sample_initial_state(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Write a random initial state into ``data`` (then the caller runs mj_forward)."""
        reset_arm_near_home(model, data, rng, self.arm_joint_noise)
        red = np.array([rng.uniform(*self.x_range), rng.uniform(*self.y_range)])
        blue = sample_xy_apart(rng, self.x_range, self.y_range, red, self.min_separation)
        place_free_body(model, data, "cube", [*red, CUBE_HALF], rng.uniform(-self.yaw_range, self.yaw_range))
        place_free_body(model, data, "base_cube", [*blue, BASE_HALF], rng.uniform(-self.yaw_range, self.yaw_range))

    def privileged_state(self, model: mujoco.MjModel, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """``cube``: (3,) red cube centre; ``place_target``: (3,) where the red centre is let go,
        ``release_clearance`` above resting on the blue cube; world frame."""
        blue = data.body("base_cube").xpos
        release = blue + [0.0, 0.0, BASE_HALF + CUBE_HALF + self.release_clearance]
        return {"cube": data.body("cube").xpos.copy(), "place_target": release}

    def success(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the red cube rests centred on the blue one's top face, the blue cube stands
        on the table, and no finger touches the red cube."""
        red, blue = worlds.xpos[:, model.body("cube").id], worlds.xpos[:, model.body("base_cube").id]
        centred = vector_norm(red[:, :2] - blue[:, :2]) <= self.xy_tolerance
        on_top = abs(red[:, 2] - blue[:, 2] - (BASE_HALF + CUBE_HALF)) <= self.height_tolerance
        base_on_table = abs(blue[:, 2] - BASE_HALF) <= self.height_tolerance
        return centred & on_top & base_on_table & ~touches_gripper(model, worlds, "cube")
