"""`vla-rl sim-robot` as a subprocess, driven over real ROS 2 topics from this process.

The machine may be loaded (the robot can fall behind real time): the tests wait for events and
counts with generous timeouts, never for what a wall-clock window should contain. The real-time
factor is checked by the slow test at the end.
"""

import time

import numpy as np
import pytest
import torch
from ros_helpers import STOPPED_BY_SIGINT, RobotClient, last_json, start_command, stop_command

DOMAIN_ID = 61
TIMEOUT = 30  # seconds to wait for an event


@pytest.fixture
def client():
    c = RobotClient(DOMAIN_ID, commands=True)
    yield c
    c.close()


def test_lock_step_robot_matches_the_batched_env_and_the_replayed_expert_succeeds(client, tmp_path):
    """Same seed, same actions: every published JointState equals observation.state of a batched env of
    one world, and the expert's episode, sent as commands, succeeds on the robot at the same step."""
    from sim.arm import ACTION_NAMES
    from sim.config import EnvConfig
    from sim.mujoco_env import MujocoBatchedEnv
    from sim.tasks import EXPERTS

    seed = 3
    robot = start_command(["sim-robot", "--env.task=lift", f"--seed={seed}", "--sync=true", "--max_episodes=1"],
                          DOMAIN_ID, tmp_path, "robot")  # fmt: skip
    try:
        with MujocoBatchedEnv(EnvConfig(task="lift", num_envs=1)) as env:
            obs = env.reset(seed=seed)
            expert = EXPERTS["lift"](1)
            client.wait_for_robot()
            assert client.instructions[-1] == env.task.instruction == "pick up the red cube"
            start = client.statuses[-1]
            assert (start["episode"], start["step"], start["tick"]) == (0, 0, 0)
            published = client.state_at(start["stamp_ns"])
            np.testing.assert_array_equal(published, obs["observation.state"][0].double().numpy())
            image = client.spin_until(lambda: client.images.get(start["stamp_ns"]), TIMEOUT, "the first image")
            expected = obs["observation.images.front"][0].permute(1, 2, 0).mul(255).round().byte().numpy()
            assert (image.height, image.width, image.encoding) == (64, 64, "rgb8")
            assert (
                np.abs(np.frombuffer(bytes(image.data), np.uint8).reshape(64, 64, 3).astype(int) - expected).max() <= 1
            )

            shuffled = [ACTION_NAMES[i] for i in (3, 1, 0, 2)]
            for step in range(1, env.max_episode_steps + 1):
                action = expert.act(env.ee_positions(), env.privileged_state())[0]
                obs, _, terminated, truncated, info = env.step(torch.from_numpy(action[None]))
                if step % 2:  # both command topics, names in another order than the action's
                    client.send_trajectory(shuffled, [action[ACTION_NAMES.index(n)] for n in shuffled])
                else:
                    client.send_array(action)
                status = client.spin_until(lambda step=step: next((s for s in client.statuses if s["tick"] == step), None),
                                           TIMEOUT, f"the status of step {step}")  # fmt: skip
                done = bool(terminated[0] or truncated[0])
                assert (status["step"], status["done"], status["success"]) == (step, done, bool(info["success"][0]))
                if done:
                    break
                stamp = status["stamp_ns"]
                state = client.spin_until(
                    lambda stamp=stamp: client.state_at(stamp), TIMEOUT, f"the joint state of step {step}"
                )
                np.testing.assert_array_equal(state, obs["observation.state"][0].double().numpy())
            assert status["success"], f"the replayed expert did not lift the cube in {step} steps"
    finally:
        code, out, err = stop_command(robot, tmp_path, "robot", exits_by_itself=True)  # max_episodes=1
    assert code == 0, err
    summary = last_json(out)
    assert summary["episodes_done"] == 1 and summary["successes"] == 1
    assert summary["steps"] == step
    assert "episode 0 succeeded" in err


def _diagnostic(client, key: str) -> str:
    return {kv.key: kv.value for kv in client.diagnostics[-1].values}[key] if client.diagnostics else ""


def _drive_until(client, send, done, what: str, timeout: float = TIMEOUT):
    """Send a command every 50 ms (fresh, well within the robot's 0.3 s timeout) until ``done()``."""
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
        send()
        client.spin_for(0.05)


def test_commands_move_the_arm_bad_ones_are_rejected_and_stale_ones_hold(client, tmp_path):
    """Real-time mode: the arm follows an end-effector target, survives NaN, wrong-size, wrongly named and
    out-of-order commands (counted on /diagnostics and in its log), holds when commands stop, and recovers."""
    robot = start_command(["sim-robot", "--env.task=reach", "--env.max_episode_steps=1000", "--command_timeout_s=0.3",
                           "--diagnostics_period_s=0.2"], DOMAIN_ID, tmp_path, "robot")  # fmt: skip
    names = ["ee_z", "grip", "ee_x", "ee_y"]  # matched by name, not position
    try:
        client.wait_for_robot()
        client.spin_until(lambda: client.diagnostics, TIMEOUT, "the first diagnostics")
        assert client.diagnostics[-1].message == "no command yet; holding position"
        ee0 = client.latest_ee()

        target = ee0 + np.array([0.08, -0.06, -0.06])
        _drive_until(
            client, lambda: client.send_trajectory(names, [target[2], 0.0, target[0], target[1]]),
            lambda: ((client.latest_ee() - ee0) * np.sign(target - ee0) > 0.03).all()
            and np.linalg.norm(client.latest_ee() - target) < 0.01,
            f"the end effector to move from {ee0} to {target}",
        )  # fmt: skip
        _drive_until(
            client, lambda: client.send_trajectory(names, [target[2], 0.0, target[0], target[1]]),
            lambda: _diagnostic(client, "command_state") == "fresh", "command_state fresh on /diagnostics",
        )  # fmt: skip

        before_bad = client.latest_ee()
        stamp = client.node.get_clock().now().nanoseconds
        bad = [
            lambda: client.send_trajectory(names, [np.nan, 0.0, target[0], target[1]]),
            lambda: client.send_array([0.5, 0.0]),
            lambda: client.send_trajectory(["x", "y", "z", "grip"], [0.5, 0.0, 0.2, 0.0]),
            lambda: client.send_trajectory(names, [target[2], 0.0, target[0], target[1]], stamp_ns=stamp - 10**8),
        ]
        for send in bad:
            client.send_trajectory(names, [target[2], 0.0, target[0], target[1]])  # keeps the last valid action fresh
            send()
            client.spin_for(0.05)
        client.spin_until(lambda: _diagnostic(client, "commands_rejected") == "4", TIMEOUT, "4 rejections reported")
        rejected = {kv.key: kv.value for kv in client.diagnostics[-1].values}
        assert [rejected[f"rejected_{k}"] for k in ("not_finite", "wrong_length", "wrong_names", "out_of_order")] == [
            "1"
        ] * 4
        assert any(s.level == b"\x01" and "rejected command" in s.message for s in client.diagnostics)
        # The last valid action stayed in force: the arm stays near the target it was holding.
        assert np.linalg.norm(client.latest_ee() - before_bad) < 0.02

        # No commands: stale after 0.3 s, then the arm holds where it is and the robot keeps publishing.
        client.spin_until(lambda: _diagnostic(client, "command_state") == "stale", TIMEOUT, "a stale command")
        client.spin_until(lambda: "holding position" in client.diagnostics[-1].message, TIMEOUT, "holding position")
        count = len(client.joint_states)
        client.spin_until(lambda: len(client.joint_states) >= count + 5, TIMEOUT, "joint states while holding")
        held = client.latest_ee()
        client.spin_until(lambda: len(client.joint_states) >= count + 15, TIMEOUT, "ten more joint states")
        assert np.linalg.norm(client.latest_ee() - held) < 0.005

        second = held + np.array([0.0, 0.08, 0.0])
        _drive_until(
            client, lambda: client.send_array([*second, 0.0]),
            lambda: client.latest_ee()[1] - held[1] > 0.03 and client.diagnostics[-1].message == "following commands",
            "the arm to follow commands again after going stale, and recovery on /diagnostics",
        )  # fmt: skip
    finally:
        code, out, err = stop_command(robot, tmp_path, "robot")
    assert code == STOPPED_BY_SIGINT, err
    summary = last_json(out)
    assert summary["commands_rejected"] == {"not_finite": 1, "wrong_length": 1, "wrong_names": 1, "out_of_order": 1}
    for kind in ("joint_trajectory: not_finite", "array: wrong_length", "joint_trajectory: wrong_names",
                 "joint_trajectory: out_of_order"):  # fmt: skip
        assert f"rejected command on /command/{kind}" in err
    assert "holding position" in err and "commands resumed" in err


def test_a_subscriber_whose_qos_never_connects_is_named_on_the_robots_diagnostics(client, tmp_path):
    """A node subscribing to the joint states with transient-local durability (the robot publishes volatile):
    the robot's /diagnostics rises to WARN naming the topic, the node and the policy; gone, it clears."""
    from diagnostic_msgs.msg import DiagnosticStatus
    from rclpy.qos import DurabilityPolicy, QoSProfile
    from sensor_msgs.msg import JointState

    robot = start_command(["sim-robot", "--env.task=reach", "--env.max_episode_steps=1000", "--diagnostics_period_s=0.2"],
                          DOMAIN_ID, tmp_path, "robot")  # fmt: skip
    try:
        client.wait_for_robot()
        subscription = client.node.create_subscription(
            JointState,
            "/joint_states",
            lambda m: None,
            QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL),
        )
        expected = ("/joint_states: /test_client requests durability transient_local, the robot offers volatile (make "
                    "/test_client request volatile)")  # fmt: skip
        client.spin_until(lambda: _diagnostic(client, "qos_mismatches") == expected, TIMEOUT, "the QoS mismatch")
        assert client.diagnostics[-1].level == DiagnosticStatus.WARN and expected in client.diagnostics[-1].message
        client.node.destroy_subscription(subscription)
        client.spin_until(lambda: _diagnostic(client, "qos_mismatches") == "", TIMEOUT, "the mismatch cleared")
    finally:
        code, _out, err = stop_command(robot, tmp_path, "robot")
    assert code == STOPPED_BY_SIGINT and "incompatible QoS, these endpoints never connect: /joint_states" in err


@pytest.mark.slow
def test_real_time_mode_keeps_pace(client, tmp_path):
    """Without commands, for 100 control steps (5 s at 20 Hz): simulated time keeps up with the wall clock."""
    robot = start_command(["sim-robot", "--env.task=reach", "--env.max_episode_steps=1000"], DOMAIN_ID, tmp_path,
                          "robot")  # fmt: skip
    try:
        client.wait_for_robot()
        count = len(client.joint_states)
        client.spin_until(lambda: len(client.joint_states) >= count + 100, 60, "100 control steps")
    finally:
        code, out, err = stop_command(robot, tmp_path, "robot")
    assert code == STOPPED_BY_SIGINT, err
    summary = last_json(out)
    assert summary["steps"] >= 100
    assert 0.9 <= summary["realtime_factor"] <= 1.05, summary


def test_trajectory_input_follows_starves_and_rejects(client, tmp_path):
    """--input=trajectory: the arm follows a joint trajectory (names matched in any order) and the fingers theirs,
    holds the last point once it runs out (the ticks after are starved), and a trajectory that names other joints
    or ends in the past is rejected, counted and leaves the arm where it is; the summary reports the tracking error."""
    from sim.arm import ARM_JOINTS, FINGER_JOINTS

    robot = start_command(["sim-robot", "--env.task=lift", "--env.max_episode_steps=1000", "--input=trajectory",
                           "--diagnostics_period_s=0.2"], DOMAIN_ID, tmp_path, "robot")  # fmt: skip
    try:
        client.wait_for_robot(trajectories=True)
        client.spin_until(lambda: client.diagnostics, TIMEOUT, "the first diagnostics")
        assert client.diagnostics[-1].message == "no trajectory yet; holding position"
        start = np.array(client.joint_states[-1].position[:7])
        goal = start + np.array([0.15, -0.1, 0.0, 0.0, 0.0, 0.0, 0.1])
        points = start + np.linspace(0.1, 1.0, 10)[:, None] * (goal - start)  # 10 points 0.1 s apart: 1 s
        client.send_joint_trajectory(client.arm_pub, ARM_JOINTS[::-1], points[:, ::-1], 0.1)  # reversed, by name
        client.send_joint_trajectory(client.gripper_pub, FINGER_JOINTS, [[0.01, 0.01]], 0.5)

        def arm() -> np.ndarray:
            return np.array(client.joint_states[-1].position[:7])

        client.spin_until(lambda: np.abs(arm() - goal).max() < 0.01, TIMEOUT, f"the arm at {goal}")
        assert client.joint_states[-1].position[7] == pytest.approx(0.02, abs=0.003)  # both fingers at 0.01 m
        client.spin_until(lambda: client.diagnostics[-1].message == "the trajectory ran out; holding its last point",
                          TIMEOUT, "the trajectory to run out")  # fmt: skip
        client.send_joint_trajectory(client.arm_pub, [*ARM_JOINTS[:6], "elbow"], points, 0.1)
        # Stamped when the episode began (its first status), its points 0.1 and 0.2 s later: over a second ago.
        began = min(s["stamp_ns"] for s in client.statuses if s["episode"] == 0)
        client.send_joint_trajectory(client.arm_pub, ARM_JOINTS, points[:2], 0.1, stamp_ns=began)
        client.spin_until(lambda: _diagnostic(client, "commands_rejected") == "2", TIMEOUT, "2 rejections reported")
        count = len(client.joint_states)
        client.spin_until(lambda: len(client.joint_states) >= count + 10, TIMEOUT, "ten more joint states")
        assert np.abs(arm() - goal).max() < 0.01  # still holding the last point
        client.spin_until(lambda: int(_diagnostic(client, "starved_ticks")) >= 10, TIMEOUT, "starved ticks reported")
    finally:
        code, out, err = stop_command(robot, tmp_path, "robot")
    assert code == STOPPED_BY_SIGINT, err
    summary = last_json(out)
    assert summary["input"] == "trajectory" and summary["commands_received"] == 4
    assert summary["commands_rejected"] == {"wrong_names": 1, "stale": 1}
    # The servos (P gains of 2000-4500 N m/rad against gravity) track within hundredths of a radian.
    assert 0 < summary["tracking_error_rms_rad"] < 0.03 and summary["tracking_error_max_rad"] < 0.1, summary
    assert summary["starved_ticks"] >= 10
    assert "rejected command on /arm_controller/joint_trajectory: wrong_names" in err
