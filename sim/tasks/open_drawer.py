"""Open drawer: pull the cabinet's drawer open by its handle.

Initial states are randomized: the cabinet's position and yaw (a mocap body), how far the
drawer starts ajar, and the arm's joints around home. Success is explicit: the drawer's slide
joint is open at least ``open_distance``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

from sim.batched_success import WorldArrays
from sim.tasks.base import step_toward
from sim.tasks.scene import place_mocap_body, reset_arm_near_home, scene_path

HANDLE_GAP_CENTRE = 0.0355  # metres from the handle bar's axis back to the middle of the gap behind it


@dataclass
class OpenDrawerTask:
    name: str = "open_drawer"
    instruction: str = "open the drawer"
    cabinet_x_range: tuple[float, float] = (0.32, 0.38)  # cabinet centre; its drawer faces +x, the camera
    cabinet_y_range: tuple[float, float] = (-0.12, 0.12)
    cabinet_yaw_range: float = 0.3  # radians, uniform in [-r, r]
    ajar_range: tuple[float, float] = (0.0, 0.03)  # metres the drawer starts open
    open_distance: float = 0.12  # metres of slide for success (the joint's range is 0.14)
    arm_joint_noise: float = 0.05  # radians, std of the joints around home
    max_episode_steps: int = 120

    def xml_path(self) -> str:
        return scene_path("panda_open_drawer.xml")

    def sample_initial_state(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Write a random initial state into ``data`` (then the caller runs mj_forward)."""
        reset_arm_near_home(model, data, rng, self.arm_joint_noise)
        pos = [rng.uniform(*self.cabinet_x_range), rng.uniform(*self.cabinet_y_range), 0.0]
        place_mocap_body(model, data, "cabinet", pos, rng.uniform(-self.cabinet_yaw_range, self.cabinet_yaw_range))
        data.qpos[model.joint("drawer").qposadr[0]] = rng.uniform(*self.ajar_range)

    def privileged_state(self, model: mujoco.MjModel, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """``handle``: (3,) centre of the handle bar; ``pull_direction``: (3,) unit vector the
        drawer slides out along; world frame."""
        return {
            "handle": data.geom("handle").xpos.copy(),
            "pull_direction": data.body("cabinet").xmat.reshape(3, 3)[:, 0].copy(),
        }

    def success(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the drawer's slide joint is open at least ``open_distance``."""
        return worlds.qpos[:, model.joint("drawer").qposadr[0]] >= self.open_distance


class OpenDrawerExpert:
    """Scripted expert for :class:`OpenDrawerTask` using the privileged handle pose.

    Phases per world: hover above the gap between the handle bar and the drawer face, lower the
    closed fingers into it, then pull along the drawer's axis. The pull target stays ``advance``
    metres ahead of the gap, which moves with the drawer, so the fingers hook the bar and keep
    centred in the gap sideways. Hooking rather than grasping needs no gripper yaw.
    """

    APPROACH, DESCEND, PULL = range(3)

    def __init__(self, num_envs: int, max_step: float = 0.025, hover: float = 0.08, advance: float = 0.03):
        self.max_step = max_step  # metres per step
        self.hover = hover  # metres above the handle to start the descent from
        self.advance = advance  # how far ahead of the gap the pull target leads
        self.phase = np.zeros(num_envs, dtype=np.int64)

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        mask = slice(None) if env_mask is None else env_mask
        self.phase[mask] = self.APPROACH

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3), privileged["handle"], ["pull_direction"] (N, 3) -> actions (N, 4), gripper closed."""
        direction = privileged["pull_direction"]
        gap = privileged["handle"] - HANDLE_GAP_CENTRE * direction  # (N, 3) where the fingers go
        n = ee_pos.shape[0]
        goal = np.empty((n, 3))
        for i in range(n):
            if self.phase[i] == self.APPROACH:
                goal[i] = gap[i] + [0.0, 0.0, self.hover]
                if np.linalg.norm(ee_pos[i] - goal[i]) < 0.01:
                    self.phase[i] = self.DESCEND
            elif self.phase[i] == self.DESCEND:
                goal[i] = gap[i]
                if np.linalg.norm(ee_pos[i] - goal[i]) < 0.008:
                    self.phase[i] = self.PULL
            else:
                goal[i] = gap[i] + self.advance * direction[i]
        return step_toward(ee_pos, goal, np.ones(n), self.max_step)
