"""The simulated Panda arm's contract: what its state and action vectors hold, their bounds, how
the grip value drives the fingers, and the action that holds the arm still.

Every MuJoCo backend (``sim.mujoco_env``, ``sim.warp_env``), the benchmark's gymnasium baseline
(``vla_rl.bench``) and the robot bridge (``robot_bridge.config``) read these definitions. Only
numpy and torch here, so importing it starts no simulator. The arm itself is
``sim/assets/panda_arm.xml``: its joints are ``qpos[:7]``, its fingers ``qpos[7:9]`` and its
servos ``ctrl[:9]`` in every scene.
"""

from __future__ import annotations

import numpy as np
import torch

# observation.state (11,): the 7 arm joint angles (rad), the gripper width (m, both fingers
# together), the end-effector (grasp site) position (m, world frame).
STATE_NAMES = [f"joint{i}" for i in range(1, 8)] + ["gripper_width", "ee_x", "ee_y", "ee_z"]
# action (4,): the end-effector target position (m, world frame) and the grip, 0 open to 1 closed.
ACTION_NAMES = ["ee_x", "ee_y", "ee_z", "grip"]
EE_IN_STATE = slice(STATE_NAMES.index("ee_x"), STATE_NAMES.index("ee_z") + 1)  # the state's 3 end-effector entries

# The end-effector workspace every action is clipped to (metres, world frame), then the grip's range.
ACTION_LOW = np.array([0.25, -0.35, 0.0, 0.0])
ACTION_HIGH = np.array([0.80, 0.35, 0.40, 1.0])

FINGER_TRAVEL = 0.04  # metres each finger slides open (the finger joints' range in panda_arm.xml)
# The arm joints' limits in panda_arm.xml (radians), restated so the bridge reads them without MuJoCo.
JOINT_RANGES = [
    (-2.8973, 2.8973),
    (-1.7628, 1.7628),
    (-2.8973, 2.8973),
    (-3.0718, -0.0698),
    (-2.8973, 2.8973),
    (-0.0175, 3.7525),
    (-2.8973, 2.8973),
]

# What the arm can physically report, [low, high] per state entry: the joint limits, the two
# fingers' travel, and the workspace (the controller only reaches for targets inside it).
STATE_BOUNDS: dict[str, list[float]] = {
    **{f"joint{i + 1}": list(bounds) for i, bounds in enumerate(JOINT_RANGES)},
    "gripper_width": [0.0, 2 * FINGER_TRAVEL],
    **{name: [float(ACTION_LOW[i]), float(ACTION_HIGH[i])] for i, name in enumerate(ACTION_NAMES[:3])},
}


def finger_targets(grip):
    """Each finger's servo target (metres open) for a grip value in [0, 1]: 0 fully open, 1 closed.

    Arithmetic only, so grip may be a float, a numpy array or a torch tensor (any shape).
    """
    return FINGER_TRAVEL * (1.0 - grip)


def commanded_grip(finger_target):
    """The grip value whose :func:`finger_targets` is ``finger_target`` (its inverse); same types."""
    return 1.0 - finger_target / FINGER_TRAVEL


def arm_state(arm_qpos, ee_pos, out):
    """Write observation.state (N, 11), in STATE_NAMES order, into ``out`` and return ``out``.

    arm_qpos: (N, 9) = qpos[:, :9], the arm joints then the two fingers; ee_pos: (N, 3) the grasp
    site positions; out: (N, 11), float32 for an observation. The gripper width is the sum of the
    two finger openings. Numpy arrays or torch tensors (slice assignment only), so the cpu backend
    fills its buffer without torch's per-operation cost.
    """
    out[:, :7] = arm_qpos[:, :7]
    out[:, 7] = arm_qpos[:, 7] + arm_qpos[:, 8]
    out[:, 8:] = ee_pos
    return out


def hold_actions(ee_pos: torch.Tensor, grip: torch.Tensor | float = 0.0) -> torch.Tensor:
    """(N, 4) actions that keep each end effector where it is: ee_pos (N, 3), in its dtype and device.

    grip: (N,) or one value. Pass the grip last commanded (:func:`commanded_grip` of the finger
    servos) to keep a grasp; without it the gripper opens, which is what a backend does for an
    action that is not finite and what a controller starting from a measured state does.
    """
    if isinstance(grip, torch.Tensor):
        column = grip.to(ee_pos.dtype).reshape(-1, 1).expand(len(ee_pos), 1)
    else:  # filled on the device: no host-to-device copy in a GPU backend's step
        column = ee_pos.new_full((len(ee_pos), 1), grip)
    return torch.cat([ee_pos, column], dim=1)
