"""A robot's URDF, read for what a policy's robot needs of it: the joints, their frames, axes and limits.

Only the kinematic tree is read (``<robot name>``, each ``<link name>`` and ``<joint>`` with its
``<parent>``, ``<child>``, ``<origin xyz rpy>``, ``<axis>`` and ``<limit lower upper velocity effort>``);
meshes, inertia and ``package://`` paths are ignored, so a real robot's URDF reads without its assets.
The standard library's XML parser; a URDF that does not parse, or lacks what a joint needs, is refused
with one line naming the fix. Plain Python and numpy: nothing here starts a simulator or ROS.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import numpy as np

JOINT_TYPES = ("revolute", "continuous", "prismatic", "fixed")  # a serial arm's; floating and planar are refused
MOVING = ("revolute", "continuous", "prismatic")


@dataclass(frozen=True)
class UrdfJoint:
    """One ``<joint>``: the child link's frame is the parent's, moved by ``origin``, then by the joint's motion
    (a rotation by q about ``axis``, or a translation by q along it)."""

    name: str
    kind: str  # one of JOINT_TYPES
    parent: str
    child: str
    xyz: tuple[float, float, float]  # the origin's translation, m, in the parent link's frame
    rpy: tuple[float, float, float]  # the origin's fixed-axis roll, pitch, yaw, rad
    axis: tuple[float, float, float]  # unit vector in the joint (child) frame
    lower: float = -math.inf  # position limits (rad, or m for a prismatic joint); +-inf for continuous
    upper: float = math.inf
    velocity: float = math.inf  # velocity limit (rad/s or m/s); inf when the URDF gives none

    def origin(self) -> np.ndarray:
        """(4, 4) the homogeneous transform of ``origin``: translation ``xyz``, rotation Rz(yaw) Ry(pitch) Rx(roll)."""
        transform = np.eye(4)
        transform[:3, :3] = rpy_matrix(*self.rpy)
        transform[:3, 3] = self.xyz
        return transform


@dataclass(frozen=True)
class Urdf:
    """A parsed URDF: its robot name, links and joints (in file order)."""

    name: str
    links: tuple[str, ...]
    joints: tuple[UrdfJoint, ...]

    @property
    def moving_joints(self) -> tuple[UrdfJoint, ...]:
        """The joints a controller moves (revolute, continuous, prismatic), in file order."""
        return tuple(j for j in self.joints if j.kind in MOVING)

    def chain(self, base: str, tip: str) -> tuple[UrdfJoint, ...]:
        """The joints from link ``base`` down to link ``tip``, base first."""
        for link in (base, tip):
            if link not in self.links:
                raise ValueError(f"URDF {self.name!r} has no link {link!r}; its links are {list(self.links)}")
        into = {j.child: j for j in self.joints}
        path, link = [], tip
        while link != base:
            if link not in into:
                raise ValueError(f"URDF {self.name!r}: link {tip!r} does not hang below link {base!r}")
            path.append(into[link])
            link = into[link].parent
        return tuple(reversed(path))

    def root(self) -> str:
        """The one link that is no joint's child."""
        children = {j.child for j in self.joints}
        roots = [link for link in self.links if link not in children]
        if len(roots) != 1:
            raise ValueError(f"URDF {self.name!r} must have one root link, has {roots}")
        return roots[0]


def rpy_matrix(roll: float, pitch: float, yaw: float) -> np.ndarray:
    """(3, 3) URDF's rotation of fixed-axis roll, pitch, yaw: Rz(yaw) @ Ry(pitch) @ Rx(roll)."""
    cr, sr, cp, sp, cy, sy = (
        math.cos(roll),
        math.sin(roll),
        math.cos(pitch),
        math.sin(pitch),
        math.cos(yaw),
        math.sin(yaw),
    )
    return np.array([
        [cy * cp, cy * sp * sr - sy * cr, cy * sp * cr + sy * sr],
        [sy * cp, sy * sp * sr + cy * cr, sy * sp * cr - cy * sr],
        [-sp, cp * sr, cp * cr],
    ])  # fmt: skip


def read_urdf(path: str) -> Urdf:
    """Parse the URDF file at ``path``."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as error:
        raise ValueError(f"cannot read the URDF {path}: {error.strerror}; pass the path of the robot's URDF") from None
    return parse_urdf(text, path)


def parse_urdf(text: str, source: str = "the URDF") -> Urdf:
    """Parse URDF ``text`` (``source`` names it in errors)."""
    try:
        robot = ET.fromstring(text)
    except ET.ParseError as error:
        raise ValueError(f"{source} is not valid XML ({error}); pass the robot's URDF (xacro files must be expanded "
                         "first: xacro robot.urdf.xacro > robot.urdf)") from None  # fmt: skip
    if robot.tag != "robot":
        raise ValueError(f"{source} has <{robot.tag}> at its root, not <robot>: it is not a URDF")
    name = robot.get("name", "")
    links = tuple(link.get("name", "") for link in robot.findall("link"))
    joints = tuple(_joint(element, source) for element in robot.findall("joint"))
    for joint in joints:
        for link in (joint.parent, joint.child):
            if link not in links:
                raise ValueError(f"{source}: joint {joint.name!r} names link {link!r}, which the URDF does not define")
    return Urdf(name, links, joints)


def _joint(element: ET.Element, source: str) -> UrdfJoint:
    name, kind = element.get("name", ""), element.get("type", "")
    if kind not in JOINT_TYPES:
        raise ValueError(f"{source}: joint {name!r} is of type {kind!r}; a robot arm's joints are one of {JOINT_TYPES}")
    parent, child = element.find("parent"), element.find("child")
    if parent is None or child is None:
        raise ValueError(f"{source}: joint {name!r} needs a <parent link=.../> and a <child link=.../>")
    origin, axis, limit = element.find("origin"), element.find("axis"), element.find("limit")
    xyz = _vector(origin.get("xyz") if origin is not None else None, (0.0, 0.0, 0.0), source, name)
    rpy = _vector(origin.get("rpy") if origin is not None else None, (0.0, 0.0, 0.0), source, name)
    direction = np.array(_vector(axis.get("xyz") if axis is not None else None, (1.0, 0.0, 0.0), source, name))
    if kind in MOVING and not np.linalg.norm(direction) > 0:
        raise ValueError(f"{source}: joint {name!r} has a zero <axis>")
    unit = tuple(float(v) for v in direction / (np.linalg.norm(direction) or 1.0))
    bounds: dict[str, float] = {}
    if kind in ("revolute", "prismatic"):
        if limit is None or limit.get("lower") is None or limit.get("upper") is None:
            raise ValueError(f"{source}: {kind} joint {name!r} needs <limit lower=... upper=.../> (a URDF requires it)")
        bounds = {"lower": float(limit.get("lower")), "upper": float(limit.get("upper"))}
    if limit is not None and limit.get("velocity") is not None:
        bounds["velocity"] = float(limit.get("velocity"))
    return UrdfJoint(name, kind, parent.get("link", ""), child.get("link", ""), xyz, rpy, unit, **bounds)  # type: ignore[arg-type]


def _vector(
    text: str | None, default: tuple[float, float, float], source: str, joint: str
) -> tuple[float, float, float]:
    if text is None:
        return default
    try:
        values = tuple(float(v) for v in text.split())
    except ValueError:
        values = ()
    if len(values) != 3:
        raise ValueError(f"{source}: joint {joint!r} has {text!r} where three numbers belong")
    return values  # type: ignore[return-value]
