"""`vla-rl convert`: an MCAP recording of a robot's ROS 2 topics -> a LeRobotDataset (v3).

One frame per command: the command's action, paired with the latest joint state and the latest
image of each camera published at or before it (by the publishers' source times), which is what a
policy saw when it chose that command. Episodes follow the ``/sim_robot/episode`` status of
`vla-rl sim-robot` (each observation stamp belongs to one episode) or, in recordings without it,
pauses between commands. An episode's task is the latest ``/instruction`` before its first frame.

Features are named like our recorded datasets: ``observation.images.<camera>`` (H, W, 3) uint8,
``observation.state`` (S,) with the joint state's names, ``action`` (A,) with ``action_names``,
and ``task``. Messages are decoded by `robot_bridge.codec`, as `vla-rl serve` decodes them, and
commands are rejected as the robot rejects them. The dataset is written into a temporary
directory and renamed into place when complete, as `vla-rl record` does.
"""

from __future__ import annotations

import bisect
import json
import math
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from robot_bridge.codec import InputRejected, command_action, decode_image, joint_state_vector, stamp_ns
from robot_bridge.topics import COMMAND_ARRAY, EPISODE, INSTRUCTION, JOINT_STATES, JOINT_TRAJECTORY, camera_of
from vla_core.robot import SIM_PANDA
from vla_core.types import ACTION, OBS_STATE, image_key


@dataclass
class ConvertConfig:
    """Convert an MCAP recording of a robot's ROS 2 topics into a LeRobotDataset (v3)."""

    input: str = "outputs/ros/recording.mcap"  # MCAP file written by `vla-rl record-ros`
    output_dir: str = "outputs/ros/dataset"  # dataset root; must not exist unless overwrite=true
    repo_id: str = "local/vla_rl_ros"  # dataset name stored in its metadata
    overwrite: bool = False  # replace an existing dataset at output_dir
    fps: int = 20  # control rate the commands were sent at (the sim robot's: 20 Hz)
    robot_type: str = "panda"  # robot type stored in the dataset metadata
    # order of the action vector; trajectory joint_names are matched to it, array values are in it
    action_names: list[str] = field(default_factory=lambda: list(SIM_PANDA.action_names))
    # cameras to convert; empty = every /camera/<name>/image_raw[/compressed] recorded
    cameras: list[str] = field(default_factory=list)
    # sensor_msgs/JointState: observation.state, in the first message's name order
    joint_states_topic: str = JOINT_STATES.name
    # JointTrajectory or Float64MultiArray commands
    command_topics: list[str] = field(default_factory=lambda: [JOINT_TRAJECTORY.name, COMMAND_ARRAY.name])
    episode_topic: str = EPISODE.name  # episode status JSON of `vla-rl sim-robot`; without it, episodes split at pauses
    instruction_topic: str = INSTRUCTION.name  # std_msgs/String task instructions
    task: str = ""  # instruction for episodes the recording has none before
    episode_gap_s: float = 1.0  # without episode status: a pause this long between commands starts a new episode
    max_input_age_s: float = 1.0  # commands whose latest joint state or image is older than this are dropped


@dataclass
class Stream:
    """The messages of one topic in source-time order: times (ns) and decoded messages."""

    times: list[int] = field(default_factory=list)
    messages: list = field(default_factory=list)

    def latest(self, t: int, max_age_ns: int):
        """The last message at or before ``t`` and no older than ``max_age_ns``, or None."""
        i = bisect.bisect_right(self.times, t) - 1
        return self.messages[i] if i >= 0 and t - self.times[i] <= max_age_ns else None


def read_streams(path: Path) -> dict[str, Stream]:
    """Every topic of an MCAP file, decoded with its stored schema, sorted by publish (source) time."""
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    rows: dict[str, list] = {}
    with open(path, "rb") as f:
        reader = make_reader(f, decoder_factories=[DecoderFactory()])
        for _, channel, message, decoded in reader.iter_decoded_messages(log_time_order=False):
            rows.setdefault(channel.topic, []).append(
                (message.publish_time or message.log_time, message.sequence, decoded)
            )
    streams = {}
    for topic, items in rows.items():
        items.sort(key=lambda row: row[:2])
        streams[topic] = Stream([t for t, _, _ in items], [m for _, _, m in items])
    return streams


def _recorded_cameras(streams: dict[str, Stream]) -> dict[str, str]:
    """camera -> its topic, the raw image topic where recorded, else the compressed one."""
    cameras: dict[str, str] = {}
    named = [(camera_of(topic), topic) for topic in streams]
    for (name, _), topic in sorted((c, t) for c, t in named if c is not None):  # raw (compressed False) first
        cameras.setdefault(name, topic)
    return cameras


def frame_row(images: dict[str, object], state: np.ndarray, action: np.ndarray, task: str) -> dict:
    """One dataset row: each camera's Image or CompressedImage decoded by `robot_bridge.codec.decode_image`
    (the decoder `vla-rl serve` uses, so training and deployment see the same pixels), state (S,), action (A,)."""
    row: dict = {image_key(c): decode_image(m) for c, m in images.items()}
    row.update({OBS_STATE: state, ACTION: action, "task": task})
    return row


def convert(cfg: ConvertConfig) -> dict:
    """Convert ``cfg.input`` into a LeRobotDataset at ``cfg.output_dir``; returns a summary dict."""
    src, out = Path(cfg.input), Path(cfg.output_dir)
    if not src.is_file():
        raise FileNotFoundError(f"no recording at {src}; record one with `vla-rl record-ros --output={src}`")
    if out.exists() and not cfg.overwrite:
        raise FileExistsError(
            f"{out} already exists; pass --overwrite=true to replace it or choose another --output_dir"
        )
    start = time.time()
    streams = read_streams(src)
    recorded = _recorded_cameras(streams)
    cameras = cfg.cameras or sorted(recorded)
    missing = [c for c in cameras if c not in recorded] + (
        [cfg.joint_states_topic] if cfg.joint_states_topic not in streams else []
    )
    if missing:
        raise ValueError(
            f"{src} lacks {missing}; it has topics {sorted(streams)}. Record them with `vla-rl record-ros --topics=...`"
        )
    commands = sorted(
        (
            (t, msg)
            for topic in cfg.command_topics
            if topic in streams
            for t, msg in zip(streams[topic].times, streams[topic].messages)
        ),
        key=lambda row: row[0],
    )
    if not commands:
        raise ValueError(f"{src} has no commands on {cfg.command_topics}; it has topics {sorted(streams)}")
    frames, dropped, state_names, by_status = _paired_frames(cfg, streams, commands, recorded, cameras)
    if not frames:
        raise ValueError(
            f"no command in {src} has a joint state and images within {cfg.max_input_age_s} s before it; dropped: {dict(dropped)}"
        )
    episodes: list[list[dict]] = []
    for frame in frames:
        if not episodes or frame["episode"] != episodes[-1][0]["episode"]:
            episodes.append([])
        episodes[-1].append(frame)
    summary = {
        "dataset": str(out), "recording": str(src), "episodes": len(episodes), "frames": len(frames),
        "episode_lengths": [len(e) for e in episodes], "tasks": [], "cameras": cameras, "commands": len(commands),
        "dropped": dict(dropped), "episodes_from": "status" if by_status else "gaps", "seconds": 0.0,
        "config": asdict(cfg),
    }  # fmt: skip
    _write_dataset(cfg, out, episodes, state_names, streams.get(cfg.instruction_topic, Stream()), summary, start)
    return summary


def _paired_frames(cfg: ConvertConfig, streams: dict, commands: list, recorded: dict, cameras: list[str]):
    """Each valid command paired with the newest joint state and images before it, and its episode key.

    Returns (frames: dicts of t, episode, state (S,), action (A,), images; what was dropped and why; the
    joint state names; whether episodes came from the sim robot's status, else from gaps in time)."""
    joints = streams[cfg.joint_states_topic]
    state_names = list(joints.messages[0].name)
    episode_of_stamp = {}  # observation stamp (ns) -> episode index, from the sim robot's status
    for msg in streams[cfg.episode_topic].messages if cfg.episode_topic in streams else []:
        status = json.loads(msg.data)
        episode_of_stamp[status["stamp_ns"]] = status["episode"]
    max_age = int(cfg.max_input_age_s * 1e9)
    frames, dropped = [], Counter()
    previous_t, gap_episode = None, 0
    for t, msg in commands:
        try:  # rejected as the robot rejects it: missing or unknown names, wrong size, non-finite
            action = command_action(msg, cfg.action_names)
        except InputRejected:
            dropped["invalid_command"] += 1
            continue
        state_msg = joints.latest(t, max_age)
        images = {c: streams[recorded[c]].latest(t, max_age) for c in cameras}
        if state_msg is None or any(m is None for m in images.values()):
            dropped["no_recent_observation"] += 1
            continue
        try:
            state = joint_state_vector(state_msg, state_names).astype(np.float32)
        except InputRejected as err:
            dropped[f"joint_state_{err.kind}"] += 1
            continue
        if episode_of_stamp:
            episode = episode_of_stamp.get(stamp_ns(state_msg.header.stamp))
            if episode is None:
                dropped["no_episode_status"] += 1
                continue
        else:
            gap_episode += previous_t is not None and t - previous_t > cfg.episode_gap_s * 1e9
            episode = gap_episode
        previous_t = t
        frames.append(
            {"t": t, "episode": episode, "state": state, "action": action.astype(np.float32), "images": images}
        )
    return frames, dropped, state_names, bool(episode_of_stamp)


def _write_dataset(cfg: ConvertConfig, out: Path, episodes: list[list[dict]], state_names: list[str],
                   instructions: Stream, summary: dict, start: float) -> None:  # fmt: skip
    """Write the episodes as a LeRobotDataset at ``out``, atomically (a temporary folder renamed into place;
    nothing is left behind on an error or a stop). Completes ``summary`` (tasks, seconds) and writes it
    beside the dataset's metadata."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from vla_core.data import discard_dataset, quiet_datasets, video_backend
    from vla_core.files import replace_directory

    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    first_images = {c: decode_image(m) for c, m in episodes[0][0]["images"].items()}
    features = {image_key(c): {"dtype": "image", "shape": img.shape, "names": ["height", "width", "channels"]}
                for c, img in first_images.items()}  # fmt: skip
    features[OBS_STATE] = {"dtype": "float32", "shape": (len(state_names),), "names": state_names}
    features[ACTION] = {"dtype": "float32", "shape": (len(cfg.action_names),), "names": list(cfg.action_names)}
    quiet_datasets()
    ds = None
    try:
        ds = LeRobotDataset.create(cfg.repo_id, fps=cfg.fps, features=features, root=tmp, robot_type=cfg.robot_type,
                                   use_videos=False, video_backend=video_backend())  # fmt: skip
        tasks = []
        with tqdm(total=summary["frames"], desc="convert", unit="frame") as bar:
            for episode in episodes:
                task = instructions.latest(episode[0]["t"], math.inf)
                task = task.data if task is not None else cfg.task
                if not task:
                    raise ValueError(f"no instruction on {cfg.instruction_topic} before an episode; pass --task='...'")
                for frame in episode:
                    ds.add_frame(frame_row(frame["images"], frame["state"], frame["action"], task))
                    bar.update(1)
                ds.save_episode()
                tasks.append(task)
        ds.finalize()
        summary.update(tasks=sorted(set(tasks)), seconds=round(time.time() - start, 1))
        (tmp / "meta" / "vla_rl_convert.json").write_text(json.dumps(summary, indent=2))
    except BaseException:
        discard_dataset(ds, tmp)
        raise
    replace_directory(tmp, out)
