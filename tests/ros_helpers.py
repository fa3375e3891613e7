"""Test-side ROS 2 helpers: start `vla-rl` nodes as subprocesses (`vla_rl.processes`, which the
benchmarks start them with too) and talk to the sim robot.

Every test module uses its own ROS_DOMAIN_ID and keeps discovery on this machine, so modules
running at the same time (or other people's tests) never see each other's topics.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from vla_rl.processes import STOPPED_BY_SIGINT, last_json, ros_environ, start_command, stop_command

__all__ = ["STOPPED_BY_SIGINT", "RobotClient", "last_json", "ros_environ", "start_command", "stop_command"]


class RobotClient:
    """An rclpy node in the test process that watches the sim robot and, with ``commands``, sends it commands
    (without, it publishes on no command topic: beside a serve node it would be another commander)."""

    def __init__(self, domain_id: int, commands: bool = False):
        import rclpy
        import rclpy.executors
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import DurabilityPolicy, QoSProfile
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import Float64MultiArray, String
        from trajectory_msgs.msg import JointTrajectory

        os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = rclpy.create_node("test_client", context=self.context)
        self.executor = rclpy.executors.SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.joint_states: list = []  # every JointState received, in arrival order
        self.images: dict[int, object] = {}  # stamp ns -> Image of the front camera
        self.statuses: list[dict] = []
        self.instructions: list[str] = []
        self.diagnostics: list = []  # DiagnosticStatus of each report
        sub = self.node.create_subscription
        sub(JointState, "/joint_states", self.joint_states.append, 50)
        sub(Image, "/camera/front/image_raw", lambda m: self.images.__setitem__(_ns(m.header.stamp), m), 50)
        sub(String, "/sim_robot/episode", lambda m: self.statuses.append(json.loads(m.data)), 50)
        latched = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL)
        sub(String, "/instruction", lambda m: self.instructions.append(m.data), latched)
        sub(DiagnosticArray, "/diagnostics", lambda m: self.diagnostics.extend(m.status), 50)
        self.trajectory_pub = self.array_pub = self.arm_pub = self.gripper_pub = None
        if commands:
            self.trajectory_pub = self.node.create_publisher(JointTrajectory, "/command/joint_trajectory", 10)
            self.array_pub = self.node.create_publisher(Float64MultiArray, "/command/array", 10)
            # A robot with --input=trajectory: its arm's and gripper's joint_trajectory_controller-like topics.
            self.arm_pub = self.node.create_publisher(JointTrajectory, "/arm_controller/joint_trajectory", 10)
            self.gripper_pub = self.node.create_publisher(JointTrajectory, "/gripper_controller/joint_trajectory", 10)

    def spin_until(self, predicate, timeout: float, what: str):
        """Spin until ``predicate()`` returns an array or a truthy value and return it; fail naming ``what``
        after ``timeout`` s."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            result = predicate()
            if isinstance(result, np.ndarray) or result:
                return result
            self.executor.spin_once(timeout_sec=0.01)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    def spin_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.executor.spin_once(timeout_sec=0.01)

    def state_at(self, stamp_ns: int) -> np.ndarray | None:
        """(11,) position of the joint state stamped ``stamp_ns``, if received."""
        for msg in reversed(self.joint_states):
            if _ns(msg.header.stamp) == stamp_ns:
                return np.array(msg.position)
        return None

    def latest_ee(self) -> np.ndarray:
        return np.array(self.joint_states[-1].position[8:11])

    def send_trajectory(self, names: list[str], positions: list[float], stamp_ns: int | None = None) -> None:
        """One JointTrajectory with a single point; stamped now unless ``stamp_ns`` is given (0 = unstamped)."""
        from builtin_interfaces.msg import Time
        from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

        msg = JointTrajectory(joint_names=names, points=[JointTrajectoryPoint(positions=[float(p) for p in positions])])
        ns = self.node.get_clock().now().nanoseconds if stamp_ns is None else stamp_ns
        msg.header.stamp = Time(sec=ns // 10**9, nanosec=ns % 10**9)
        self.trajectory_pub.publish(msg)

    def send_joint_trajectory(self, publisher, names: list[str], positions, period_s: float, stamp_ns: int = 0) -> None:
        """A whole trajectory: point k of ``positions`` (P, J) reached (k + 1) ``period_s`` after ``stamp_ns`` (0 =
        when it arrives), on ``publisher`` (``arm_pub`` or ``gripper_pub``)."""
        from robot_bridge import codec

        publisher.publish(codec.trajectory_points_msg(names, np.asarray(positions), codec.time_msg(stamp_ns), period_s))

    def send_array(self, values: list[float]) -> None:
        from std_msgs.msg import Float64MultiArray

        self.array_pub.publish(Float64MultiArray(data=[float(v) for v in values]))

    def wait_for_robot(self, timeout: float = 60, trajectories: bool = False) -> None:
        """Until the robot's publishers and our command subscriptions have matched each other (``trajectories``:
        the subscriptions of a robot with --input=trajectory)."""
        pubs = (self.arm_pub, self.gripper_pub) if trajectories else (self.trajectory_pub, self.array_pub)
        pubs = [p for p in pubs if p is not None]  # a client without commands waits for the robot's topics alone
        self.spin_until(lambda: all(p.get_subscription_count() for p in pubs) and self.joint_states and self.statuses,
                        timeout, "the sim robot")  # fmt: skip

    def close(self) -> None:
        import rclpy

        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


def _ns(stamp) -> int:
    return stamp.sec * 10**9 + stamp.nanosec
