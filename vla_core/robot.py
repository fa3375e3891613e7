"""The robot description: what a robot is to a policy, to the simulator and to the bridge.

One frozen :class:`RobotDescription` per robot names its state and action vectors, says what the
actions command, the workspace they are clipped to, the joint limits and what the robot can
physically report. It is the layer every package reads the robot from (`sim.arm` derives the
simulated arm's constants from it, `robot_bridge.config` and `robot_bridge.convert` their
defaults), so each number is written once, here. Plain Python: importing it starts no simulator.

The joints, their limits and velocity limits, and the kinematic chain an end-effector action
commands come from the robot's URDF (:meth:`RobotDescription.from_urdf`, `vla_core.urdf`); the
simulated Panda's is ``vla_core/robots/sim_panda.urdf`` (checked against the simulator's MJCF by
tests/test_urdf.py). The layout of the state and action vectors, and the workspace, are the
robot's use, not its body: the caller gives them (a joint-space layout of every moving joint by
default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, get_args

from vla_core.urdf import parse_urdf

if TYPE_CHECKING:
    from vla_core.kinematics import KinematicChain

# What the action dims command: joint positions, or an end-effector pose (plus a gripper value).
ActionSpace = Literal["joint", "end_effector"]
# The action names of an end-effector position (m, in the URDF root link's frame: the world frame of the
# simulated Panda), and of the gripper value (0 open, 1 closed), as every end-effector policy here names them.
EE_POSITION = ("ee_x", "ee_y", "ee_z")
GRIP = "grip"


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
    # Joint name -> velocity limit (rad/s, m/s; a URDF's <limit velocity=...>), where the robot gives one.
    velocity_limits: Mapping[str, float] = field(default_factory=dict)
    urdf: str = ""  # the URDF text the description was read from ("" when written by hand): its kinematics
    ee_link: str = ""  # the URDF link end-effector actions command ("" when none does)

    def __post_init__(self) -> None:
        freeze = {
            "state_names": tuple(self.state_names),
            "action_names": tuple(self.action_names),
            "action_low": tuple(float(v) for v in self.action_low),
            "action_high": tuple(float(v) for v in self.action_high),
            "joint_limits": _ranges(self.joint_limits),
            "state_bounds": _ranges(self.state_bounds),
            "velocity_limits": MappingProxyType({k: float(v) for k, v in self.velocity_limits.items()}),
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
        if self.ee_link and not self.urdf:
            raise ValueError(
                f"{self.name}: ee_link={self.ee_link!r} names a URDF link, but the description has no URDF"
            )

    @classmethod
    def from_urdf(
        cls, urdf: str, source: str = "the URDF", *, name: str = "", state_names: Sequence[str] | None = None,
        action_names: Sequence[str] | None = None, action_space: ActionSpace = "joint",
        action_low: Sequence[float] | None = None, action_high: Sequence[float] | None = None,
        state_bounds: Mapping[str, Sequence[float]] | None = None, ee_link: str = "",
    ) -> RobotDescription:  # fmt: skip
        """The description of the robot whose URDF text is ``urdf`` (``source`` names it in errors).

        From the URDF: the name (unless ``name``), every moving joint's position and velocity limits, and,
        with ``ee_link``, the chain an end-effector action commands. The layout defaults to joint space: the
        state and the actions are the moving joints' positions, the actions clipped to the joints' limits.
        Every state entry that is a joint is bounded by its limits; ``state_bounds`` adds (or overrides) the
        rest. A layout whose action_space is end_effector needs ``ee_link`` and the workspace
        (``action_low``, ``action_high``).
        """
        parsed = parse_urdf(urdf, source)
        moving = parsed.moving_joints
        limits = {j.name: (j.lower, j.upper) for j in moving}
        states = list(state_names) if state_names is not None else list(limits)
        actions = list(action_names) if action_names is not None else list(limits)
        if action_low is None or action_high is None:
            unknown = [a for a in actions if a not in limits]
            if unknown:
                raise ValueError(f"{source}: actions {unknown} are not joints of {parsed.name!r} (its moving joints: "
                                 f"{list(limits)}); give action_low and action_high for them")  # fmt: skip
            action_low, action_high = [limits[a][0] for a in actions], [limits[a][1] for a in actions]
        description = cls(
            name=name or parsed.name, state_names=states, action_names=actions, action_space=action_space,
            action_low=action_low, action_high=action_high, joint_limits=limits,
            state_bounds={**{n: limits[n] for n in states if n in limits}, **(state_bounds or {})},
            velocity_limits={j.name: j.velocity for j in moving if j.velocity != float("inf")},
            urdf=urdf, ee_link=ee_link,
        )  # fmt: skip
        if ee_link:
            description.chain()  # the link exists and hangs below the root: refused now, not at the first target
        return description

    @classmethod
    def read_urdf(cls, path: str | Path, **layout) -> RobotDescription:
        """:meth:`from_urdf` of the URDF file at ``path``."""
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"cannot read the URDF {path}: {error.strerror}; pass the robot's URDF file") from None
        return cls.from_urdf(text, str(path), **layout)

    def chain(self) -> KinematicChain:
        """The kinematic chain from the URDF's root link to ``ee_link``, what end-effector targets are solved on."""
        from vla_core.kinematics import KinematicChain

        if not self.ee_link:
            raise ValueError(f"{self.name}: no ee_link: the description names no link for end-effector actions")
        return KinematicChain.from_urdf(parse_urdf(self.urdf, self.name), tip=self.ee_link)


def _ranges(ranges: Mapping[str, Sequence[float]]) -> Mapping[str, tuple[float, float]]:
    """A read-only copy of ``ranges`` with each value a (low, high) pair of floats."""
    out = {}
    for name, bound in ranges.items():
        if len(bound) != 2:
            raise ValueError(f"{name}: a range is (low, high), got {bound}")
        out[name] = (float(bound[0]), float(bound[1]))
    return MappingProxyType(out)


# -- the simulated Panda (vla_core/robots/sim_panda.urdf; sim/assets/panda_arm.xml, `vla-rl sim-robot`) ---

PANDA_URDF = Path(__file__).parent / "robots" / "sim_panda.urdf"
_PANDA_ARM = [f"joint{i}" for i in range(1, 8)]
_EE = list(EE_POSITION)  # the end-effector (grasp site) position, m, world frame
# The end-effector workspace every action is clipped to (m, world frame), then the grip's range.
_PANDA_LOW, _PANDA_HIGH = (0.25, -0.35, 0.0, 0.0), (0.80, 0.35, 0.40, 1.0)
# The fingers' travel (m each finger opens), the URDF's: the reported gripper width is both together.
_FINGER_TRAVEL = sum(j.upper for j in parse_urdf(PANDA_URDF.read_text()).moving_joints if j.name.startswith("finger"))

SIM_PANDA = RobotDescription.read_urdf(
    PANDA_URDF,
    name="sim_panda",
    # (11,): the 7 arm joint angles (rad), the gripper width (m, both fingers together), the end effector (m)
    state_names=[*_PANDA_ARM, "gripper_width", *_EE],
    # (4,): the end-effector target position (m, world frame) and the grip, 0 open to 1 closed
    action_names=[*_EE, GRIP],
    action_space="end_effector",
    action_low=_PANDA_LOW,
    action_high=_PANDA_HIGH,
    # Beyond the arm joints' limits (from the URDF): the fingers' travel, and the workspace (the controller
    # only reaches for targets inside it).
    state_bounds={
        "gripper_width": (0.0, _FINGER_TRAVEL),
        **{name: (_PANDA_LOW[i], _PANDA_HIGH[i]) for i, name in enumerate(_EE)},
    },
    ee_link="grasp",
)
