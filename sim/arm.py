"""The simulated Panda arm's contract: what its state and action vectors hold, their bounds, how
the grip value drives the fingers, and the action that holds the arm still.

The numbers are the robot description's (`vla_core.robot.SIM_PANDA`, written once there); this
module restates them in the forms the simulator uses (lists, numpy arrays, slices) and adds the
physics helpers. Every MuJoCo backend (``sim.mujoco_env``, ``sim.warp_env``) and the benchmark's
gymnasium baseline (``vla_rl.bench``) read these definitions; the robot bridge reads the
description itself. Only numpy and torch here, so importing it starts no simulator. The arm itself
is ``sim/assets/panda_arm.xml``: its joints are ``qpos[:7]``, its fingers ``qpos[7:9]`` and its
servos ``ctrl[:9]`` in every scene.
"""

from __future__ import annotations

import numpy as np
import torch

from vla_core.robot import SIM_PANDA

ROBOT = SIM_PANDA  # the description of the arm every MuJoCo scene holds

# observation.state (11,): the 7 arm joint angles (rad), the gripper width (m, both fingers
# together), the end-effector (grasp site) position (m, world frame).
STATE_NAMES = list(ROBOT.state_names)
# action (4,): the end-effector target position (m, world frame) and the grip, 0 open to 1 closed.
ACTION_NAMES = list(ROBOT.action_names)
EE_IN_STATE = slice(STATE_NAMES.index("ee_x"), STATE_NAMES.index("ee_z") + 1)  # the state's 3 end-effector entries

# The end-effector workspace every action is clipped to (metres, world frame), then the grip's range: (4,) each.
ACTION_LOW = np.array(ROBOT.action_low)
ACTION_HIGH = np.array(ROBOT.action_high)

FINGER_TRAVEL = ROBOT.joint_limits["finger_joint1"][1]  # metres each finger slides open (qpos[7], qpos[8])
# The joints of the servos ctrl[:9] (qpos[:9]), by their URDF names: the 7 arm joints, then the 2 fingers.
SERVO_JOINTS = list(ROBOT.joint_limits)
ARM_JOINTS, FINGER_JOINTS = SERVO_JOINTS[:7], SERVO_JOINTS[7:]
# The arm joints' limits (radians), joint1..joint7 = qpos[:7], as (lower, upper) pairs.
JOINT_RANGES = [ROBOT.joint_limits[f"joint{i}"] for i in range(1, 8)]

# What the arm can physically report, [low, high] per state entry: the joint limits, the two
# fingers' travel, and the workspace (the controller only reaches for targets inside it).
STATE_BOUNDS: dict[str, list[float]] = {name: list(bound) for name, bound in ROBOT.state_bounds.items()}


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
