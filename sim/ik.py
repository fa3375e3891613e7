"""The arm's end-effector controller: one damped-least-squares IK step per control step, batched.

One implementation serves every backend, so a policy sees the same controller whichever it trains
on: the arguments are numpy arrays (the cpu backend and the benchmark's gymnasium baseline) or
torch tensors on any device (the Warp backend), float64 either way. The math uses only what means
the same on both (arithmetic, ``@``, basic slicing, ``swapaxes``, ``sum``, ``clip``) and takes the
linear solve from the arrays' own library. Why not torch alone: its per-operation dispatch costs
the cpu backend about 100 us per control step at small N (measured), a sixth of a step at N = 1.
No fancy indexing either: on a GPU it copies the index lists to the device at every call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from sim.arm import finger_targets

MAX_EE_STEP = 0.04  # metres the IK target may lead the end effector by, per control step
DAMPING = 1e-4  # lambda^2 of the damped least squares (J J^T + lambda^2 I)
_DAMPING_NUMPY = DAMPING * np.eye(6)  # made once: the cpu backend calls ik_targets every control step
NULLSPACE_GAIN = 0.1  # fraction of (home - q) pulled in through the nullspace each step


def orientation_error_map(target_rot: np.ndarray) -> np.ndarray:
    """(9, 3) matrix M that turns rotations into their orientation error toward ``target_rot`` (3, 3).

    For rot (N, 3, 3) flattened row-major to (N, 9) (the layout of MuJoCo's ``xmat``), rot_flat @ M
    is the small-angle rotation (N, 3) from each frame to the target frame, in world axes:
    0.5 * sum_k rot[:, k] x target[:, k] (columns are the frames' axes). The error is linear in
    rot, so row m of M is its value at the m-th unit matrix; a step then costs one product.
    """
    units = np.eye(9).reshape(9, 3, 3)  # (9, 3, 3): unit matrix m has a single 1 at row-major index m
    return 0.5 * np.cross(units, target_rot[None], axis=1).sum(axis=2)  # axis 1: the columns' entries


def ik_targets(q: Any, jac: Any, pos_err: Any, rot_err: Any, home_q: Any, ranges: Any, max_step: float = MAX_EE_STEP):
    """Joint position targets (N, 7) one damped-least-squares step toward the end-effector target.

    All numpy arrays or all torch tensors (float64: A is ill-conditioned enough for float32 to cost
    millimetres). q: (N, 7) arm joint angles; jac: (N, 6, 7) site Jacobian, translational rows then
    rotational; pos_err: (N, 3) target minus site position, metres (clipped here to ``max_step`` in
    norm); rot_err: (N, 3) orientation error (:func:`orientation_error_map`); home_q: (7,);
    ranges: (7, 2) joint limits.

    With A = J J^T + DAMPING I, e = [pos_err * min(1, max_step / |pos_err|); rot_err] (N, 6) and
    v = NULLSPACE_GAIN (home_q - q), the step is the least-squares move plus the pull toward home
    projected into the nullspace,

        dq = J^T A^-1 e + (I - J^T A^-1 J) v  =  v + J^T A^-1 (e - J v)     (N, 7)

    (the right-hand form needs one 6x6 solve per world), and the result is clip(q + dq, ranges).
    """
    solve = torch.linalg.solve if isinstance(jac, torch.Tensor) else np.linalg.solve
    norm = (pos_err * pos_err).sum(axis=1, keepdims=True) ** 0.5  # (N, 1)
    jac_t = jac.swapaxes(1, 2)  # (N, 7, 6)
    damped = jac @ jac_t  # (N, 6, 6)
    if isinstance(damped, np.ndarray):
        damped = damped + _DAMPING_NUMPY  # A = J J^T + DAMPING I
    else:
        damped = damped + DAMPING * torch.eye(6, dtype=damped.dtype, device=damped.device)
    # Pull the redundant DoF toward home so the elbow does not drift over long episodes.
    pull = NULLSPACE_GAIN * (home_q - q)  # (N, 7)
    rhs = -(jac @ pull[:, :, None])  # (N, 6, 1): e - J v, e added row block by row block
    rhs[:, :3, 0] += pos_err * (max_step / norm.clip(max_step, None))  # factor exactly 1 within the step
    rhs[:, 3:, 0] += rot_err
    dq = pull + (jac_t @ solve(damped, rhs))[:, :, 0]  # (N, 7)
    return (q + dq).clip(ranges[:, 0], ranges[:, 1])


@dataclass(frozen=True)
class ArmController:
    """The controller of one scene: an action ``[x, y, z, grip]`` to the arm's 9 servo targets.

    The arm moves one IK step toward the end-effector target, keeping the gripper pointing down at
    the yaw it has in the scene's ``home`` keyframe; the fingers open by ``grip`` (`sim.arm`).
    Numpy float64 from :meth:`from_model`; :meth:`to_torch` for a backend on a torch device.
    """

    home_q: Any  # (7,) the home keyframe's arm joints, the nullspace pull's goal
    joint_ranges: Any  # (7, 2) the arm joints' limits
    rot_error_map: Any  # (9, 3) toward the gripper's orientation at home, see `orientation_error_map`

    @classmethod
    def from_model(cls, model, site: str = "grasp") -> ArmController:
        """The controller of a scene (``mujoco.MjModel``) with the shared arm, for its ``site``."""
        import mujoco

        home = model.key("home")
        data = mujoco.MjData(model)
        mujoco.mj_resetDataKeyframe(model, data, home.id)
        mujoco.mj_forward(model, data)
        target_rot = data.site(site).xmat.reshape(3, 3)
        return cls(home.qpos[:7].copy(), model.jnt_range[:7].copy(), orientation_error_map(target_rot))

    def to_torch(self, device: torch.device | str) -> ArmController:
        """The same controller with float64 tensors on ``device``."""
        return replace(self, **{name: torch.tensor(value, dtype=torch.float64, device=device)
                                for name, value in vars(self).items()})  # fmt: skip

    def servo_targets(self, action: Any, q: Any, jac: Any, site_pos: Any, site_xmat: Any, out: Any) -> None:
        """Write the servo targets of N worlds into ``out[:, :9]``: 7 arm joints, then the 2 fingers.

        action: (N, 4) clipped to the workspace; q: (N, 7) arm joints; jac: (N, 6, 7) the site
        Jacobian; site_pos: (N, 3); site_xmat: (N, 9) the site's rotation, row-major; out: (N, nu).
        Numpy or torch throughout, as this controller's own fields.
        """
        rot_err = site_xmat @ self.rot_error_map  # (N, 3)
        pos_err = action[:, :3] - site_pos  # (N, 3)
        out[:, :7] = ik_targets(q, jac, pos_err, rot_err, self.home_q, self.joint_ranges)
        out[:, 7:9] = finger_targets(action[:, 3:4])  # each finger opens by the same amount
