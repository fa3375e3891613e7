"""The simulated arm's end-effector controller: one damped-least-squares IK step per control step, batched.

The step is `vla_core.ik.ik_targets`, the one the robot's solver iterates; this module reads the scene
(its home keyframe, joint ranges, the grasp site's orientation) and adds the fingers. numpy arrays (the
cpu backend, the benchmark's gymnasium baseline) or torch tensors on any device (the Warp backend).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from sim.arm import finger_targets
from vla_core.ik import ik_targets, orientation_error_map


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
