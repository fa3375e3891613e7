"""The serve node's inputs: joint states, camera images and the instruction, checked as they arrive,
and (with ``topics.episode``) the robot's episode status.

Each message is decoded by `robot_bridge.codec` (the decoder `vla-rl convert` uses for training
data) and checked: shape, encoding, finiteness, a header stamp neither ahead of the node's clock
(beyond ``safety.future_stamp_tolerance_s``) nor out of order (see `BridgeInputs._accept`), and for
joint states the plausibility bounds of ``safety.state_bounds``. A rejected message leaves a fault
on its source (the hold names it) until that source's next good message. The state is assembled by
joint name from every joint state message (`robot_bridge.joint_states`): a source is the set of
joints a message carries, and each joint goes stale on its own.

Images are paired with the joint state by header stamp when an observation is built (what
message_filters' approximate synchronizer does): each camera keeps its last ``IMAGE_BUFFER`` images, and
the one closest in stamp to the newest joint state is used, never one further from it than
``safety.pair_tolerance_s``: else no request goes out (counted, said once a second), and a camera that
stays unpaired longer than ``safety.stale_after_s`` holds the robot. The joint state is always the
newest: its stamp is the observation's in the latency accounting. No ROS import at module
level: :meth:`BridgeInputs.subscribe` takes the node.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from robot_bridge import topics
from robot_bridge.codec import InputRejected, decode_image, stamp_seconds
from robot_bridge.config import CameraTopic, ServeConfig
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.joint_states import JointStateAssembly, source_name
from robot_bridge.log_limit import LogLimiter
from vla_core.types import OBS_STATE, TASK

# The joint states' source name when one message carries every joint the policy reads; a source carrying some of
# them is named by them (`joint_states.source_name`); a camera's is "camera <name>".
JOINT_STATES = "joint_states"
# Images kept per camera for pairing: a camera at 30 Hz and joint states at up to 1 kHz give the closest image
# within the last 8 (about 0.27 s), longer than any pairing tolerance worth setting.
IMAGE_BUFFER = 8


def check_bounds(vector: np.ndarray, names: list[str], low: np.ndarray, high: np.ndarray, margin: float) -> None:
    """Reject a state vector (S,) with an entry outside [low - margin, high + margin] (per entry, (S,) each).

    A value no robot of the configured kind can reach is a sensor fault (a 1e6 rad joint angle, a
    unit mix-up): it must not reach the policy, whose output clamp alone would hide it.
    """
    outside = (vector < low - margin) | (vector > high + margin)
    if not outside.any():
        return
    bad = [f"{names[i]}={vector[i]:g} outside [{low[i]:g}, {high[i]:g}]" for i in np.flatnonzero(outside)]
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    raise InputRejected(
        f"joint_states out of bounds: {', '.join(bad[:3])}{more}, margin {margin:g}; a sensor fault, or widen "
        f"safety.state_bounds in the serve YAML (or safety.state_margin) if the robot really is there",
        "out_of_bounds",
    )


def fit_image(rgb: np.ndarray, size: int, resize: bool) -> np.ndarray:
    """(H, W, 3) uint8 -> (size, size, 3) uint8: unchanged, resized when allowed, else rejected."""
    if rgb.shape[:2] == (size, size):
        return rgb
    if not resize:
        raise InputRejected(
            f"image is {rgb.shape[0]}x{rgb.shape[1]} but the policy expects {size}x{size}; "
            f"publish that size or set resize_images=true",
            "image_size",
        )
    import cv2

    return cv2.resize(rgb, (size, size), interpolation=cv2.INTER_AREA)


class BridgeInputs:
    """The newest accepted joint state, image per camera and instruction, with their arrival times and stamps.

    ``on_joint_state`` (optional) is called with the arrival time (monotonic) of every joint state,
    accepted or not: with ``clock=joint_states`` each one is a control tick. ``clock_now`` (optional): the
    node's clock in seconds, the clock header stamps are on; None checks no stamp against it.
    """

    def __init__(
        self,
        config: ServeConfig,
        diagnostics: BridgeDiagnostics,
        log_limiter: LogLimiter,
        log_info: Callable[[str], None],
        on_joint_state: Callable[[float], None] | None = None,
        clock_now: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.clock_now = clock_now
        self.diagnostics = diagnostics
        self.log_limiter = log_limiter
        self.log_info = log_info
        self.on_joint_state_arrival = on_joint_state
        # The state assembled by joint name from every joint state message (`robot_bridge.joint_states`).
        self.joints = JointStateAssembly(config.state_names, config.safety.joint_agreement_tolerance)
        self.state: np.ndarray | None = None  # (S,) in state_names order, once every joint has been reported
        self.state_stamp = None  # builtin_interfaces/Time of the message that last updated it, echoed in the commands
        self.state_time = -math.inf  # that stamp in seconds: the observation's stamp, what images pair with
        self.state_arrival = -math.inf  # that message's arrival (monotonic)
        self._joint_sources: dict[frozenset[str], str] = {}  # a joint state source (its set of names) -> its name
        self.joint_source_seen: dict[str, float] = {}  # a joint state source -> its last message's arrival, any
        self.arrival: dict[str, float] = {}  # source -> monotonic arrival of its newest accepted message
        self.stamp: dict[str, float] = {}  # source -> header stamp of that message, seconds
        self.images: dict[str, np.ndarray] = {}  # camera -> its newest accepted image, (H, W, 3) uint8
        # camera -> its last IMAGE_BUFFER accepted (stamp seconds, (H, W, 3) uint8), oldest first, for pairing
        self.frames: dict[str, deque[tuple[float, np.ndarray]]] = {}
        # camera source -> (monotonic time its pairing first failed, why), until it pairs again
        self.unpaired: dict[str, tuple[float, str]] = {}
        self.faults: dict[str, tuple[str, str]] = {}  # source -> (kind, why) its last message was rejected
        self.instruction = config.instruction
        # (the robot's episode that ended, the stamp in seconds of its final state) as topics.episode announced
        # it, until the scheduler starts the next episode; the first joint state starts episode 0.
        self.ended_episode: tuple[int, float] | None = (-1, -math.inf) if config.topics.episode else None
        self.policy_image_size: int | None = None  # the loaded policy's, once it is known
        self.set_state_bounds(config.safety.state_bounds)

    def set_state_bounds(self, bounds) -> None:
        """The plausibility bounds of the state entries: name -> (low, high); the robot description's once it is
        known (its joint limits, and the configured ``safety.state_bounds``)."""
        names = self.config.state_names
        # In state_names order; +-inf where none is given.
        self.state_low = np.array([bounds[n][0] if n in bounds else -np.inf for n in names])
        self.state_high = np.array([bounds[n][1] if n in bounds else np.inf for n in names])
        # A robot whose joint names differ from the sim arm's gets no check from the defaults: the node says so.
        self.unchecked_state = [n for n in names if n not in bounds]

    @property
    def image_size(self) -> int | None:
        """Side of the square images the policy takes: the config's, else the loaded policy's (None until known)."""
        return self.config.image_size or self.policy_image_size

    def subscribe(self, node, sensor_qos, command_qos) -> None:
        """Subscribe ``node`` to the joint states (every topic of them), every camera and the instruction."""
        cfg = self.config
        for topic in [cfg.topics.joint_states, *cfg.topics.more_joint_states]:
            node.create_subscription(topics.JOINT_STATES.message_class(), topic, self.on_joint_state, sensor_qos)
        for cam in cfg.cameras:
            image_type = topics.camera(cam.name, cam.compressed).message_class()
            node.create_subscription(image_type, cam.topic, lambda msg, c=cam: self.on_image(c, msg), sensor_qos)
        node.create_subscription(
            topics.INSTRUCTION.message_class(), cfg.topics.instruction, self.on_instruction, command_qos
        )
        if cfg.topics.episode:
            node.create_subscription(
                topics.EPISODE.message_class(), cfg.topics.episode, self.on_episode_status, command_qos
            )

    # -- callbacks -------------------------------------------------------------------------------

    def on_joint_state(self, msg) -> None:
        """A JointState from any publisher: its joints the policy reads update the assembled state (a message with
        none of them is ignored). Checked per message, a rejection a fault of its source until its next good one."""
        # The callback's start stands for the arrival: rclpy's EventsExecutor cannot pass MessageInfo
        # (the DDS receive time), and dispatches within tens of microseconds of it.
        arrival = time.monotonic()
        cfg, names = self.config, list(msg.name)
        source = self._joint_source(frozenset(names))
        self.joint_source_seen[source] = arrival
        try:
            key, carried, values = self.joints.read(names, msg.position)
            if not len(carried):
                return
            check_bounds(values, [cfg.state_names[i] for i in carried], self.state_low[carried],
                         self.state_high[carried], cfg.safety.state_margin)  # fmt: skip
            stamp = stamp_seconds(msg.header.stamp)
            self._accept(source, stamp, arrival)
            disagreement = self.joints.disagreement(key, carried, values, stamp)
            if disagreement:
                raise InputRejected(disagreement, "disagreement")
            if not self.joints.take(key, carried, values, stamp, arrival):
                return  # every joint it carries was reported newer by another source
            if self.joints.complete:
                self.state = self.joints.values.copy()
                if stamp >= self.state_time:  # the observation's stamp never goes back (another source's lag)
                    self.state_stamp, self.state_time = msg.header.stamp, stamp
                self.state_arrival = arrival
        except InputRejected as err:
            self.reject(source, err)
        if self.on_joint_state_arrival is not None:
            self.on_joint_state_arrival(arrival)

    def _joint_source(self, names: frozenset[str]) -> str:
        """The name of the source whose messages carry ``names``, one per set of names: ``joint_states`` for the
        first that carries every joint the policy reads (one publisher for the whole robot), else named by the joints
        it carries, numbered where two sets would read alike."""
        if names not in self._joint_sources:
            wanted = self.config.state_names
            name = JOINT_STATES if set(wanted) <= names else source_name(names, wanted)
            taken = set(self._joint_sources.values())
            unique, n = name, 2
            while unique in taken:
                unique, n = f"{name} #{n}", n + 1
            self._joint_sources[names] = unique
            if len(self._joint_sources) == 2 and self.config.clock == "joint_states":
                self.log_limiter("joint state sources", "warning", "joint states come from more than one source "
                                 f"({', '.join(self._joint_sources.values())}): each message ticks the control loop "
                                 "(at most control_hz a second), so ticks are uneven; set clock: timer for a steady "
                                 "rate")  # fmt: skip
        return self._joint_sources[names]

    def on_image(self, camera: CameraTopic, msg) -> None:
        arrival = time.monotonic()
        source = f"camera {camera.name}"
        try:
            rgb = decode_image(msg)
            if self.image_size:
                rgb = fit_image(rgb, self.image_size, self.config.resize_images)
            stamp = stamp_seconds(msg.header.stamp)
            self._accept(source, stamp, arrival)
            self.images[camera.name] = rgb
            self.frames.setdefault(camera.name, deque(maxlen=IMAGE_BUFFER)).append((stamp, rgb))
        except InputRejected as err:
            self.reject(source, err)

    def on_episode_status(self, msg) -> None:
        """The robot's episode status (JSON; see ``topics.episode``): an ended episode is kept until the scheduler
        starts the next. A malformed status is logged and ignored: it carries no observation to hold for."""
        try:
            status = json.loads(msg.data)
            if status.get("done"):
                self.ended_episode = (int(status["episode"]), int(status["stamp_ns"]) * 1e-9)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self.log_limiter("episode status", "warning", f"ignored an episode status that is not one ({err})")

    def on_instruction(self, msg) -> None:
        if msg.data != self.instruction:
            self.log_info(f"instruction: {msg.data!r} (from the next chunk on)")
        self.instruction = msg.data

    # -- checks ----------------------------------------------------------------------------------

    def _accept(self, source: str, stamp: float, arrival: float) -> None:
        """Check the header stamp against the node's clock and the source's last accepted one; record it.

        A stamp ahead of the clock beyond the tolerance is rejected. A stamp older than the last accepted
        one is out of order, unless that one is still ahead of the clock: then only a stamp older than the
        clock minus ``safety.stale_after_s`` is, so no accepted message, however stamped, locks its stream
        out until the clock catches up with it.
        """
        now = self.clock_now() if self.clock_now is not None else math.inf
        tolerance = self.config.safety.future_stamp_tolerance_s
        if stamp > now + tolerance:
            raise InputRejected(
                f"stamp {stamp:.6f} s is {stamp - now:.3f} s ahead of this node's clock (tolerance {tolerance:g} s): a "
                "bad stamp or a clock that stepped forward; synchronize the clocks (chrony, PTP) or raise "
                "safety.future_stamp_tolerance_s",
                "future_stamp",
            )
        last = self.stamp.get(source)
        bar = last if last is None or last <= now else now - self.config.safety.stale_after_s
        if bar is not None and stamp < bar:
            self.diagnostics.count("out_of_order")
            raise InputRejected(
                f"out-of-order stamp {stamp:.6f} s, older than the last accepted {last:.6f} s", "out_of_order"
            )
        self.stamp[source] = stamp
        self.arrival[source] = arrival
        self.faults.pop(source, None)

    def reject(self, source: str, err: InputRejected) -> None:
        """Count and log a rejected message; its source is faulty until its next good message."""
        self.diagnostics.rejected(err.kind)
        reason = f"{source}: {err}"
        # One line per source and cause per second: the details (a value, a stamp) change with
        # every message of a persisting fault, the cause does not.
        self.log_limiter(f"rejected {source} {err.kind}", "warning", f"rejected {reason} [{err.kind}]; holding")
        self.faults[source] = (err.kind, reason)
        self.diagnostics.last_error = reason

    def fault(self) -> tuple[str, str] | None:
        """(key, text) naming every source whose last message was rejected, or None. A joint state source silent for
        ``safety.stale_after_s`` leaves its fault behind (a driver stopped after its values disagreed: the state goes
        on from the others, or goes stale by joint)."""
        now = time.monotonic()
        for source, seen in list(self.joint_source_seen.items()):
            if now - seen > self.config.safety.stale_after_s:
                self.faults.pop(source, None)
        if not self.faults:
            return None
        key = "rejected " + ", ".join(f"{source} {kind}" for source, (kind, _) in sorted(self.faults.items()))
        return key, "rejected input: " + "; ".join(reason for _, reason in self.faults.values())

    def stale(self, now: float) -> list[str]:
        """The inputs with nothing accepted in the last ``safety.stale_after_s`` seconds: ``joint_states`` when
        every joint is, else the joints that are (never reported: missing), then the cameras."""
        limit = self.config.safety.stale_after_s
        joints = self.joints.stale(now, limit)
        out = []
        if len(joints) == len(self.config.state_names):
            out.append(JOINT_STATES)
        elif joints:
            missing = set(self.joints.missing())
            out.append(f"{JOINT_STATES} " + " ".join(f"{n} (missing)" if n in missing else n for n in joints))
        cameras = [f"camera {c.name}" for c in self.config.cameras]
        return out + [s for s in cameras if now - self.arrival.get(s, -math.inf) > limit]

    def _closest(self, camera: str) -> tuple[float, np.ndarray]:
        """(stamp seconds, (H, W, 3) uint8) of the camera's buffered image closest in stamp to the newest joint state."""
        return min(self.frames[camera], key=lambda frame: abs(frame[0] - self.state_time))

    def paired_image(self, camera: CameraTopic, quiet: bool = False) -> np.ndarray | None:
        """(H, W, 3) uint8: the camera's buffered image closest in stamp to the newest joint state, or None when
        none is within ``safety.pair_tolerance_s`` (counted as ``unpaired_observations``, said once a second,
        and a hold cause once it lasts longer than ``safety.stale_after_s``: :meth:`pairing_problem`). ``quiet``: none
        of that, only the answer (the low-latency part asks every tick; the requests count and say it)."""
        source = f"camera {camera.name}"
        state_stamp, tolerance = self.state_time, self.config.safety.pair_tolerance_s
        stamp, rgb = self._closest(camera.name)
        if abs(stamp - state_stamp) <= tolerance:
            if not quiet:
                self.unpaired.pop(source, None)
            return rgb
        if quiet:
            return None
        newest = self.frames[camera.name][-1][0]
        why = (f"{source}: no image within {tolerance:g} s of the joint state stamped {state_stamp:.3f} s (the closest "
               f"is {(stamp - state_stamp) * 1e3:+.0f} ms from it, the newest stamped {newest:.3f} s): the camera and "
               f"the robot stamp on different clocks, or the camera lags; synchronize their clocks, or raise "
               f"safety.pair_tolerance_s")  # fmt: skip
        self.diagnostics.count("unpaired_observations")
        self.diagnostics.last_error = why
        self.log_limiter(f"unpaired {source}", "warning", why + "; no request until it pairs")
        self.unpaired[source] = (self.unpaired.get(source, (time.monotonic(), ""))[0], why)
        return None

    def pairing_problem(self, now: float) -> tuple[str, str] | None:
        """(key, text) naming the cameras that have not paired with the joint state for longer than
        ``safety.stale_after_s`` (a camera that just stopped is reported stale first), or None. Checked afresh
        here: no request goes out while the node holds, so the next request cannot be what clears it."""
        tolerance = self.config.safety.pair_tolerance_s
        for source in list(self.unpaired):
            stamp, _ = self._closest(source.removeprefix("camera "))
            if abs(stamp - self.state_time) <= tolerance:
                del self.unpaired[source]
        limit = self.config.safety.stale_after_s
        lasting = sorted((source, why) for source, (since, why) in self.unpaired.items() if now - since > limit)
        if not lasting:
            return None
        return "unpaired " + ", ".join(s for s, _ in lasting), "unpaired input: " + "; ".join(w for _, w in lasting)

    def observation(self, quiet: bool = False) -> dict[str, Any] | None:
        """The policy's numpy batch of one: state (1, S) float32, instruction, images (1, H, W, 3) uint8, each
        image paired with the state by stamp (:meth:`paired_image`).

        None when a camera has no image within the pairing tolerance, or (the camera rejected) when an image
        that arrived before the policy told its size does not fit it. ``quiet``: an unpaired camera is neither
        counted nor logged (`paired_image`).
        """
        observation: dict[str, Any] = {OBS_STATE: self.state[None].astype(np.float32), TASK: [self.instruction]}
        size = self.image_size
        for cam in self.config.cameras:
            rgb = self.paired_image(cam, quiet)
            if rgb is None:
                return None
            if size:
                try:
                    rgb = fit_image(rgb, size, self.config.resize_images)
                except InputRejected as err:
                    if not quiet:
                        self.reject(f"camera {cam.name}", err)
                    return None
            observation[cam.feature] = rgb[None]
        return observation
