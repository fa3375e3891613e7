"""`vla-rl serve --output=trajectory --trajectory_action=<name>`: the arm's trajectories as goals of
control_msgs/FollowJointTrajectory, the action joint_trajectory_controller serves beside its topic.

control_msgs has no pip wheel: the project's install (`make`) builds its FollowJointTrajectory from
``interfaces/control_msgs`` (control_msgs' own definitions) into the venv, and a sourced ROS 2 installation
provides it too. It is imported here, and this module only when ``trajectory_action`` is set. Each trajectory is a new goal, which the controller takes as it takes a
trajectory on its topic (the new one replaces the rest of the previous from its start stamp); a goal the
server accepts is counted (``trajectory_goals_accepted``), one it rejects, or one sent while no server is
up, too (``trajectory_rejected``) and logged once a
second; the previous trajectory runs on, so the robot holds its last point at worst.
"""

from __future__ import annotations

from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.log_limit import LogLimiter

try:
    from control_msgs.action import FollowJointTrajectory
except ImportError:  # not built (an install without `make`) and no ROS 2 installation sourced
    FollowJointTrajectory = None

MISSING = (
    "trajectory_action needs control_msgs, which has no pip wheel: run `make` (it builds control_msgs' "
    "FollowJointTrajectory into the venv from interfaces/control_msgs) or source a ROS 2 installation that has it "
    "(ros-<distro>-control-msgs), or leave trajectory_action empty to send trajectories on topics.arm_trajectory"
)


class FollowJointTrajectoryClient:
    """Sends JointTrajectory messages as FollowJointTrajectory goals to the action server ``action_name``."""

    def __init__(self, node, action_name: str, diagnostics: BridgeDiagnostics, log_limiter: LogLimiter) -> None:
        if FollowJointTrajectory is None:
            raise ValueError(MISSING)
        from rclpy.action import ActionClient

        self.action_name, self.diagnostics, self.log_limiter = action_name, diagnostics, log_limiter
        self._client = ActionClient(node, FollowJointTrajectory, action_name)

    def send(self, trajectory) -> None:
        """A trajectory_msgs/JointTrajectory as a new goal (never blocks: the answer arrives in a callback)."""
        if not self._client.server_is_ready():
            self._rejected(f"no FollowJointTrajectory server at {self.action_name}; start the robot's controller "
                           "or check trajectory_action")  # fmt: skip
            return
        future = self._client.send_goal_async(FollowJointTrajectory.Goal(trajectory=trajectory))
        future.add_done_callback(self._on_goal_response)

    def _on_goal_response(self, future) -> None:
        handle = future.result()
        if handle is not None and handle.accepted:
            self.diagnostics.count("trajectory_goals_accepted")
            return
        self._rejected(f"the controller at {self.action_name} rejected a trajectory (see its log: joint names, "
                       "limits or a start in the past); the previous one runs on")  # fmt: skip

    def _rejected(self, line: str) -> None:
        self.diagnostics.count("trajectory_rejected")
        self.diagnostics.last_error = line
        self.log_limiter("trajectory rejected", "warning", line)
