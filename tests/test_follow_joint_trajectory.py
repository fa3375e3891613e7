"""`vla-rl serve --output=trajectory --trajectory_action=<name>`: the arm's trajectories as goals of
control_msgs/FollowJointTrajectory. control_msgs has no pip wheel, so the tests that need it carry the
``control_msgs`` marker and are deselected by default (``pytest -m control_msgs`` runs them where a ROS 2
installation provides it); the refusal without it runs everywhere."""

import importlib.util

import pytest
from bridge_policies import ramp_policy  # noqa: F401 (the bridge's worker loads it)
from test_bridge_node import _at_home_pose, make_bridge, ros, spin_until  # noqa: F401 (ros: the fixture)

ACTION = "/arm_controller/follow_joint_trajectory"


def test_trajectory_action_without_control_msgs_is_refused_with_the_fix(ros):  # noqa: F811
    context, executor = ros
    if importlib.util.find_spec("control_msgs") is not None:  # a ROS 2 installation has it: the client starts
        bridge, _ = make_bridge(context, executor, output="trajectory", trajectory_action=ACTION)
        bridge.close()
        return
    with pytest.raises(ValueError, match=r"trajectory_action needs control_msgs, which has no pip wheel.*"
                                         r"leave trajectory_action empty"):  # fmt: skip
        make_bridge(context, executor, output="trajectory", trajectory_action=ACTION)


@pytest.mark.control_msgs
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
