"""The one table of ROS 2 topics: default names and message types, for serve, sim-robot, record-ros and convert.

A robot that names its topics differently changes the names (``topics.*`` and ``cameras`` of the
serve config, the ``*_topic`` fields of convert); the message type of each role never changes.
Types are ROS graph names (``sensor_msgs/msg/Image``); :func:`message_class` imports the class,
so importing this module needs no ROS installation.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Topic:
    name: str  # default topic name
    type: str  # ROS graph type name, e.g. sensor_msgs/msg/JointState

    def message_class(self):
        return message_class(self.type)


# Robot -> policy
JOINT_STATES = Topic("/joint_states", "sensor_msgs/msg/JointState")
INSTRUCTION = Topic("/instruction", "std_msgs/msg/String")  # latched by the sim robot
ESTOP = Topic("/estop", "std_msgs/msg/Bool")  # True latches a hold in serve until False arrives
# Policy -> robot
JOINT_TRAJECTORY = Topic("/command/joint_trajectory", "trajectory_msgs/msg/JointTrajectory")
COMMAND_ARRAY = Topic("/command/array", "std_msgs/msg/Float64MultiArray")  # the same values, in action order
# Policy -> a ros2_control-like robot (`serve --output=trajectory`): each merged chunk as one trajectory over the
# arm's joints, and one over the gripper's joints with the same timing, on the topic interface of
# joint_trajectory_controller (``/<controller>/joint_trajectory``).
ARM_TRAJECTORY = Topic("/arm_controller/joint_trajectory", "trajectory_msgs/msg/JointTrajectory")
GRIPPER_TRAJECTORY = Topic("/gripper_controller/joint_trajectory", "trajectory_msgs/msg/JointTrajectory")
# The robot's URDF as robot_state_publisher publishes it (transient local: a late subscriber gets it)
ROBOT_DESCRIPTION = Topic("/robot_description", "std_msgs/msg/String")
# Reports
CHUNK_INFO = Topic("/vla_rl/chunk", "std_msgs/msg/String")  # JSON metadata of each chunk serve merged
EPISODE = Topic("/sim_robot/episode", "std_msgs/msg/String")  # JSON status of the sim robot's episode
DIAGNOSTICS = Topic("/diagnostics", "diagnostic_msgs/msg/DiagnosticArray")

IMAGE_TYPE = "sensor_msgs/msg/Image"
COMPRESSED_IMAGE_TYPE = "sensor_msgs/msg/CompressedImage"
_CAMERA_PREFIX, _RAW_SUFFIX, _COMPRESSED_SUFFIX = "/camera/", "/image_raw", "/image_raw/compressed"


def camera(name: str, compressed: bool = False) -> Topic:
    """The topic of camera ``name``: ``/camera/<name>/image_raw`` (Image) or ``.../compressed`` (CompressedImage)."""
    if compressed:
        return Topic(_CAMERA_PREFIX + name + _COMPRESSED_SUFFIX, COMPRESSED_IMAGE_TYPE)
    return Topic(_CAMERA_PREFIX + name + _RAW_SUFFIX, IMAGE_TYPE)


def camera_of(topic: str) -> tuple[str, bool] | None:
    """(camera name, compressed) of a topic named like :func:`camera`'s, else None."""
    if not topic.startswith(_CAMERA_PREFIX):
        return None
    for suffix, compressed in ((_COMPRESSED_SUFFIX, True), (_RAW_SUFFIX, False)):
        if topic.endswith(suffix) and len(topic) > len(_CAMERA_PREFIX) + len(suffix):
            return topic[len(_CAMERA_PREFIX) : -len(suffix)], compressed
    return None


def message_class(type_name: str):
    """The rclpy message class of a type name such as ``sensor_msgs/msg/Image``."""
    package, kind, name = type_name.split("/")
    try:
        return getattr(importlib.import_module(f"{package}.{kind}"), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"message type {type_name!r} is not installed; install its ROS 2 wheel (ros-{package.replace('_', '-')})"
        ) from err
