"""The robot `vla-rl serve` drives, as a `vla_core.robot.RobotDescription`: where it comes from, how the
policy's actions map onto it, and the safety limits it gives. No ROS import here.

Where from (`ServeConfig`): ``robot_description``, a URDF file; else ``topics.robot_description``, the
std_msgs/String robot_state_publisher publishes (transient local), until which the node holds; else the
simulated Panda's URDF (`vla_core.robot.SIM_PANDA`). That default changes nothing a config written before
descriptions existed does: its limits stay the config's, and a layout that does not map onto the Panda
(another robot's joint names) is served per tick as before, without a description; only trajectory
output, which needs one, refuses it. The layout is the serve config's: its state and action names and
action space.

The mapping (:func:`map_actions`) is where each action dim goes: a joint-space policy's actions must be
joints of the URDF; an end-effector policy's ``ee_x, ee_y, ee_z`` are a position of ``ee_link`` in the
URDF root link's frame, solved to the chain's joints; ``grip`` (0 open, 1 closed) drives
``gripper_joints``. A policy that does not map is refused with one line naming both sides, and so is a
URDF that does not parse: the node holds, counts it (``description_rejected``) and says why.

The limits (:func:`safety_limits`), for a description given (file or topic): the command limits the config
leaves empty default to the description's (each joint's position and velocity limits, the grip's [0, 1]),
and every state entry that is a joint is bounded by its limits. Trajectory output also clamps every joint
to its limits and velocity limit, whichever description it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from robot_bridge.config import SIM_STATE_BOUNDS, ServeConfig
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.log_limit import LogLimiter
from vla_core.robot import EE_POSITION, GRIP, SIM_PANDA, RobotDescription
from vla_core.urdf import parse_urdf


@dataclass(frozen=True)
class ActionMapping:
    """Where the policy's action dims (A,) go on the robot: indices into the action vector."""

    end_effector: bool  # ee_x, ee_y, ee_z are solved to the arm's joints (else the actions are joint positions)
    arm_joints: tuple[str, ...]  # the arm trajectory's joint_names: the chain's moving joints, or the joint actions
    arm_actions: tuple[int, ...]  # end effector: the dims of ee_x, ee_y, ee_z; joint space: each arm joint's dim
    gripper_joints: tuple[str, ...]  # the gripper trajectory's joint_names (empty: the policy has no grip)
    grip_action: int | None  # the dim of the grip value (0 open, 1 closed)
    gripper_open: tuple[float, ...]  # (G,) each gripper joint's position at grip 0
    gripper_closed: tuple[float, ...]  # (G,) and at grip 1

    def arm_targets(self, actions: np.ndarray) -> np.ndarray:
        """actions (P, A) -> (P, 3) end-effector positions, or (P, J) joint positions in ``arm_joints`` order."""
        return np.asarray(actions, dtype=np.float64)[:, list(self.arm_actions)]

    def gripper_positions(self, actions: np.ndarray) -> np.ndarray:
        """actions (P, A) -> (P, G) gripper joint positions: open + grip (closed - open), grip clipped to [0, 1];
        (P, 0) when the policy has no grip."""
        if self.grip_action is None:
            return np.zeros((len(actions), 0))
        grip = np.clip(np.asarray(actions, dtype=np.float64)[:, [self.grip_action]], 0.0, 1.0)  # (P, 1)
        open_, closed = np.array(self.gripper_open), np.array(self.gripper_closed)
        return open_ + grip * (closed - open_)


def describe(urdf: str, source: str, config: ServeConfig, default: bool = False) -> RobotDescription:
    """The robot of URDF text ``urdf`` in the serve config's layout; ``default``: it is the simulated Panda's,
    whose end-effector workspace and ``ee_link`` serve's end-effector actions by default."""
    limits = {j.name: (j.lower, j.upper) for j in parse_urdf(urdf, source).moving_joints}
    workspace = zip(SIM_PANDA.action_names, SIM_PANDA.action_low, SIM_PANDA.action_high) if default else ()
    ranges = {**{n: (low, high) for n, low, high in workspace}, GRIP: (0.0, 1.0), **limits}
    names = config.action_names
    bounds = {n: tuple(b) for n, b in config.safety.state_bounds.items() if n in config.state_names}
    if not default and config.safety.state_bounds == SIM_STATE_BOUNDS:
        # The default bounds are the simulated Panda's: on another robot whose joints share its names (joint1..7)
        # its own URDF limits bound them, not the Panda's; bounds the config sets itself still win.
        bounds = {n: b for n, b in bounds.items() if n not in limits}
    return RobotDescription.from_urdf(
        urdf, source, state_names=config.state_names, action_names=names, action_space=config.action_space,
        action_low=[ranges.get(n, (-np.inf, np.inf))[0] for n in names],
        action_high=[ranges.get(n, (-np.inf, np.inf))[1] for n in names],
        state_bounds=bounds, ee_link=config.ee_link or (SIM_PANDA.ee_link if default else ""),
    )  # fmt: skip


def map_actions(description: RobotDescription, config: ServeConfig) -> ActionMapping:
    """How the policy's actions (``config.action_names``, ``config.action_space``) drive ``description``'s
    robot, or ValueError with one line naming both sides and the fix."""
    names, robot = list(config.action_names), description.name
    joints = list(description.joint_limits)
    others = [n for n in names if n not in EE_POSITION and n != GRIP]
    if config.action_space == "end_effector":
        missing = [n for n in EE_POSITION if n not in names]
        if missing or others:
            raise ValueError(
                f"an end-effector policy's actions are {list(EE_POSITION)} and optionally {GRIP!r}, got {names} "
                f"(missing {missing}, unknown {others}); name them so in action_names, or serve it with "
                f"action_space: joint"
            )
        if not description.ee_link:
            raise ValueError(
                f"the policy commands the end effector ({list(EE_POSITION)}) but robot {robot!r} names no link for "
                f"it; set ee_link to the link it commands (one of {list(parse_urdf(description.urdf).links)})"
            )
        chain = description.chain()
        if not chain.names:
            raise ValueError(f"robot {robot!r}: no joint moves link {description.ee_link!r} (ee_link), so no "
                             f"end-effector target is reachable; set ee_link to a link of the arm")  # fmt: skip
        arm, arm_actions = chain.names, tuple(names.index(n) for n in EE_POSITION)
    else:
        unknown = [n for n in names if n != GRIP and (n not in joints or n in config.gripper_joints)]
        if unknown:
            raise ValueError(
                f"the policy's joint actions {unknown} are not arm joints of robot {robot!r} (its moving joints: "
                f"{joints}; gripper_joints {config.gripper_joints} take the {GRIP!r} action); serve a policy "
                f"trained on this robot's joints, or give this policy's robot as robot_description"
            )
        arm = tuple(n for n in names if n != GRIP)
        arm_actions = tuple(names.index(n) for n in arm)
    grip = names.index(GRIP) if GRIP in names else None
    gripper = tuple(config.gripper_joints) if grip is not None else ()
    absent = [n for n in gripper if n not in joints]
    if grip is not None and (absent or not gripper):
        raise ValueError(
            f"the policy commands {GRIP!r} but gripper_joints {config.gripper_joints} are not joints of robot "
            f"{robot!r} (its moving joints: {joints}); set gripper_joints to its gripper's joints"
        )
    lower = [description.joint_limits[n][0] for n in gripper]
    upper = [description.joint_limits[n][1] for n in gripper]
    opened, closed = (upper, lower) if config.gripper_open == "upper" else (lower, upper)
    return ActionMapping(config.action_space == "end_effector", tuple(arm), arm_actions, gripper, grip,
                         tuple(opened), tuple(closed))  # fmt: skip


def check_measured(mapping: ActionMapping, config: ServeConfig) -> None:
    """Trajectory output anchors on the arm joints' measured positions: they must be among ``state_names``."""
    unmeasured = [n for n in mapping.arm_joints if n not in config.state_names]
    if unmeasured:
        raise ValueError(
            f"output=trajectory starts each trajectory from the measured arm joints, but state_names lacks "
            f"{unmeasured}; add them to state_names (as the robot's JointState names them)"
        )


def safety_limits(description: RobotDescription, config: ServeConfig) -> tuple[list[float], list[float], list[float]]:
    """(position_min, position_max, max_velocity) per action dim: the config's, and where it leaves one empty,
    the description's (each action's range; a joint action's URDF velocity limit, else unlimited)."""
    s = config.safety
    velocity = [description.velocity_limits.get(n, np.inf) for n in config.action_names]
    return (list(s.position_min) or list(description.action_low), list(s.position_max) or list(description.action_high),
            list(s.max_velocity) or velocity)  # fmt: skip


class DescriptionSource:
    """The robot description the node drives and the policy's mapping onto it, or why there is none yet.

    ``on_ready(description, mapping, given)`` is called with each description accepted (by :meth:`start`, from
    a file or the simulated Panda; later from the topic), ``given`` False for the simulated Panda's default;
    ``problem()`` is the hold cause until one is accepted.
    """

    def __init__(self, config: ServeConfig, diagnostics: BridgeDiagnostics, log_limiter: LogLimiter,
                 on_ready: Callable[[RobotDescription, ActionMapping, bool], None]) -> None:  # fmt: skip
        self.config, self.diagnostics, self.log_limiter, self.on_ready = config, diagnostics, log_limiter, on_ready
        self.description: RobotDescription | None = None
        self._problem: tuple[str, str] | None = ("description loading", "reading the robot description")

    def start(self) -> str | None:
        """Read the description the config names: its URDF file, else the simulated Panda's; with only
        ``topics.robot_description``, wait for it (:meth:`on_message`). Returns a line to log when the default
        does not fit the config and the node serves per tick without a description, else None."""
        config = self.config
        if config.robot_description:
            self._offer(lambda: _read(config.robot_description), config.robot_description)
        elif config.topics.robot_description:
            topic = config.topics.robot_description
            why = (f"waiting for the robot description (URDF) on {topic}; start robot_state_publisher, or give the "
                   f"URDF file as robot_description")  # fmt: skip
            self._problem = ("description waiting", why)
        elif config.output == "trajectory":
            self._offer(lambda: SIM_PANDA.urdf, "the simulated Panda's URDF (no robot_description given)", default=True)
        else:
            try:
                self._accept(*self._build(SIM_PANDA.urdf, "", default=True), given=False)
            except ValueError as err:
                self._problem = None
                return (f"no robot description given and the config does not fit the simulated Panda's ({err}); "
                        f"serving the actions per tick with the config's limits only")  # fmt: skip
        return None

    def problem(self) -> tuple[str, str] | None:
        """(key, text) of why the node cannot drive the robot yet, or None."""
        return self._problem

    def on_message(self, msg) -> None:
        """std_msgs/String with the URDF (``topics.robot_description``): accepted unless it is the same text."""
        if self.description is not None and msg.data == self.description.urdf:
            return
        self._offer(lambda: msg.data, self.config.topics.robot_description)

    def _offer(self, text: Callable[[], str], source: str, default: bool = False) -> None:
        """Accept the description of a URDF, or hold: counted, said once a second."""
        try:
            built = self._build(text(), source, default)
        except ValueError as err:
            self.diagnostics.count("description_rejected")
            self._problem = ("description rejected", f"robot description from {source} rejected: {err}")
            self.diagnostics.last_error = self._problem[1]
            self.log_limiter("description rejected", "error", self._problem[1] + "; holding")
            return
        self._accept(*built, given=not default)

    def _build(self, urdf: str, source: str, default: bool) -> tuple[RobotDescription, ActionMapping]:
        description = describe(urdf, source, self.config, default)
        mapping = map_actions(description, self.config)
        if self.config.output == "trajectory":
            check_measured(mapping, self.config)
        return description, mapping

    def _accept(self, description: RobotDescription, mapping: ActionMapping, given: bool) -> None:
        self.description, self._problem = description, None
        self.on_ready(description, mapping, given)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"cannot read the URDF {path}: {error.strerror}; pass the robot's URDF file") from None
