"""ROS 2 message helpers shared by `sim-robot`, `record-ros` and `convert`.

Images travel as numpy arrays (``cv_bridge`` is not on pip), message classes are looked up by
their graph type name (``sensor_msgs/msg/Image``), and the ``.msg`` definitions MCAP stores as
schemas are read from the message packages' ``share`` folders. The ROS message packages are
imported inside the functions, so importing this module needs no ROS installation.
"""

from __future__ import annotations

import array
import importlib
import io
import os
import re
import sys
from pathlib import Path

import numpy as np

# A ROS type named inside a field type: "std_msgs/Header", "sequence<trajectory_msgs/JointTrajectoryPoint>".
_NESTED_TYPE = re.compile(r"([A-Za-z0-9_]+)/([A-Za-z0-9_]+)")
_MSG_SEPARATOR = "=" * 80


def message_class(type_name: str):
    """The rclpy message class of a type name such as ``sensor_msgs/msg/Image``."""
    package, kind, name = type_name.split("/")
    try:
        return getattr(importlib.import_module(f"{package}.{kind}"), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"message type {type_name!r} is not installed; install its ROS 2 wheel (ros-{package.replace('_', '-')})"
        ) from err


def _msg_file(package: str, name: str) -> Path:
    """The ``share/<package>/msg/<name>.msg`` file, searched in AMENT_PREFIX_PATH then the Python prefix
    (where the ROS 2 wheels put it)."""
    prefixes = [p for p in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p] + [sys.prefix]
    for prefix in prefixes:
        path = Path(prefix) / "share" / package / "msg" / f"{name}.msg"
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"no definition {package}/msg/{name}.msg under {prefixes}; install the ROS 2 wheel ros-{package.replace('_', '-')}"
    )


def message_definition(type_name: str) -> str:
    """The ``ros2msg`` schema text of a type: its ``.msg`` file, then each nested type's once.

    This is the concatenated form rosbag2 writes into MCAP (dependencies after a line of ``=``
    and ``MSG: package/Type``), so any MCAP reader can decode the recording on its own.
    """
    package, _, name = type_name.split("/")
    parts, seen, queue = [_msg_file(package, name).read_text()], {(package, name)}, [type_name]
    while queue:
        cls = message_class(queue.pop(0))
        for field_type in cls.get_fields_and_field_types().values():
            for dep_pkg, dep_name in _NESTED_TYPE.findall(field_type):
                if (dep_pkg, dep_name) not in seen:
                    seen.add((dep_pkg, dep_name))
                    queue.append(f"{dep_pkg}/msg/{dep_name}")
                    text = _msg_file(dep_pkg, dep_name).read_text()
                    parts.append(f"{_MSG_SEPARATOR}\nMSG: {dep_pkg}/{dep_name}\n{text}")
    return "\n".join(parts)


def float_array(values: np.ndarray) -> array.array:
    """float64 ``array.array`` for a ``float64[]`` field: the fast path of the generated setters."""
    out = array.array("d")
    out.frombytes(np.ascontiguousarray(values, dtype=np.float64).tobytes())
    return out


def image_msg(frame: np.ndarray, stamp, frame_id: str):
    """sensor_msgs/Image (rgb8) of an (H, W, 3) uint8 frame."""
    from sensor_msgs.msg import Image

    h, w, _ = frame.shape
    msg = Image(height=h, width=w, encoding="rgb8", is_bigendian=0, step=3 * w)
    msg.header.stamp, msg.header.frame_id = stamp, frame_id
    msg.data = array.array("B", np.ascontiguousarray(frame, dtype=np.uint8).tobytes())
    return msg


def compressed_image_msg(frame: np.ndarray, stamp, frame_id: str):
    """sensor_msgs/CompressedImage (png) of an (H, W, 3) uint8 frame."""
    from PIL import Image as PILImage
    from sensor_msgs.msg import CompressedImage

    buf = io.BytesIO()
    PILImage.fromarray(frame).save(buf, format="png")
    msg = CompressedImage(format="png")
    msg.header.stamp, msg.header.frame_id = stamp, frame_id
    msg.data = array.array("B", buf.getvalue())
    return msg


def image_array(msg) -> np.ndarray:
    """(H, W, 3) uint8 RGB of an Image (rgb8, bgr8) or CompressedImage (png, jpeg) message.

    Works on rclpy messages and on the ones `mcap_ros2` decodes (same field names).
    """
    data = bytes(msg.data)
    if hasattr(msg, "format"):  # CompressedImage
        from PIL import Image as PILImage

        return np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB"))
    if msg.encoding not in ("rgb8", "bgr8"):
        raise ValueError(f"image encoding {msg.encoding!r} is not supported; publish rgb8 or bgr8")
    rows = np.frombuffer(data, dtype=np.uint8).reshape(msg.height, msg.step)
    frame = rows[:, : 3 * msg.width].reshape(msg.height, msg.width, 3)
    return np.ascontiguousarray(frame[..., ::-1] if msg.encoding == "bgr8" else frame)


def stamp_ns(stamp) -> int:
    """Nanoseconds of a builtin_interfaces/Time."""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)
