"""Track: catch up with a green ball that drifts across the workspace at a constant velocity.

The world moves while the policy thinks: the ball travels along +y or -y (left or right in the
``front`` camera, a coin flip per episode), at a speed drawn per episode from ``speed_range``.
One frame does not tell which way it goes; a few frames do, and an action computed from old
frames aims where it was. (With the ball always going one way, a policy learned the drift from
the task, not from its frames, and delay cost it only 10 points; see the README.)
The ball is physics, not a mocap body: three frictionless, undamped slide joints that collide
with nothing (``sim/assets/panda_track.xml``), so it keeps the velocity its reset gives it in
every backend with no per-step host code, and the arm cannot push it. A disc on the table
under the ball moves with it, so a single camera can tell its height.

Initial states are randomized: the ball's start and speed, and the arm's joints around home.
Success is explicit: the grasp site is within ``success_distance`` of the ball's centre.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

from sim.batched_success import WorldArrays, vector_norm
from sim.tasks.base import step_toward
from sim.tasks.scene import reset_arm_near_home, scene_path

BALL_JOINTS = ("target_x", "target_y", "target_z")  # slide joints; each qpos is the ball centre's world coordinate
DRIFT = np.array([0.0, 1.0, 0.0])  # the ball's axis of travel, world frame; its sign is drawn per episode


def ball_velocity_dofs(model: mujoco.MjModel) -> slice:
    """The ball's three slide joints' velocities in ``qvel``: consecutive in the scene, x, y, z. Tasks whose
    events change the ball's velocity (`track_reverse`, `track_jump`) set this range."""
    first = model.joint(BALL_JOINTS[0]).dofadr[0]
    assert [model.joint(j).dofadr[0] for j in BALL_JOINTS] == [first, first + 1, first + 2]
    return slice(int(first), int(first) + 3)


@dataclass
class TrackTask:
    name: str = "track"
    instruction: str = "catch the moving green ball"
    # Where the ball starts (metres, world frame). This scene's home turns the arm to the left
    # end of the conveyor (gripper at about (0.51, -0.19, 0.24)); the ball starts mid-table, to
    # the gripper's right and below it, and goes either way: the gripper has to chase it. By the
    # end of an episode it has travelled at most speed_range[1] * max_episode_steps * 0.05 s =
    # 0.36 m, to |y| <= 0.42. Past |y| = 0.35 (the arm's workspace, `sim.arm`) it is out of reach,
    # which happens only late in an episode that has not caught it (the expert catches 95%+).
    target_x_range: tuple[float, float] = (0.42, 0.62)
    target_y_range: tuple[float, float] = (-0.06, 0.06)
    target_z_range: tuple[float, float] = (0.05, 0.17)  # mostly below the gripper's start height (about 0.24 m)
    # Metres from the gripper's start to the ball's, at least: no episode starts solved or nearly so.
    min_start_distance: float = 0.08
    speed_range: tuple[float, float] = (0.08, 0.12)  # m/s, uniform per episode, along +y or -y
    arm_joint_noise: float = 0.05  # radians, std of the joints around home
    success_distance: float = 0.03  # metres, grasp site to ball centre
    max_episode_steps: int = 60  # 3 s at the default 20 Hz control

    def xml_path(self) -> str:
        return scene_path("panda_track.xml")

    def sample_initial_state(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Write a random initial state into ``data`` (then the caller runs mj_forward)."""
        reset_arm_near_home(model, data, rng, self.arm_joint_noise)  # also zeroes every velocity
        mujoco.mj_kinematics(model, data)
        gripper = data.site("grasp").xpos
        while True:  # rejection sampling: most draws are far enough, so it takes a few at most
            start = np.array([rng.uniform(*r) for r in (self.target_x_range, self.target_y_range, self.target_z_range)])
            if np.linalg.norm(start - gripper) >= self.min_start_distance:
                break
        velocity = rng.choice([-1.0, 1.0]) * rng.uniform(*self.speed_range) * DRIFT
        for joint, pos, vel in zip(BALL_JOINTS, start, velocity):
            data.qpos[model.joint(joint).qposadr[0]] = pos
            data.qvel[model.joint(joint).dofadr[0]] = vel

    def privileged_state(self, model: mujoco.MjModel, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """``target``: (3,) ball centre in the world frame; ``target_vel``: (3,) its velocity, m/s."""
        return {"target": data.body("target").xpos.copy(), "target_vel": data.qvel[ball_velocity_dofs(model)].copy()}

    def success(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the grasp site is within ``success_distance`` of the ball's centre."""
        gap = worlds.site_xpos[:, model.site("grasp").id] - worlds.xpos[:, model.body("target").id]
        return vector_norm(gap) <= self.success_distance


class TrackExpert:
    """Scripted expert for :class:`TrackTask`: a capped straight-line move toward where the ball will be.

    It aims at the privileged ``target`` extrapolated by ``target_vel`` over the steps it needs
    to close the gap at ``max_step`` metres per step, plus ``lead_steps`` for the controller to
    catch up with its target. ``control_dt`` is the env's control period (``EnvConfig``: 25
    physics steps of 0.002 s). It has no phases, so ``reset`` has nothing to restart.
    """

    def __init__(self, num_envs: int, max_step: float = 0.025, control_dt: float = 0.05, lead_steps: float = 1.0):
        self.max_step = max_step
        self.control_dt = control_dt
        self.lead_steps = lead_steps

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        """Nothing to restart: every action depends on the current state only."""

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3), privileged["target"], ["target_vel"] (N, 3) -> actions (N, 4), gripper open."""
        target, velocity = privileged["target"], privileged["target_vel"]
        steps_to_close = np.linalg.norm(target - ee_pos, axis=1, keepdims=True) / self.max_step
        aim = target + velocity * self.control_dt * (steps_to_close + self.lead_steps)
        return step_toward(ee_pos, aim, np.zeros(len(ee_pos)), self.max_step)
