"""Forward kinematics and the geometric Jacobian of a serial chain of URDF joints (numpy, batched).

What the robot side needs to turn an end-effector target into joint positions without a simulator:
the tip frame's pose and the Jacobian at N configurations at once. A chain is the joints from a base
link to a tip link (`vla_core.urdf.Urdf.chain`); each joint moves the frame as URDF defines it: the
child frame is the parent's times ``origin`` times the joint's motion (a rotation of q about its
axis, or a translation of q along it). float64 throughout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vla_core.urdf import MOVING, Urdf, UrdfJoint


class KinematicChain:
    """The tip frame of a serial chain as a function of its moving joints' positions q (N, n)."""

    def __init__(self, joints: Sequence[UrdfJoint]):
        self.joints = tuple(joints)
        moving = [j for j in self.joints if j.kind in MOVING]
        self.names = tuple(j.name for j in moving)  # q's columns, base first
        self.lower = np.array([j.lower for j in moving])  # (n,) position limits
        self.upper = np.array([j.upper for j in moving])
        self.velocity = np.array([j.velocity for j in moving])  # (n,) velocity limits
        self._origins = [j.origin() for j in self.joints]

    @classmethod
    def from_urdf(cls, urdf: Urdf, tip: str, base: str | None = None) -> KinematicChain:
        """The chain from ``base`` (the URDF's root link by default) to link ``tip``."""
        return cls(urdf.chain(base or urdf.root(), tip))

    def forward(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """q (N, n) or (n,) -> the tip's position (N, 3) and rotation (N, 3, 3) in the base link's frame."""
        tip, _, _ = self._frames(q)
        return tip[:, :3, 3], tip[:, :3, :3]

    def jacobian(self, q: np.ndarray) -> np.ndarray:
        """q (N, n) or (n,) -> (N, 6, n) the geometric Jacobian of the tip: d(position) / dq in rows 0-2, the
        angular velocity per unit dq in rows 3-5, both in the base frame (MuJoCo's ``mj_jacSite`` layout)."""
        tip, points, axes = self._frames(q)
        jac = np.zeros((len(tip), 6, len(self.names)))
        for k, joint in enumerate(j for j in self.joints if j.kind in MOVING):
            if joint.kind == "prismatic":
                jac[:, :3, k] = axes[k]
            else:
                jac[:, :3, k] = np.cross(axes[k], tip[:, :3, 3] - points[k])
                jac[:, 3:, k] = axes[k]
        return jac

    def _frames(self, q: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """The tip's transform (N, 4, 4), and each moving joint's origin (N, 3) and axis (N, 3) in the base frame."""
        q = np.atleast_2d(np.asarray(q, dtype=np.float64))
        if q.shape[1] != len(self.names):
            raise ValueError(f"q has {q.shape[1]} columns, the chain moves {len(self.names)} joints {list(self.names)}")
        frame = np.broadcast_to(np.eye(4), (len(q), 4, 4)).copy()
        points, axes, k = [], [], 0
        for joint, origin in zip(self.joints, self._origins, strict=True):
            frame = frame @ origin
            if joint.kind not in MOVING:
                continue
            axis = np.array(joint.axis)
            points.append(frame[:, :3, 3].copy())
            axes.append(frame[:, :3, :3] @ axis)
            motion = np.broadcast_to(np.eye(4), frame.shape).copy()
            if joint.kind == "prismatic":
                motion[:, :3, 3] = q[:, k : k + 1] * axis
            else:
                motion[:, :3, :3] = rotation_about(axis, q[:, k])
            frame = frame @ motion
            k += 1
        return frame, points, axes


def rotation_about(axis: np.ndarray, angle: np.ndarray) -> np.ndarray:
    """(N, 3, 3) rotations by ``angle`` (N,) about the unit ``axis`` (3,): Rodrigues' I + sin K + (1 - cos) K^2."""
    x, y, z = axis
    skew = np.array([[0.0, -z, y], [z, 0.0, -x], [-y, x, 0.0]])
    s, c = np.sin(angle)[:, None, None], np.cos(angle)[:, None, None]
    return np.eye(3) + s * skew + (1 - c) * (skew @ skew)
