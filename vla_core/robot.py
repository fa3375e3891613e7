"""The robot description: what a robot is to a policy, to the simulator and to the bridge.

One frozen :class:`RobotDescription` per robot names its state and action vectors, says what the
actions command, the workspace they are clipped to, the joint limits and what the robot can
physically report. It is the layer every package reads the robot from (`sim.arm` derives the
simulated arm's constants from it, `robot_bridge.config` and `robot_bridge.convert` their
defaults), so each number is written once, here. Plain Python: importing it starts no simulator.

The fields are those a URDF carries or implies (joint names and ``<limit lower upper>``), so a
real robot's description can be read from its URDF (``RobotDescription.from_urdf``, planned with
the real-robot work) instead of being written by hand like :data:`SIM_PANDA`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

# What the action dims command: joint positions, or an end-effector pose (plus a gripper value).
ActionSpace = Literal["joint", "end_effector"]


@dataclass(frozen=True)
class RobotDescription:
    """A robot's contract: its state and action layouts, limits and bounds (immutable; checked when built).

    Sequences become tuples and mappings read-only views, so no caller can change a shared description.
    """

    name: str  # the robot's name (a URDF's <robot name=...>)
    # observation.state (S,): the entries in order, as JointState names (a joint's own name for its position)
    state_names: Sequence[str]
    action_names: Sequence[str]  # action (A,): the entries in order, as JointTrajectory joint_names
    action_space: ActionSpace  # joint (joint positions) or end_effector (a pose, plus the grip)
    # The workspace each action is clipped to: (A,) lowest and highest value, in each action's own unit
    # (rad for a joint, m for a position, [0, 1] for a grip).
    action_low: Sequence[float]
    action_high: Sequence[float]
    # Every actuated joint, in kinematic order -> its position limits (lower, upper): rad for a revolute
    # joint, m for a prismatic one (a URDF's <joint name=...><limit lower=... upper=.../>).
    joint_limits: Mapping[str, tuple[float, float]]
    # What the robot can physically report, by state name -> (low, high) in the entry's unit: a reading
    # outside is a sensor fault. Entries without bounds are unchecked.
    state_bounds: Mapping[str, tuple[float, float]]

    def __post_init__(self) -> None:
        freeze = {
            "state_names": tuple(self.state_names),
            "action_names": tuple(self.action_names),
            "action_low": tuple(float(v) for v in self.action_low),
            "action_high": tuple(float(v) for v in self.action_high),
            "joint_limits": _ranges(self.joint_limits),
            "state_bounds": _ranges(self.state_bounds),
        }
        for name, value in freeze.items():
            object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        """Raise ValueError naming the first inconsistency."""
        if self.action_space not in get_args(ActionSpace):
            raise ValueError(f"{self.name}: action_space={self.action_space!r} is not one of {get_args(ActionSpace)}")
        for what, names in (("state_names", self.state_names), ("action_names", self.action_names)):
            if not names or len(set(names)) != len(names):
                raise ValueError(f"{self.name}: {what} must be non-empty and unique, got {list(names)}")
        n = len(self.action_names)
        if len(self.action_low) != n or len(self.action_high) != n:
            raise ValueError(f"{self.name}: action_low and action_high need one value per action ({n})")
        if any(low > high for low, high in zip(self.action_low, self.action_high)):
            raise ValueError(f"{self.name}: action_low must be <= action_high in every action")
        unknown = sorted(set(self.state_bounds) - set(self.state_names))
        if unknown:
            raise ValueError(f"{self.name}: state_bounds names entries that are not states: {unknown}")
        for what, ranges in (("joint_limits", self.joint_limits), ("state_bounds", self.state_bounds)):
            for name, (low, high) in ranges.items():
                if not low <= high:
                    raise ValueError(f"{self.name}: {what}[{name!r}] must be (low, high) with low <= high")


def _ranges(ranges: Mapping[str, Sequence[float]]) -> Mapping[str, tuple[float, float]]:
    """A read-only copy of ``ranges`` with each value a (low, high) pair of floats."""
    out = {}
    for name, bound in ranges.items():
        if len(bound) != 2:
            raise ValueError(f"{name}: a range is (low, high), got {bound}")
        out[name] = (float(bound[0]), float(bound[1]))
    return MappingProxyType(out)


# -- the simulated Panda (sim/assets/panda_arm.xml, `vla-rl sim-robot`) ---------------------------

# The actuated joints of panda_arm.xml and their ranges: the 7 arm joints (rad), then the two
# finger slides (m each finger opens).
_PANDA_JOINTS = {
    "joint1": (-2.8973, 2.8973),
    "joint2": (-1.7628, 1.7628),
    "joint3": (-2.8973, 2.8973),
    "joint4": (-3.0718, -0.0698),
    "joint5": (-2.8973, 2.8973),
    "joint6": (-0.0175, 3.7525),
    "joint7": (-2.8973, 2.8973),
    "finger_joint1": (0.0, 0.04),
    "finger_joint2": (0.0, 0.04),
}
_PANDA_ARM = [f"joint{i}" for i in range(1, 8)]
_EE = ["ee_x", "ee_y", "ee_z"]  # the end-effector (grasp site) position, m, world frame
# The end-effector workspace every action is clipped to (m, world frame), then the grip's range.
_PANDA_LOW, _PANDA_HIGH = (0.25, -0.35, 0.0, 0.0), (0.80, 0.35, 0.40, 1.0)

SIM_PANDA = RobotDescription(
    name="sim_panda",
    # (11,): the 7 arm joint angles (rad), the gripper width (m, both fingers together), the end effector (m)
    state_names=[*_PANDA_ARM, "gripper_width", *_EE],
    # (4,): the end-effector target position (m, world frame) and the grip, 0 open to 1 closed
    action_names=[*_EE, "grip"],
    action_space="end_effector",
    action_low=_PANDA_LOW,
    action_high=_PANDA_HIGH,
    joint_limits=_PANDA_JOINTS,
    # The joint limits, the two fingers' travel, and the workspace (the controller only reaches for
    # targets inside it).
    state_bounds={
        **{name: _PANDA_JOINTS[name] for name in _PANDA_ARM},
        "gripper_width": (0.0, _PANDA_JOINTS["finger_joint1"][1] + _PANDA_JOINTS["finger_joint2"][1]),
        **{name: (_PANDA_LOW[i], _PANDA_HIGH[i]) for i, name in enumerate(_EE)},
    },
)
