"""The arm's end-effector controller: one damped-least-squares IK step per control step, batched.

Both simulator backends (``sim.mujoco_env`` on CPU with numpy, the MuJoCo Warp backend with
torch) turn the 4-D action into servo targets with this same math, so a policy sees the same
controller whichever backend it trains on. Everything is batched over N worlds; no MuJoCo here.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_EE_STEP = 0.04  # metres the IK target may lead the end effector by, per control step
DAMPING = 1e-4  # lambda^2 of the damped least squares (J J^T + lambda^2 I)
NULLSPACE_GAIN = 0.1  # fraction of (home - q) pulled in through the nullspace each step


def orientation_error(rot: np.ndarray, target_rot: np.ndarray) -> np.ndarray:
    """Small-angle rotation (N, 3) from each current frame to the target frame, world axes.

    rot: (N, 3, 3) current site rotation matrices; target_rot: (3, 3). The error is
    0.5 * sum_k rot[:, k] x target[:, k] (columns are the frame's axes).
    """
    a = rot.transpose(0, 2, 1)  # (N, 3, 3): row k = the current frame's axis k
    b = target_rot.T  # (3, 3): row k = the target frame's axis k
    # Row-wise cross products a_k x b_k, written out (np.cross costs more than the math here).
    cross = a[:, :, [1, 2, 0]] * b[:, [2, 0, 1]] - a[:, :, [2, 0, 1]] * b[:, [1, 2, 0]]  # (N, 3, 3)
    return 0.5 * cross.sum(axis=1)


def ik_targets(
    q: np.ndarray,
    jac: np.ndarray,
    pos_err: np.ndarray,
    rot_err: np.ndarray,
    home_q: np.ndarray,
    ranges: np.ndarray,
    max_step: float = MAX_EE_STEP,
) -> np.ndarray:
    """Joint position targets (N, 7) one damped-least-squares step toward the end-effector target.

    q: (N, 7) arm joint angles; jac: (N, 6, 7) site Jacobian, translational rows then rotational;
    pos_err: (N, 3) target minus site position, metres (clipped here to ``max_step`` in norm);
    rot_err: (N, 3) from :func:`orientation_error`; home_q: (7,); ranges: (7, 2) joint limits.

    With A = J J^T + DAMPING I, e = [pos_err * min(1, max_step / |pos_err|); rot_err] (N, 6) and
    v = NULLSPACE_GAIN (home_q - q), the step is the least-squares move plus the pull toward home
    projected into the nullspace,

        dq = J^T A^-1 e + (I - J^T A^-1 J) v  =  v + J^T A^-1 (e - J v)     (N, 7)

    (the right-hand form needs one 6x6 solve per world), and the result is clip(q + dq, ranges).
    """
    norm = np.sqrt((pos_err * pos_err).sum(axis=1, keepdims=True))  # (N, 1)
    pos_err = pos_err * (max_step / np.maximum(norm, max_step))  # factor exactly 1 within the step
    err = np.concatenate([pos_err, rot_err], axis=1)  # (N, 6)
    jac_t = jac.transpose(0, 2, 1)  # (N, 7, 6)
    damped = jac @ jac_t + DAMPING * np.eye(6)  # (N, 6, 6)
    # Pull the redundant DoF toward home so the elbow does not drift over long episodes.
    pull = NULLSPACE_GAIN * (home_q - q)  # (N, 7)
    rhs = err - (jac @ pull[:, :, None])[:, :, 0]  # (N, 6)
    dq = pull + (jac_t @ np.linalg.solve(damped, rhs[:, :, None]))[:, :, 0]  # (N, 7)
    return np.clip(q + dq, ranges[:, 0], ranges[:, 1])


def orientation_error_torch(rot: torch.Tensor, target_rot: torch.Tensor) -> torch.Tensor:
    """:func:`orientation_error` in torch on the tensors' device (the Warp backend): (N, 3, 3), (3, 3) -> (N, 3)."""
    axes = rot.transpose(1, 2)  # (N, 3, 3): row k = the frame's axis k
    return 0.5 * torch.linalg.cross(axes, target_rot.T.expand_as(axes), dim=2).sum(dim=1)


def ik_targets_torch(
    q: torch.Tensor,
    jac: torch.Tensor,
    pos_err: torch.Tensor,
    rot_err: torch.Tensor,
    home_q: torch.Tensor,
    ranges: torch.Tensor,
    max_step: float = MAX_EE_STEP,
) -> torch.Tensor:
    """:func:`ik_targets` in torch on the tensors' device (the Warp backend): the same arguments,
    shapes and formula. Pass float64: A is ill-conditioned enough for float32 to cost millimetres."""
    norm = torch.linalg.vector_norm(pos_err, dim=1, keepdim=True)  # (N, 1)
    pos_err = pos_err * (max_step / norm.clamp(min=max_step))
    err = torch.cat([pos_err, rot_err], dim=1)  # (N, 6)
    jac_t = jac.transpose(1, 2)  # (N, 7, 6)
    damped = jac @ jac_t + DAMPING * torch.eye(6, dtype=jac.dtype, device=jac.device)  # (N, 6, 6)
    pull = NULLSPACE_GAIN * (home_q - q)  # (N, 7)
    rhs = err - (jac @ pull[:, :, None])[:, :, 0]  # (N, 6)
    dq = pull + (jac_t @ torch.linalg.solve(damped, rhs[:, :, None]))[:, :, 0]  # (N, 7)
    return torch.clamp(q + dq, ranges[:, 0], ranges[:, 1])
