"""Inverse kinematics shared by the simulator and the robot: one damped-least-squares step, batched, and a
solve that iterates it over a chain's forward kinematics.

The step (:func:`ik_targets`) is the simulated arm's controller (`sim.ik.ArmController` takes one per
control step, so a policy sees the same controller on every backend) and the robot's solver
(:func:`solve_ik` iterates it on a `vla_core.kinematics.KinematicChain` read from the robot's URDF, so an
end-effector chunk becomes joint positions a robot's trajectory controller executes).

One implementation for numpy arrays (the cpu backend, the robot) and torch tensors on any device (the
Warp backend), float64 either way. The math uses only what means the same on both (arithmetic, ``@``,
basic slicing, ``swapaxes``, ``sum``, ``clip``) and takes the linear solve from the arrays' own library.
Why not torch alone: its per-operation dispatch costs the cpu backend about 100 us per control step at
small N (measured), a sixth of a step at N = 1. No fancy indexing either: on a GPU it copies the index
lists to the device at every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from vla_core.kinematics import KinematicChain

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


@dataclass
class IKSolution:
    """Joint positions solved for N end-effector targets, and where the solve fell short."""

    q: np.ndarray  # (N, n) joint positions, each within the chain's limits
    error: np.ndarray  # (N,) metres from each target to where q puts the tip
    converged: np.ndarray  # (N,) bool: error <= the tolerance asked for


def solve_ik(chain: KinematicChain, targets: np.ndarray, q0: np.ndarray, rot_error_map: np.ndarray,
             home_q: np.ndarray, tolerance: float = 1e-3, iterations: int = 50) -> IKSolution:  # fmt: skip
    """Joint positions putting ``chain``'s tip at each of ``targets`` (N, 3) in turn, warm-started from ``q0``
    (n,) and each waypoint from the one before (a trajectory's waypoints are close, so a few steps each).

    Each waypoint iterates :func:`ik_targets` (steps of at most ``MAX_EE_STEP``, the orientation held by
    ``rot_error_map`` (9, 3), the nullspace pulled toward ``home_q`` (n,)) until the tip is within
    ``tolerance`` metres or ``iterations`` steps are spent; a waypoint it cannot reach keeps the closest q
    found and is marked not converged.
    """
    targets = np.asarray(targets, dtype=np.float64).reshape(-1, 3)
    ranges = np.stack([chain.lower, chain.upper], axis=1)
    q = np.asarray(q0, dtype=np.float64).reshape(1, -1)
    solved, errors = np.zeros((len(targets), q.shape[1])), np.zeros(len(targets))
    for i, target in enumerate(targets):
        for _ in range(iterations):
            position, rotation = chain.forward(q)
            pos_err = target - position  # (1, 3)
            if np.linalg.norm(pos_err) <= tolerance:
                break
            rot_err = rotation.reshape(1, 9) @ rot_error_map
            q = ik_targets(q, chain.jacobian(q), pos_err, rot_err, home_q, ranges)
        solved[i], errors[i] = q[0], np.linalg.norm(target - chain.forward(q)[0][0])
    return IKSolution(solved, errors, errors <= tolerance)
