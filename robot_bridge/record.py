"""`vla-rl record-ros`: record ROS 2 topics into an MCAP file, in pure Python (rosbag2 is not on pip).

Each configured topic is subscribed once the graph shows a publisher for it, by the type the graph
reports and with its publishers' durability and reliability (so latched topics such as
``/instruction`` arrive too). Messages are stored as received, CDR bytes untouched, with their
``.msg`` schemas (the ``ros2`` MCAP profile rosbag2 writes), so any MCAP tool can read the file.
Log time is the middleware's reception time, publish time the publisher's source time (both ns).

The file is written beside the target under a temporary name and renamed into place when the
recording stops (Ctrl-C or ``duration_s``), so a crash never leaves a half-written recording
under the target name.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from robot_bridge.topics import (
    ARM_TRAJECTORY,
    COMMAND_ARRAY,
    DIAGNOSTICS,
    EPISODE,
    GRIPPER_TRAJECTORY,
    INSTRUCTION,
    JOINT_STATES,
    JOINT_TRAJECTORY,
    camera,
    message_class,
)

# What the sim robot publishes and what serve (or a test client) commands it with, per tick or, with serve's
# --output=trajectory, as the arm's and the gripper's trajectories (each recorded once a publisher appears).
DEFAULT_TOPICS = [t.name for t in (JOINT_STATES, camera("front"), INSTRUCTION, EPISODE, JOINT_TRAJECTORY,
                                   COMMAND_ARRAY, ARM_TRAJECTORY, GRIPPER_TRAJECTORY, DIAGNOSTICS)]  # fmt: skip
# A ROS type named inside a field type: "std_msgs/Header", "sequence<trajectory_msgs/JointTrajectoryPoint>".
_NESTED_TYPE = re.compile(r"([A-Za-z0-9_]+)/([A-Za-z0-9_]+)")
_MSG_SEPARATOR = "=" * 80


@dataclass
class RecordRosConfig:
    """Record ROS 2 topics into an MCAP file (message schemas included) until Ctrl-C or duration_s."""

    output: str = "outputs/ros/recording.mcap"  # MCAP file to write; must not exist unless overwrite=true
    # topics to record; each is subscribed as soon as the graph shows a publisher for it
    topics: list[str] = field(default_factory=lambda: list(DEFAULT_TOPICS))
    duration_s: float = 0.0  # stop after this many seconds; 0 = until Ctrl-C
    overwrite: bool = False  # replace an existing file at output
    compression: Literal["zstd", "lz4", "none"] = "zstd"  # chunk compression: zstd, lz4 or none
    discovery_period_s: float = 0.5  # seconds between looks at the graph for topics not yet subscribed
    queue_depth: int = 100  # messages kept per topic while the recorder is busy
    node_name: str = "vla_rl_recorder"  # ROS 2 node name


class McapTopicRecorder:
    """Subscribes to topics as they appear and writes their raw messages into an open MCAP writer."""

    def __init__(self, node, writer, topics: list[str], queue_depth: int):
        self.node, self.writer, self.queue_depth = node, writer, queue_depth
        self.pending = list(dict.fromkeys(topics))  # topics not subscribed yet, in the configured order
        self.types: dict[str, str] = {}  # topic -> type name, once subscribed
        self.counts: dict[str, int] = {}
        self._subscriptions = []

    def discover(self) -> None:
        """Subscribe to every pending topic that now has a publisher (a topic with subscribers only waits)."""
        for topic in list(self.pending):
            publishers = self.node.get_publishers_info_by_topic(topic)
            if publishers:
                self._subscribe(topic, publishers)
                self.pending.remove(topic)

    def _subscribe(self, topic: str, publishers: list) -> None:
        from mcap.well_known import MessageEncoding, SchemaEncoding

        types = sorted({p.topic_type for p in publishers})
        type_name = types[0]
        if len(types) > 1:
            self.node.get_logger().warning(f"{topic} is published with several types {types}; recording {type_name}")
        schema = self.writer.register_schema(type_name, SchemaEncoding.ROS2, message_definition(type_name).encode())
        channel = self.writer.register_channel(topic, MessageEncoding.CDR, schema)
        self.types[topic], self.counts[topic] = type_name, 0

        def write(data: bytes, info) -> None:
            received = info["received_timestamp"] or time.time_ns()
            self.writer.add_message(channel, log_time=received, data=data, publish_time=info["source_timestamp"] or received,
                                    sequence=self.counts[topic])  # fmt: skip
            self.counts[topic] += 1

        qos = self._publishers_qos(publishers)
        self._subscriptions.append(self.node.create_subscription(message_class(type_name), topic, write, qos, raw=True))
        self.node.get_logger().info(f"recording {topic} [{type_name}]")

    def _publishers_qos(self, publishers: list):
        """The QoS that receives from every one of a topic's ``publishers``: transient local only when all
        offer it (a latched topic's last message then arrives), reliable only when all are."""
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

        offered = [info.qos_profile for info in publishers]
        latched = all(q.durability == DurabilityPolicy.TRANSIENT_LOCAL for q in offered)
        reliable = all(q.reliability == ReliabilityPolicy.RELIABLE for q in offered)
        return QoSProfile(
            depth=self.queue_depth,
            durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE,
            reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
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


def record_ros(cfg: RecordRosConfig) -> dict:
    """Record ``cfg.topics`` into ``cfg.output`` until Ctrl-C or ``cfg.duration_s``; returns a summary dict."""
    import rclpy
    from mcap.writer import CompressionType, Writer
    from rclpy.executors import ExternalShutdownException
    from rclpy.task import Future

    compressions = {"zstd": CompressionType.ZSTD, "lz4": CompressionType.LZ4, "none": CompressionType.NONE}
    if cfg.compression not in compressions:
        raise ValueError(f"unknown compression {cfg.compression!r}; choose one of: {', '.join(compressions)}")
    if not cfg.topics:
        raise ValueError("no topics to record; pass --topics='[/joint_states,/camera/front/image_raw]'")
    out = Path(cfg.output)
    if out.exists() and not cfg.overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite=true to replace it or choose another --output")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp"

    start = time.time()
    rclpy.init()
    node = rclpy.create_node(cfg.node_name)
    completed = False
    try:
        with open(tmp, "wb") as stream:
            writer = Writer(stream, compression=compressions[cfg.compression])
            writer.start(profile="ros2", library="vla-rl record-ros")
            recorder = McapTopicRecorder(node, writer, cfg.topics, cfg.queue_depth)
            stop = Future()
            recorder.discover()
            node.create_timer(cfg.discovery_period_s, recorder.discover)
            if cfg.duration_s > 0:
                node.create_timer(cfg.duration_s, lambda: stop.set_result(True))
            until = f"for {cfg.duration_s} s" if cfg.duration_s > 0 else "until Ctrl-C"
            node.get_logger().info(f"recording into {out} {until}")
            try:
                rclpy.spin_until_future_complete(node, stop)
            except (KeyboardInterrupt, ExternalShutdownException):
                pass  # Ctrl-C is how a recording normally ends
            writer.finish()
        tmp.replace(out)
        completed = True
    finally:
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
        if not completed:
            tmp.unlink(missing_ok=True)
    topics = {t: {"type": recorder.types[t], "messages": recorder.counts[t]} for t in recorder.types}
    return {
        "output": str(out),
        "topics": topics,
        "never_published": recorder.pending,
        "messages": sum(recorder.counts.values()),
        "bytes": out.stat().st_size,
        "seconds": round(time.time() - start, 1),
        "config": asdict(cfg),
    }
