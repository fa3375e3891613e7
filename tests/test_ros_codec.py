"""The one ROS codec (both directions) and the one topic table (the package dependency rule: test_layout.py).

Round trips are checked against values fixed independently of the codec: byte layouts written out
by hand, and images compressed by PIL, another encoder than the codec's OpenCV.
"""

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from extras import require

require("sensor_msgs.msg", "ros")

from builtin_interfaces.msg import Time
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory

from robot_bridge import codec, topics
from robot_bridge.codec import InputRejected
from robot_bridge.config import CameraTopic, ServeConfig
from robot_bridge.convert import frame_row
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.inputs import BridgeInputs
from robot_bridge.log_limit import LogLimiter

ROOT = Path(__file__).resolve().parents[1]
STAMP = Time(sec=12, nanosec=500_000_000)


def _frame(h=24, w=32, seed=0) -> np.ndarray:
    """(h, w, 3) uint8 RGB noise: every channel of every pixel differs, so a swapped channel shows."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _smooth_frame(h=32, w=48) -> np.ndarray:
    """Gradients, which JPEG keeps within a few levels (noise would not survive it)."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x + y) * 255 // (w + h - 2)], axis=2).astype(np.uint8)


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8"])
def test_raw_encodings_round_trip_exactly_with_the_standard_byte_layout(encoding):
    frame = _frame()
    msg = codec.image_msg(frame, STAMP, "front", encoding)
    assert (msg.height, msg.width, msg.encoding, msg.header.frame_id) == (24, 32, encoding, "front")
    channels = len(encoding) - 1  # rgb8 -> 3, rgba8 -> 4
    assert msg.step == 32 * channels and len(msg.data) == 24 * 32 * channels
    # The first pixel's bytes, in the order the encoding's name spells.
    r, g, b = frame[0, 0].tolist()
    first = {"rgb8": [r, g, b], "bgr8": [b, g, r], "rgba8": [r, g, b, 255], "bgra8": [b, g, r, 255]}[encoding]
    assert list(msg.data[:channels]) == first
    np.testing.assert_array_equal(codec.decode_image(msg), frame)


def test_mono8_stores_the_grey_level_and_decodes_to_three_equal_channels():
    grey = np.repeat(np.arange(0, 240, 10, dtype=np.uint8).reshape(4, 6, 1), 3, axis=2)
    msg = codec.image_msg(grey, STAMP, "front", "mono8")
    assert msg.step == 6 and list(msg.data[:3]) == [0, 10, 20]
    np.testing.assert_array_equal(codec.decode_image(msg), grey)


def test_png_round_trips_exactly_and_decodes_what_another_encoder_wrote():
    from PIL import Image as PILImage

    frame = _frame()
    msg = codec.compressed_image_msg(frame, STAMP, "front", "png")
    assert msg.format == "png" and bytes(msg.data[:4]) == b"\x89PNG"
    np.testing.assert_array_equal(codec.decode_image(msg), frame)
    buf = io.BytesIO()
    PILImage.fromarray(frame).save(buf, format="png")
    np.testing.assert_array_equal(codec.decode_image(SimpleNamespace(format="png", data=buf.getvalue())), frame)


def test_jpeg_round_trips_within_compression_error():
    frame = _smooth_frame()
    msg = codec.compressed_image_msg(frame, STAMP, "front", "jpeg")
    assert msg.format == "jpeg" and bytes(msg.data[:2]) == b"\xff\xd8"  # the JPEG start-of-image marker
    error = np.abs(codec.decode_image(msg).astype(int) - frame.astype(int))
    # Quality 95 on gradients: a few levels at most, about one on average (chroma subsampling included).
    assert error.max() <= 12 and error.mean() <= 1.5, (error.max(), error.mean())


def test_bad_images_are_rejected_with_their_cause():
    with pytest.raises(InputRejected) as err:
        codec.decode_image(SimpleNamespace(encoding="32FC1", height=1, width=1, step=4, data=bytes(4)))
    assert err.value.kind == "encoding" and "32FC1" in str(err.value)
    with pytest.raises(InputRejected) as err:
        codec.decode_image(SimpleNamespace(format="jpeg", data=b""))
    assert err.value.kind == "image_data"
    with pytest.raises(ValueError, match="not supported"):
        codec.image_msg(_frame(), STAMP, "front", "yuv422")


def test_the_bridge_inputs_and_convert_decode_a_message_identically():
    """Deployment (serve's input path) and training data (convert's rows) go through one decoder:
    the same JPEG and bgr8 messages give the same arrays, bit for bit."""
    frame = _smooth_frame(32, 32)
    config = ServeConfig(image_size=32, cameras=[CameraTopic("front"), CameraTopic("wrist", compressed=True)])
    inputs = BridgeInputs(config, BridgeDiagnostics(), LogLimiter(lambda level, line: None), lambda line: None)
    jpeg = codec.compressed_image_msg(frame, STAMP, "wrist", "jpeg")
    bgr = codec.image_msg(frame, STAMP, "front", "bgr8")
    inputs.on_image(config.cameras[0], bgr)
    inputs.on_image(config.cameras[1], jpeg)
    assert inputs.faults == {}
    row = frame_row({"front": bgr, "wrist": jpeg}, np.zeros(11, np.float32), np.zeros(4, np.float32), "lift")
    np.testing.assert_array_equal(inputs.images["front"], row["observation.images.front"])
    np.testing.assert_array_equal(inputs.images["wrist"], row["observation.images.wrist"])
    np.testing.assert_array_equal(row["observation.images.front"], frame)  # raw: lossless


def test_joint_states_round_trip_by_name():
    names = ["a", "b", "c"]
    msg = codec.joint_state_msg(names, np.array([1.5, -2.0, 0.25]), np.array([0.1, 0.2, 0.3]), STAMP)
    assert list(msg.name) == names and list(msg.velocity) == [0.1, 0.2, 0.3] and msg.header.stamp == STAMP
    assert codec.joint_state_vector(msg, ["c", "a"]).tolist() == [0.25, 1.5]


def test_trajectories_round_trip_by_name_and_bad_commands_are_rejected_by_kind():
    period = codec.duration_msg(0.05)
    assert (period.sec, period.nanosec) == (0, 50_000_000)
    msg = codec.trajectory_msg(np.array([0.5, 0.0, 0.2, 1.0]), ["ee_x", "ee_y", "ee_z", "grip"], STAMP, period)
    assert len(msg.points) == 1 and msg.points[0].time_from_start == period and msg.header.stamp == STAMP
    # Matched by name: asked for in another order, the values follow their names.
    assert codec.command_action(msg, ["grip", "ee_z", "ee_x", "ee_y"]).tolist() == [1.0, 0.2, 0.5, 0.0]
    assert codec.command_action(Float64MultiArray(data=[1.0, 2.0]), ["p", "q"]).tolist() == [1.0, 2.0]

    def kind(msg, names):
        with pytest.raises(InputRejected) as err:
            codec.command_action(msg, names)
        return err.value.kind

    names = ["ee_x", "ee_y", "ee_z", "grip"]
    assert kind(JointTrajectory(joint_names=names), names) == "no_points"
    assert kind(msg, ["ee_x", "ee_y", "ee_z", "gripper"]) == "wrong_names"
    nan = codec.trajectory_msg(np.array([np.nan, 0.0, 0.2, 1.0]), names, STAMP, period)
    assert kind(nan, names) == "not_finite"
    assert kind(Float64MultiArray(data=[1.0]), ["p", "q"]) == "wrong_length"


def test_whole_trajectories_carry_their_stamp_and_point_times_and_bad_ones_are_rejected_by_kind():
    positions = np.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    msg = codec.trajectory_points_msg(["j1", "j2"], positions, STAMP, 0.05)
    # Point k is reached (k + 1) periods after the stamp.
    assert [codec.stamp_ns(p.time_from_start) for p in msg.points] == [50_000_000, 100_000_000, 150_000_000]
    assert msg.header.stamp == STAMP and list(msg.joint_names) == ["j1", "j2"]
    start, times, decoded = codec.trajectory_points(msg, ["j2", "j1"])  # by name, in the order asked for
    assert start == 12_500_000_000 and times.tolist() == [50_000_000, 100_000_000, 150_000_000]
    assert decoded.tolist() == [[0.2, 0.1], [0.4, 0.3], [0.6, 0.5]]

    def kind(msg, names=("j1", "j2")):
        with pytest.raises(InputRejected) as err:
            codec.trajectory_points(msg, list(names))
        return err.value.kind

    assert kind(JointTrajectory(joint_names=["j1", "j2"])) == "no_points"
    assert (
        kind(msg, ["j1", "j3"])
        == kind(codec.trajectory_points_msg(["j1", "j1"], positions, STAMP, 0.05))
        == ("wrong_names")
    )
    short = codec.trajectory_points_msg(["j1", "j2"], positions, STAMP, 0.05)
    short.points[1].positions = [0.3]
    assert kind(short) == "wrong_length"
    assert kind(codec.trajectory_points_msg(["j1", "j2"], positions * np.nan, STAMP, 0.05)) == "not_finite"
    backwards = codec.trajectory_points_msg(["j1", "j2"], positions, STAMP, 0.05)
    backwards.points[2].time_from_start = backwards.points[0].time_from_start
    assert kind(backwards) == "not_increasing"


def test_a_serialized_trajectory_is_the_message_a_subscriber_decodes():
    from rclpy.serialization import deserialize_message

    # Worked by hand (little-endian CDR): one joint "a", one point [1.0], stamp 2 s + 3 ns, a period of 10 ms.
    # The body's doubles align to 8 from the end of the 4-byte header, so point 0's count (body offset 32) is
    # followed by 4 padding bytes.
    hand = bytes.fromhex(
        "00010000"
        "02000000"
        "03000000"  # encapsulation; stamp sec, nanosec
        "01000000"
        "00000000"  # frame_id "": length 1 (the NUL), the NUL, 3 padding bytes
        "01000000"
        "02000000"
        "61000000"  # one joint name, "a" + NUL (length 2), 2 padding bytes
        "01000000"
        "01000000"
        "00000000"  # one point; 1 position; padding to 8
        "000000000000f03f"  # 1.0
        "00000000"
        "00000000"
        "00000000"  # no velocities, accelerations, effort
        "00000000"
        "80969800"  # time_from_start 0 s + 10,000,000 ns
    )
    assert codec.trajectory_points_cdr(["a"], np.array([[1.0]]), 2_000_000_003, 0.01) == hand
    rng = np.random.default_rng(3)
    # One and two names put point 0's doubles after padding and without; 1, 2 and 1,240 points; both first times.
    for names in (["a"], ["a", "b"], [f"panda_joint{i}" for i in range(1, 8)]):
        for points in (1, 2, 1240):
            for first_s in (None, 0.0):
                positions = rng.normal(size=(points, len(names)))
                sent = codec.trajectory_points_cdr(names, positions, 1_796_440_069_630_303_791, 0.01, first_s)
                expected = codec.trajectory_points_msg(names, positions, codec.time_msg(1_796_440_069_630_303_791),
                                                       0.01, first_s)  # fmt: skip
                assert deserialize_message(sent, JointTrajectory) == expected


def test_stamps():
    assert codec.stamp_ns(codec.time_msg(12_500_000_001)) == 12_500_000_001
    assert codec.stamp_seconds(STAMP) == 12.5


def test_one_topic_table_for_serve_sim_robot_record_and_convert():
    from robot_bridge.config import TopicsConfig
    from robot_bridge.convert import ConvertConfig
    from robot_bridge.record import DEFAULT_TOPICS

    serve = TopicsConfig()
    convert = ConvertConfig()
    assert serve.joint_states == convert.joint_states_topic == "/joint_states"
    assert serve.instruction == convert.instruction_topic == "/instruction"
    assert convert.command_topics == [serve.joint_trajectory, serve.command_array]
    assert CameraTopic().topic == "/camera/front/image_raw"
    # record-ros records by default everything the sim robot and serve exchange.
    assert {serve.joint_states, serve.instruction, serve.joint_trajectory, serve.command_array, serve.diagnostics,
            convert.episode_topic, CameraTopic().topic} <= set(DEFAULT_TOPICS)  # fmt: skip
    assert topics.camera_of("/camera/wrist/image_raw/compressed") == ("wrist", True)
    assert topics.camera_of("/camera/wrist/image_raw") == ("wrist", False)
    assert topics.camera_of("/joint_states") is None and topics.camera_of("/camera/image_raw") is None
    # Every role's type is an installed message class of that name.
    # Trajectory output: joint_trajectory_controller's topic per controller; the description robot_state_publisher's.
    assert (serve.arm_trajectory, serve.gripper_trajectory) == (
        topics.ARM_TRAJECTORY.name,
        topics.GRIPPER_TRAJECTORY.name,
    )
    assert topics.ARM_TRAJECTORY.name == "/arm_controller/joint_trajectory" and serve.robot_description == ""
    for topic in (topics.JOINT_STATES, topics.JOINT_TRAJECTORY, topics.DIAGNOSTICS, topics.camera("x", True),
                  topics.ARM_TRAJECTORY, topics.GRIPPER_TRAJECTORY, topics.ROBOT_DESCRIPTION):  # fmt: skip
        assert topic.message_class().__name__ == topic.type.rsplit("/", 1)[1]
