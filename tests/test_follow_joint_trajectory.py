"""`vla-rl serve --output=trajectory --trajectory_action=<name>`: the arm's trajectories as goals of
control_msgs/FollowJointTrajectory, against a real action server. control_msgs has no pip wheel: `make` builds
its FollowJointTrajectory from interfaces/control_msgs (its own definitions) into the venv."""

import pytest
from bridge_policies import ramp_policy  # noqa: F401 (the bridge's worker loads it)
from test_bridge_node import _at_home_pose, make_bridge, ros, spin_until  # noqa: F401 (ros: the fixture)

ACTION = "/arm_controller/follow_joint_trajectory"


def test_trajectory_action_without_control_msgs_is_refused_with_the_fix(ros, monkeypatch):  # noqa: F811
    """Where control_msgs is missing (an install without `make`), serve refuses trajectory_action in one line that
    names both ways to get it and the topic it could use instead."""
    from robot_bridge import follow_joint_trajectory

    monkeypatch.setattr(follow_joint_trajectory, "FollowJointTrajectory", None)
    context, executor = ros
    with pytest.raises(ValueError, match=r"trajectory_action needs control_msgs, which has no pip wheel: run `make`.*"
                                         r"source a ROS 2 installation.*leave trajectory_action empty"):  # fmt: skip
        make_bridge(context, executor, output="trajectory", trajectory_action=ACTION)


def test_the_built_follow_joint_trajectory_is_control_msgs_own():
    """The action built from interfaces/control_msgs has control_msgs 6.8.0's fields and constants (checked against
    its definition, typed out here): a real joint_trajectory_controller speaks the same type."""
    from control_msgs.action import FollowJointTrajectory
    from control_msgs.msg import JointComponentTolerance, JointTolerance

    assert FollowJointTrajectory.Goal.get_fields_and_field_types() == {
        "trajectory": "trajectory_msgs/JointTrajectory", "multi_dof_trajectory": "trajectory_msgs/MultiDOFJointTrajectory",
        "path_tolerance": "sequence<control_msgs/JointTolerance>",
        "component_path_tolerance": "sequence<control_msgs/JointComponentTolerance>",
        "goal_tolerance": "sequence<control_msgs/JointTolerance>",
        "component_goal_tolerance": "sequence<control_msgs/JointComponentTolerance>",
        "goal_time_tolerance": "builtin_interfaces/Duration",
    }  # fmt: skip
    assert FollowJointTrajectory.Result.get_fields_and_field_types() == {
        "error_code": "int32",
        "error_string": "string",
    }
    assert (FollowJointTrajectory.Result.SUCCESSFUL, FollowJointTrajectory.Result.GOAL_TOLERANCE_VIOLATED) == (0, -5)
    assert list(FollowJointTrajectory.Feedback.get_fields_and_field_types()) == [
        "header", "joint_names", "desired", "actual", "error", "index", "multi_dof_joint_names", "multi_dof_desired",
        "multi_dof_actual", "multi_dof_error", "multi_dof_index",
    ]  # fmt: skip
    assert JointTolerance.get_fields_and_field_types() == {"name": "string", "position": "double", "velocity": "double",
                                                           "acceleration": "double"}  # fmt: skip
    assert JointComponentTolerance.ROTATION == 5 and "component" in JointComponentTolerance.get_fields_and_field_types()


@pytest.mark.parametrize("accept", [True, False])
def test_trajectories_go_as_follow_joint_trajectory_goals(ros, accept):  # noqa: F811
    """An action server in this process accepts (or rejects) every goal: accepted goals carry the arm's joints and
    the plan's points, nothing goes on the arm's topic, and a rejected goal is counted (trajectory_rejected)."""
    from control_msgs.action import FollowJointTrajectory
    from rclpy.action import ActionServer, GoalResponse

    context, executor = ros
    goals = []

    def execute(handle):
        goals.append(handle.request.trajectory)
        handle.succeed()
        return FollowJointTrajectory.Result()

    bridge, robot = make_bridge(context, executor, output="trajectory", trajectory_action=ACTION)
    server = ActionServer(robot.node, FollowJointTrajectory, ACTION, execute,
                          goal_callback=lambda _: GoalResponse.ACCEPT if accept else GoalResponse.REJECT)  # fmt: skip
    robot.state_override = _at_home_pose
    try:
        if accept:
            assert spin_until(executor, lambda: len([g for g in goals if len(g.points) > 1]) >= 2)
            assert list(goals[-1].joint_names) == [f"joint{i}" for i in range(1, 8)]
            assert robot.arm_trajectories == [] and robot.gripper_trajectories
            assert bridge.diagnostics.counters["trajectory_goals_accepted"] >= 2
        else:
            assert spin_until(executor, lambda: bridge.diagnostics.counters["trajectory_rejected"] >= 2)
            assert goals == []
    finally:
        server.destroy()
        bridge.close()
