"""The one codec between ROS 2 messages and numpy, both directions, for every command that touches ROS.

- images: sensor_msgs/Image (rgb8, bgr8, rgba8, bgra8, mono8) and CompressedImage (png, jpeg)
  <-> (H, W, 3) uint8 RGB, decoded and encoded with OpenCV (the ``ros`` extra's image library);
- sensor_msgs/JointState <-> a vector in a given name order;
- trajectory_msgs/JointTrajectory and std_msgs/Float64MultiArray <-> an action vector (one point per
  control tick), and JointTrajectory <-> a whole trajectory (its start stamp, the points' times and
  positions: what a joint trajectory controller executes);
- builtin_interfaces/Time <-> seconds or nanoseconds.

`vla-rl serve` decodes its camera and joint-state inputs here and `vla-rl convert` the recorded
ones, so a policy sees at deployment exactly the pixels it was trained on. Decoders read message
fields only (duck typing: rclpy messages and the ones `mcap_ros2` decodes alike) and reject bad
input with ``InputRejected``; encoders import the message classes when called, so importing this
module needs no ROS installation.
"""

from __future__ import annotations

import array

import numpy as np

# Raw encodings: channels per pixel, and where R, G, B sit among them (mono8: the one channel thrice).
RAW_ENCODINGS = {"rgb8": (3, [0, 1, 2]), "bgr8": (3, [2, 1, 0]), "rgba8": (4, [0, 1, 2]),
                 "bgra8": (4, [2, 1, 0]), "mono8": (1, [0, 0, 0])}  # fmt: skip
COMPRESSED_FORMATS = {"png": ".png", "jpeg": ".jpg"}


class InputRejected(ValueError):
    """A message that fails a shape, encoding, finiteness or bounds check; ``kind`` names the cause."""

    def __init__(self, message: str, kind: str = "malformed"):
        super().__init__(message)
        self.kind = kind


# -- stamps --------------------------------------------------------------------------------------


def stamp_seconds(stamp) -> float:
    """builtin_interfaces/Time -> seconds."""
    return stamp.sec + stamp.nanosec * 1e-9


def stamp_ns(stamp) -> int:
    """builtin_interfaces/Time -> nanoseconds."""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def time_msg(ns: int):
    """Nanoseconds -> builtin_interfaces/Time."""
    from builtin_interfaces.msg import Time

    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def duration_msg(seconds: float):
    """Seconds -> builtin_interfaces/Duration."""
    from builtin_interfaces.msg import Duration

    nanoseconds = round(seconds * 1e9)  # one rounding, so a fraction just under 1 carries into sec
    return Duration(sec=nanoseconds // 1_000_000_000, nanosec=nanoseconds % 1_000_000_000)


# -- images --------------------------------------------------------------------------------------


def decode_image(msg) -> np.ndarray:
    """sensor_msgs/Image or CompressedImage (it has a ``format`` field) -> (H, W, 3) uint8 RGB."""
    return _decode_compressed(msg) if hasattr(msg, "format") else _decode_raw(msg)


def _decode_raw(msg) -> np.ndarray:
    layout = RAW_ENCODINGS.get(msg.encoding)
    if layout is None:
        raise InputRejected(
            f"image encoding {msg.encoding!r} is not supported; publish one of {sorted(RAW_ENCODINGS)}", "encoding"
        )
    channels, rgb = layout
    h, w, step = msg.height, msg.width, msg.step
    if h < 1 or w < 1 or step < w * channels:
        raise InputRejected(f"image header is inconsistent: {h}x{w} {msg.encoding} with step {step}", "image_header")
    data = np.frombuffer(msg.data, np.uint8)  # array.array or bytes: no copy
    if data.size != h * step:
        raise InputRejected(f"image data has {data.size} bytes, expected height*step = {h * step}", "image_data")
    pixels = data.reshape(h, step)[:, : w * channels].reshape(h, w, channels)
    return np.ascontiguousarray(pixels[:, :, rgb])


def _decode_compressed(msg) -> np.ndarray:
    import cv2

    data = np.frombuffer(msg.data, np.uint8)
    if data.size == 0:
        raise InputRejected(f"compressed image ({msg.format!r}) is empty", "image_data")
    bgr = cv2.imdecode(data, cv2.IMREAD_COLOR)
    if bgr is None:
        raise InputRejected(
            f"compressed image ({msg.format!r}, {data.size} bytes) does not decode as png or jpeg", "image_data"
        )
    return np.ascontiguousarray(bgr[:, :, ::-1])


def image_msg(frame: np.ndarray, stamp, frame_id: str, encoding: str = "rgb8"):
    """(H, W, 3) uint8 RGB -> sensor_msgs/Image in ``encoding`` (one of RAW_ENCODINGS).

    mono8 stores the luma (ITU-R BT.601), so only a grey frame comes back unchanged; alpha is 255.
    """
    import cv2
    from sensor_msgs.msg import Image

    if encoding not in RAW_ENCODINGS:
        raise ValueError(f"image encoding {encoding!r} is not supported; choose one of {sorted(RAW_ENCODINGS)}")
    frame = np.ascontiguousarray(frame, dtype=np.uint8)
    h, w, _ = frame.shape
    channels, rgb = RAW_ENCODINGS[encoding]
    if encoding == "mono8":
        pixels = cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY)
    else:
        pixels = np.full((h, w, channels), 255, np.uint8)
        pixels[:, :, rgb] = frame
    msg = Image(height=h, width=w, encoding=encoding, is_bigendian=0, step=channels * w)
    msg.header.stamp, msg.header.frame_id = stamp, frame_id
    msg.data = array.array("B", pixels.tobytes())
    return msg


def compressed_image_msg(frame: np.ndarray, stamp, frame_id: str, format: str = "png", jpeg_quality: int = 95):
    """(H, W, 3) uint8 RGB -> sensor_msgs/CompressedImage, png (lossless) or jpeg."""
    import cv2
    from sensor_msgs.msg import CompressedImage

    if format not in COMPRESSED_FORMATS:
        raise ValueError(f"compressed format {format!r} is not supported; choose one of {sorted(COMPRESSED_FORMATS)}")
    bgr = np.ascontiguousarray(np.asarray(frame, dtype=np.uint8)[:, :, ::-1])
    params = [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality] if format == "jpeg" else []
    ok, encoded = cv2.imencode(COMPRESSED_FORMATS[format], bgr, params)
    if not ok:
        raise ValueError(f"OpenCV could not encode a {frame.shape} frame as {format}")
    msg = CompressedImage(format=format)
    msg.header.stamp, msg.header.frame_id = stamp, frame_id
    msg.data = array.array("B", encoded.tobytes())
    return msg


# -- joint states --------------------------------------------------------------------------------


def joint_state_vector(msg, wanted: list[str]) -> np.ndarray:
    """JointState name/position -> (len(wanted),) float64 in the order of ``wanted``, matched by name."""
    names = list(msg.name)
    positions = np.asarray(msg.position, dtype=np.float64)
    if positions.ndim != 1 or len(names) != len(positions):
        raise InputRejected(f"joint_states has {len(names)} names but {positions.size} positions", "wrong_length")
    index = {n: i for i, n in enumerate(names)}
    missing = [n for n in wanted if n not in index]
    if missing:
        raise InputRejected(f"joint_states lacks {missing} (has {names})", "missing_names")
    vector = positions[[index[n] for n in wanted]]
    if not np.isfinite(vector).all():
        bad = [n for n, v in zip(wanted, vector) if not np.isfinite(v)]
        raise InputRejected(f"joint_states has non-finite values for {bad}", "not_finite")
    return vector


def joint_state_msg(names: list[str], position: np.ndarray, velocity: np.ndarray | None, stamp):
    """(S,) positions (and velocities) named ``names`` -> sensor_msgs/JointState."""
    from sensor_msgs.msg import JointState

    msg = JointState(name=list(names))
    msg.header.stamp = stamp
    msg.position = _float_array(position)
    if velocity is not None:
        msg.velocity = _float_array(velocity)
    return msg


def _float_array(values: np.ndarray) -> array.array:
    """float64 ``array.array`` for a ``float64[]`` field: the fast path of the generated setters."""
    out = array.array("d")
    out.frombytes(np.ascontiguousarray(values, dtype=np.float64).tobytes())
    return out


# -- commands ------------------------------------------------------------------------------------


def command_action(msg, action_names: list[str]) -> np.ndarray:
    """(A,) float64 action of a JointTrajectory (it has ``joint_names``) or a Float64MultiArray."""
    return trajectory_action(msg, action_names) if hasattr(msg, "joint_names") else array_action(msg, action_names)


def trajectory_action(msg, action_names: list[str]) -> np.ndarray:
    """JointTrajectory -> (A,) float64: its first point's positions, matched to ``action_names`` by name."""
    if not msg.points:
        raise InputRejected("the trajectory has no points", "no_points")
    joint_names, positions = list(msg.joint_names), list(msg.points[0].positions)
    if len(positions) != len(joint_names):
        raise InputRejected(f"{len(positions)} positions for {len(joint_names)} joint names", "wrong_length")
    if sorted(joint_names) != sorted(action_names):
        raise InputRejected(f"joint_names {joint_names} must be {list(action_names)} in any order", "wrong_names")
    by_name = dict(zip(joint_names, positions))
    return _finite(np.array([by_name[n] for n in action_names], dtype=np.float64))


def array_action(msg, action_names: list[str]) -> np.ndarray:
    """Float64MultiArray -> (A,) float64; its data are in ``action_names`` order."""
    values = list(msg.data)
    if len(values) != len(action_names):
        raise InputRejected(f"{len(values)} values, expected {len(action_names)} {list(action_names)}", "wrong_length")
    return _finite(np.array(values, dtype=np.float64))


def _finite(action: np.ndarray) -> np.ndarray:
    if not np.isfinite(action).all():
        raise InputRejected(f"non-finite values {action.tolist()}", "not_finite")
    return action


def trajectory_msg(command: np.ndarray, action_names: list[str], stamp, time_from_start):
    """(A,) command -> JointTrajectory: ``joint_names = action_names``, one point reached at ``time_from_start``."""
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    msg = JointTrajectory(joint_names=list(action_names))
    msg.header.stamp = stamp
    msg.points = [JointTrajectoryPoint(positions=_float_array(command), time_from_start=time_from_start)]
    return msg


# -- whole trajectories --------------------------------------------------------------------------


def trajectory_points_msg(joint_names: list[str], positions: np.ndarray, stamp, period_s: float,
                          first_s: float | None = None):  # fmt: skip
    """(P, J) joint positions -> JointTrajectory over ``joint_names``: point k reached at ``stamp`` + ``first_s``
    + k ``period_s`` (``first_s`` one period by default: ``time_from_start`` = (k + 1) periods; a stamp of 0
    means "when it arrives")."""
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    positions = np.asarray(positions, dtype=np.float64)
    first_s = period_s if first_s is None else first_s
    msg = JointTrajectory(joint_names=list(joint_names))
    msg.header.stamp = stamp
    msg.points = [JointTrajectoryPoint(positions=_float_array(row), time_from_start=duration_msg(first_s + k * period_s))
                  for k, row in enumerate(positions)]  # fmt: skip
    return msg


def trajectory_points_cdr(joint_names: list[str], positions: np.ndarray, stamp_ns: int, period_s: float,
                          first_s: float | None = None) -> bytes:  # fmt: skip
    """The message of `trajectory_points_msg` (stamp ``stamp_ns``), serialized as a publisher sends it
    (little-endian CDR) and built with numpy: a subscriber decodes exactly that JointTrajectory, and
    ``rclpy.serialization.serialize_message`` gives the same bytes but for its padding (zeros here) and a few
    spare bytes it leaves at the end. Why: a long chunk (the bench's 1,240 points) costs about 8 ms as message objects and 2 ms to
    serialize, on the control core between the tick that merged the chunk and the time of its first point two
    periods later; these bytes take well under a millisecond. A publisher takes them as they are
    (``publisher.publish(data)``), and every subscriber receives the same JointTrajectory.

    Layout (XCDR1): a 4-byte encapsulation header; then, aligned to their size from the end of the header,
    the stamp (int32 sec, uint32 nanosec), frame_id and joint_names (uint32 length with the terminating NUL,
    the bytes, the NUL), the point count, and per point: positions (uint32 count, the float64 values), three
    empty sequences (velocities, accelerations, effort: a uint32 0 each) and time_from_start (int32 sec,
    uint32 nanosec). A point ends 4 bytes past a multiple of 8 (its doubles end on one, 20 bytes follow), so
    every point after the first starts there and needs no padding: they are one packed record array."""
    positions = np.asarray(positions, dtype=np.float64)
    count, joints = positions.shape
    first_s = period_s if first_s is None else first_s
    nanoseconds = np.rint((first_s + np.arange(count) * period_s) * 1e9).astype(np.int64)  # as duration_msg
    body = bytearray()

    def align(size: int) -> None:
        body.extend(b"\0" * (-len(body) % size))

    def uint32(value: int) -> None:
        align(4)
        body.extend(np.uint32(value).tobytes())

    def string(text: str) -> None:
        data = text.encode() + b"\0"
        uint32(len(data))
        body.extend(data)

    align(4)
    body.extend(np.array([stamp_ns // 1_000_000_000], "<i4").tobytes() + np.uint32(stamp_ns % 1_000_000_000).tobytes())
    string("")  # frame_id
    uint32(len(joint_names))
    for name in joint_names:
        string(name)
    uint32(count)
    if count:
        uint32(joints)  # point 0, by the general rule (it may need padding before its doubles)
        align(8)
        body.extend(positions[0].astype("<f8").tobytes())
        for _ in range(3):
            uint32(0)
        body.extend(np.array([nanoseconds[0] // 1_000_000_000], "<i4").tobytes())
        body.extend(np.uint32(nanoseconds[0] % 1_000_000_000).tobytes())
        assert len(body) % 8 == 4  # the invariant of the docstring: the rest are packed records
        record = np.dtype([("count", "<u4"), ("positions", "<f8", (joints,)), ("empty", "<u4", (3,)),
                           ("sec", "<i4"), ("nanosec", "<u4")])  # fmt: skip
        rest = np.zeros(count - 1, dtype=record)
        rest["count"], rest["positions"] = joints, positions[1:]
        rest["sec"], rest["nanosec"] = nanoseconds[1:] // 1_000_000_000, nanoseconds[1:] % 1_000_000_000
        body.extend(rest.tobytes())
    return b"\x00\x01\x00\x00" + bytes(body)  # CDR, little-endian


def trajectory_points(msg, joint_names: list[str]) -> tuple[int, np.ndarray, np.ndarray]:
    """JointTrajectory -> (start stamp ns (0: "when it arrives"), each point's time_from_start ns (P,) int64,
    positions (P, J) float64 in the order of ``joint_names``, matched by name).

    Rejected (``InputRejected``, as a joint trajectory controller rejects them): no points, names other than
    ``joint_names`` (in any order), a point whose positions do not match the names, non-finite positions, and
    times that do not strictly increase or are negative.
    """
    if not msg.points:
        raise InputRejected("the trajectory has no points", "no_points")
    names = list(msg.joint_names)
    if sorted(names) != sorted(joint_names) or len(set(names)) != len(names):
        raise InputRejected(f"joint_names {names} must be {list(joint_names)} in any order", "wrong_names")
    order = [names.index(n) for n in joint_names]
    rows, times = [], []
    for k, point in enumerate(msg.points):
        values = list(point.positions)
        if len(values) != len(names):
            raise InputRejected(f"point {k} has {len(values)} positions for {len(names)} joint names", "wrong_length")
        rows.append([values[i] for i in order])
        times.append(stamp_ns(point.time_from_start))
    positions, times = np.array(rows, dtype=np.float64), np.array(times, dtype=np.int64)
    if not np.isfinite(positions).all():
        raise InputRejected("the trajectory has non-finite positions", "not_finite")
    if times[0] < 0 or (np.diff(times) <= 0).any():
        raise InputRejected(f"time_from_start must be >= 0 and strictly increase, got {(times / 1e9).tolist()} s",
                            "not_increasing")  # fmt: skip
    return stamp_ns(msg.header.stamp), times, positions
