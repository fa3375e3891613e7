"""`vla-rl record-ros` -> MCAP -> `vla-rl convert` -> LeRobotDataset, against what the sim robot published."""

import signal
import time

import numpy as np
import pytest
import torch
from ros_helpers import STOPPED_BY_SIGINT, RobotClient, last_json, start_command, stop_command

DOMAIN_ID = 62
EPISODE_STEPS = 6


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """A lock-step session recorded to MCAP: 16 steps in episodes of 6, the 8th commanded with NaN.

    Returns the MCAP path, the recorder's summary, and what the test client saw and sent.
    """
    logs = tmp_path_factory.mktemp("ros_record")
    mcap = logs / "session.mcap"
    recorder = start_command(
        ["record-ros", f"--output={mcap}", "--discovery_period_s=0.2"], DOMAIN_ID, logs, "recorder"
    )
    robot = start_command(["sim-robot", "--env.task=reach", f"--env.max_episode_steps={EPISODE_STEPS}", "--sync=true",
                           "--compressed_images=true", "--seed=5"], DOMAIN_ID, logs, "robot")  # fmt: skip
    client = RobotClient(DOMAIN_ID, commands=True)
    sent, observed = [], []  # actions (4,); (state (11,), image (64, 64, 3)) each command was chosen from
    try:
        client.wait_for_robot()
        # The recorder is subscribed to the robot and to both command topics once each has two subscribers.
        graph = client.node
        client.spin_until(lambda: all(graph.count_subscribers(t) >= 2 for t in
                                      ("/joint_states", "/camera/front/image_raw", "/command/joint_trajectory",
                                       "/command/array", "/sim_robot/episode")), 30, "the recorder's subscriptions")  # fmt: skip
        client.spin_for(1.0)  # the lock-step robot republishes its waiting observation meanwhile
        rng = np.random.default_rng(0)
        for tick in range(1, 17):
            stamp = client.statuses[-1]["stamp_ns"]
            state = client.spin_until(lambda stamp=stamp: client.state_at(stamp), 5, "the current joint state")
            image = client.spin_until(lambda stamp=stamp: client.images.get(stamp), 5, "the current image")
            if tick == 8:
                client.send_array([np.nan, 0.0, 0.2, 0.0])  # rejected by the robot, dropped by convert
            else:
                action = np.concatenate([state[8:11] + rng.uniform(-0.02, 0.02, 3), [float(tick % 2)]])
                if tick % 3:
                    client.send_trajectory(["ee_x", "ee_y", "ee_z", "grip"], action)
                else:
                    client.send_array(action)
                sent.append(action)
                observed.append((state, np.frombuffer(bytes(image.data), np.uint8).reshape(64, 64, 3).copy()))
            client.spin_until(lambda tick=tick: _observed_tick(client, tick), 10, f"the observation after tick {tick}")
        instruction = client.instructions[-1]
    finally:
        client.close()
        rec = stop_command(recorder, logs, "recorder", sig=signal.SIGTERM)  # as a scheduler stops a job
        bot = stop_command(robot, logs, "robot")
    # Each printed its summary and says which signal stopped it; the MCAP file is complete (tests below).
    assert (rec[0], bot[0]) == (128 + signal.SIGTERM, STOPPED_BY_SIGINT), rec[2] + bot[2]
    return mcap, last_json(rec[1]), np.array(sent), observed, instruction


def _observed_tick(client, tick: int) -> bool:
    """Whether the robot's latest status is of control step ``tick`` and its joint state has arrived."""
    status = client.statuses[-1]
    return status["tick"] == tick and client.state_at(status["stamp_ns"]) is not None


def test_recording_is_a_complete_mcap_with_ros2_schemas(recording):
    from mcap.reader import make_reader

    mcap, summary, _, _, _ = recording
    assert mcap.is_file() and not (mcap.parent / f".{mcap.name}.tmp").exists()
    topics = summary["topics"]
    assert topics["/command/joint_trajectory"]["type"] == "trajectory_msgs/msg/JointTrajectory"
    assert topics["/command/joint_trajectory"]["messages"] + topics["/command/array"]["messages"] == 16
    assert topics["/instruction"]["messages"] >= 3  # the latched first one and one per later episode
    assert topics["/joint_states"]["messages"] >= 16
    with open(mcap, "rb") as f:
        reader = make_reader(f)
        schemas = {s.name: s for s in reader.get_summary().schemas.values()}
        assert reader.get_header().profile == "ros2"
    image_schema = schemas["sensor_msgs/msg/Image"]
    assert image_schema.encoding == "ros2msg"
    assert "MSG: std_msgs/Header" in image_schema.data.decode()  # nested definitions travel with the file
    assert "MSG: trajectory_msgs/JointTrajectoryPoint" in schemas["trajectory_msgs/msg/JointTrajectory"].data.decode()


def test_convert_gives_a_lerobot_dataset_of_what_was_published(recording, tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from sim.arm import ACTION_NAMES, STATE_NAMES
    from vla_rl.cli import main

    mcap, _, sent, observed, instruction = recording
    out = tmp_path / "dataset"
    assert main(["convert", f"--input={mcap}", f"--output_dir={out}"]) == 0
    assert not (tmp_path / ".dataset.tmp").exists()
    ds = LeRobotDataset("local/ros", root=out, video_backend="pyav")
    # 16 lock steps in episodes of 6: 6 + 6 + 4 commands; the NaN one (step 8) is dropped.
    assert len(ds) == len(sent) == 15
    assert ds.num_episodes == 3
    assert [int(ds.meta.episodes[i]["length"]) for i in range(3)] == [6, 5, 4]
    assert ds.fps == 20
    assert ds.meta.features["observation.state"]["names"] == STATE_NAMES
    assert ds.meta.features["action"]["names"] == ACTION_NAMES
    assert tuple(ds.meta.features["observation.images.front"]["shape"]) == (64, 64, 3)
    summary = (out / "meta" / "vla_rl_convert.json").read_text()
    assert '"invalid_command": 1' in summary and '"episodes_from": "status"' in summary
    for i in range(len(ds)):
        frame = ds[i]
        state, image = observed[i]
        torch.testing.assert_close(frame["action"], torch.from_numpy(sent[i]).float())
        torch.testing.assert_close(frame["observation.state"], torch.from_numpy(state).float())
        torch.testing.assert_close(
            frame["observation.images.front"], torch.from_numpy(image).permute(2, 0, 1).float() / 255
        )
        assert frame["task"] == instruction == "move the gripper to the green ball"


def test_convert_without_episode_status_splits_at_pauses_and_names_missing_topics(recording, tmp_path):
    from robot_bridge.convert import ConvertConfig, convert

    mcap = recording[0]
    summary = convert(ConvertConfig(input=str(mcap), output_dir=str(tmp_path / "ds"), episode_topic="/absent",
                                    cameras=["front"], episode_gap_s=60.0))  # fmt: skip
    assert (summary["episodes"], summary["frames"], summary["episodes_from"]) == (1, 15, "gaps")
    with pytest.raises(ValueError, match="lacks \\['wrist'\\]"):
        convert(ConvertConfig(input=str(mcap), output_dir=str(tmp_path / "ds2"), cameras=["wrist"]))
    with pytest.raises(FileExistsError, match="--overwrite=true"):
        convert(ConvertConfig(input=str(mcap), output_dir=str(tmp_path / "ds")))


def test_the_trajectory_topics_are_recorded_when_trajectories_are_sent(tmp_path):
    """With its default topics, record-ros records the arm's and the gripper's trajectory topics (serve's
    --output=trajectory, what sim-robot's trajectory mode takes) once a node publishes on them: three
    trajectories on each come back from the MCAP file with the joint names and positions they were sent with."""
    import rclpy
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    domain, mcap = DOMAIN_ID + 20, tmp_path / "trajectories.mcap"
    topics = {"/arm_controller/joint_trajectory": ["joint1", "joint2"], "/gripper_controller/joint_trajectory":
              ["finger_joint1"]}  # fmt: skip
    recorder = start_command(["record-ros", f"--output={mcap}", "--discovery_period_s=0.2"], domain, tmp_path,
                             "recorder")  # fmt: skip
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=domain)
    node = rclpy.create_node("trajectory_sender", context=context)
    try:
        publishers = {topic: node.create_publisher(JointTrajectory, topic, 10) for topic in topics}
        deadline = time.monotonic() + 120  # the recorder imports and joins the graph first
        while not all(p.get_subscription_count() >= 1 for p in publishers.values()):
            assert time.monotonic() < deadline, "the recorder never subscribed to the trajectory topics"
            time.sleep(0.1)
        for k in range(3):
            for topic, names in topics.items():
                point = JointTrajectoryPoint(positions=[0.1 * k + j for j in range(len(names))])
                publishers[topic].publish(JointTrajectory(joint_names=names, points=[point]))
        time.sleep(1.0)
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)
        code, out, err = stop_command(recorder, tmp_path, "recorder", sig=signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    summary = last_json(out)
    assert {t: summary["topics"][t]["messages"] for t in topics} == {t: 3 for t in topics}
    sent = {(t, k): [0.1 * k + j for j in range(len(names))] for t, names in topics.items() for k in range(3)}
    received = {}
    with open(mcap, "rb") as f:
        for _, channel, _, msg in make_reader(f, decoder_factories=[DecoderFactory()]).iter_decoded_messages(
            topics=list(topics)
        ):
            assert list(msg.joint_names) == topics[channel.topic]
            k = round(msg.points[0].positions[0] / 0.1)
            received[channel.topic, k] = list(msg.points[0].positions)
    assert received.keys() == sent.keys()
    assert all(np.allclose(received[key], sent[key]) for key in sent)
