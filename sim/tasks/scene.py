"""Scene helpers the tasks share: scene files, the arm's reset, placing bodies.

Every scene includes ``sim/assets/panda_arm.xml``, so the arm's joints are ``qpos[:7]``, its
fingers ``qpos[7:9]`` and its servos ``ctrl[:9]`` in all of them.
"""

from __future__ import annotations

from importlib import resources

import mujoco
import numpy as np


def scene_path(filename: str) -> str:
    """Absolute path of a scene file in ``sim/assets``."""
    return str(resources.files("sim") / "assets" / filename)


def reset_arm_near_home(model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator, noise: float) -> None:
    """Reset ``data`` to the ``home`` keyframe, then draw the 7 arm joints around home.

    noise: std of the joint offsets, radians. The servos start at the drawn pose, so the arm
    does not jump at the first step.
    """
    mujoco.mj_resetDataKeyframe(model, data, model.key("home").id)
    data.qpos[:7] += rng.normal(0.0, noise, size=7)
    data.qpos[:7] = np.clip(data.qpos[:7], model.jnt_range[:7, 0], model.jnt_range[:7, 1])
    data.ctrl[:7] = data.qpos[:7]


def yaw_quat(yaw: float) -> np.ndarray:
    """(4,) quaternion (w, x, y, z) of a rotation by ``yaw`` radians about the world z axis."""
    return np.array([np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2)])


def place_free_body(model: mujoco.MjModel, data: mujoco.MjData, joint: str, pos, yaw: float) -> None:
    """Set the pose of the body on free joint ``joint``: pos (3,) centre, yaw about world z."""
    adr = model.joint(joint).qposadr[0]
    data.qpos[adr : adr + 3] = pos
    data.qpos[adr + 3 : adr + 7] = yaw_quat(yaw)


def place_mocap_body(model: mujoco.MjModel, data: mujoco.MjData, body: str, pos, yaw: float = 0.0) -> None:
    """Set the pose of mocap body ``body`` (a goal marker or fixture): pos (3,), yaw about world z."""
    mocap = model.body(body).mocapid[0]
    data.mocap_pos[mocap] = pos
    data.mocap_quat[mocap] = yaw_quat(yaw)


def sample_xy_apart(
    rng: np.random.Generator,
    x_range: tuple[float, float],
    y_range: tuple[float, float],
    avoid: np.ndarray,
    min_distance: float,
) -> np.ndarray:
    """(2,) a uniform point in the box at least ``min_distance`` from the (2,) point ``avoid``.

    Rejection sampling; the boxes the tasks use are much larger than the excluded disc, so it
    takes a few draws at most.
    """
    while True:
        xy = np.array([rng.uniform(*x_range), rng.uniform(*y_range)])
        if np.linalg.norm(xy - avoid) >= min_distance:
            return xy
