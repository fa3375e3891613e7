"""`vla-rl serve`: the ROS 2 node that streams a policy's actions to a robot at the control rate.

One thread runs every callback (subscriptions, timers), so a control tick never waits on a lock.
The policy runs in an `InferenceWorker` (its own process by default) and its chunks are merged
by `vla_rl.runtime.ActionChunkExecutor`, the object the sim delay wrapper drives too.

Control tick (one per arriving joint state with ``clock=joint_states``, else one per timer
period): pass the action prepared for this step through the `SafetyFilter` and publish it. Only
then, off the latency path: merge any chunk that came back, ask for the next chunk when due
(every ``execute_steps`` steps, one request in flight at a time, as in `sim.delay`), and take
the next step's action from the executor. So a chunk takes effect from the step after the tick
that found it, which is also the lag its delay augmentation announced.

Hold: the node publishes the previous command (the measured position before any command)
whenever it cannot trust the next action, and names the cause on /diagnostics and in its log:
e-stop, policy loading or failed to load, a rejected input (malformed, NaN, wrong size,
out-of-order stamp, a state outside ``safety.state_bounds``; cleared by the next good message
from that source), a stale input (older than ``safety.stale_after_s``), a policy exception or an
invalid chunk (NaN, wrong shape; cleared by the next good chunk). Entering a hold discards the
queued plan and any chunk still in flight, so the robot never resumes a plan made before it
stopped. The e-stop latches: ``True`` on the estop topic holds until ``False``. A fault that
repeats with every message is logged at most once a second per cause (`LogLimiter`); the exact
counts, per cause, are on /diagnostics (``rejected_<kind>``, ``invalid_chunks``, ...).

Commands: JointTrajectory with ``joint_names = action_names`` and one point (the command,
``time_from_start`` = one period); ``header.stamp`` is the stamp of the newest joint state the
command was computed with. Delta actions are integrated against the last command, never
re-anchored on the measured state.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import rclpy
import rclpy.executors
import torch
from builtin_interfaces.msg import Duration, Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.experimental import EventsExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Bool, Float64MultiArray, String
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from robot_bridge.config import ServeConfig, apply_overrides, flat_fields
from robot_bridge.inference import InferenceRequest, InferenceResult, InferenceWorker, WorkerStatus, chunk_problem
from robot_bridge.log_limit import LogLimiter
from robot_bridge.messages import (
    InputRejected,
    check_bounds,
    compressed_to_rgb,
    fit_image,
    image_to_rgb,
    joint_state_vector,
    stamp_seconds,
)
from robot_bridge.safety import SafetyFilter
from robot_bridge.scheduling import lock_memory, quiet_interpreter, use_realtime
from vla_rl.runtime import ActionChunkExecutor
from vla_rl.types import OBS_STATE, TASK, ActionChunk, Policy

LIST_PARAMETER_TYPES = {
    "list[float]": Parameter.Type.DOUBLE_ARRAY,
    "list[int]": Parameter.Type.INTEGER_ARRAY,
    "list[str]": Parameter.Type.STRING_ARRAY,
    "list[bool]": Parameter.Type.BOOL_ARRAY,
}
DIAGNOSTIC_LEVELS = {
    "RUNNING": DiagnosticStatus.OK,
    "LOADING": DiagnosticStatus.WARN,
    "HOLDING": DiagnosticStatus.WARN,
    "ESTOP": DiagnosticStatus.WARN,
    "FAILED": DiagnosticStatus.ERROR,
}


@dataclass
class TickRecord:
    """What one control tick did, for benchmarks and tests."""

    step: int  # executor step of the emitted action (-1 before the policy is ready)
    scheduled: float  # monotonic time the command was due
    published: float  # monotonic time it was handed to ROS
    command: np.ndarray | None  # (A,) sent (or, in dry-run, computed); None before any state arrived
    from_policy: bool  # the command is the policy's queued action (False: a hold, or the queue ran dry)
    state: str  # RUNNING, HOLDING, ...
    seam: bool  # the first command after a chunk was merged
    obs_stamp: float  # stamp of the newest accepted joint state, seconds


class PolicyBridge(Node):
    """Sensors in, policy chunks merged asynchronously, safe commands out at the control rate.

    ``load_policy`` is called inside the inference worker (so it must pickle for process mode);
    ``on_tick`` (optional) receives a ``TickRecord`` after every control tick; ``log_clock`` is the
    clock (seconds) of the once-a-second limit on repeated log lines.
    """

    def __init__(
        self,
        config: ServeConfig,
        load_policy: Callable[[], Policy],
        on_tick: Callable[[TickRecord], None] | None = None,
        log_clock: Callable[[], float] = time.monotonic,
        **node_kwargs: Any,
    ) -> None:
        super().__init__("vla_rl_serve", **node_kwargs)
        self.config = config
        self._apply_parameter_overrides()
        cfg = self.config
        cfg.validate()
        self.period = 1.0 / cfg.control_hz
        self.on_tick = on_tick
        self.safety = SafetyFilter(
            self.period, len(cfg.action_names), cfg.safety.position_min, cfg.safety.position_max,
            cfg.safety.max_velocity, cfg.safety.max_acceleration,
        )  # fmt: skip
        self.executor_: ActionChunkExecutor | None = None  # built once the policy tells its horizon
        self.policy_info: dict[str, Any] = {}
        self.instruction = cfg.instruction

        # Inputs: newest accepted value, its arrival (monotonic) and header stamp, per source.
        self._state: np.ndarray | None = None  # (S,)
        self._state_stamp = Time()  # header stamp of that joint state
        self._arrival: dict[str, float] = {}
        self._stamp: dict[str, float] = {}
        self._images: dict[str, np.ndarray] = {}  # camera -> (H, W, 3) uint8
        self._faults: dict[str, tuple[str, str]] = {}  # source -> (kind, why) its last message was rejected
        # Plausibility bounds of the state entries, in state_names order; +-inf where none is configured.
        bounds = cfg.safety.state_bounds
        self._state_low = np.array([bounds[n][0] if n in bounds else -np.inf for n in cfg.state_names])
        self._state_high = np.array([bounds[n][1] if n in bounds else np.inf for n in cfg.state_names])
        # A robot whose joint names differ from the sim arm's gets no check from the defaults: say so.
        self.unchecked_state = [n for n in cfg.state_names if n not in bounds]

        self._worker_state = "loading"
        self._worker_error: str | None = None
        self._policy_error: str | None = None
        self._policy_error_kind = ""  # policy_raised or invalid_chunk
        self._retry_at = 0.0
        self._in_flight: dict[str, Any] | None = None
        self._request_id = 0
        self._next_request_step = 0
        self._delay_steps = 0  # for the next request: the lag of the last merged chunk, in steps, as in training
        self._epoch = 0  # bumped by every hold; chunks requested in an older epoch are dropped
        self._holding = False
        self._merged = False  # a chunk was merged since the last action was prepared
        # The action prepared for the next tick: (A,) or None (nothing queued), its executor step,
        # and whether it is the first from a newly merged chunk.
        self._next_target: np.ndarray | None = None
        self._next_step = -1
        self._next_is_seam = False
        self.node_state = "LOADING"
        self.cause: str | None = "loading the policy"
        self._cause_key: str | None = "worker loading"  # what the cause is, without its changing details
        self.last_error = ""
        self.counters = {
            "ticks": 0, "missed_deadlines": 0, "rejected_messages": 0, "out_of_order": 0, "stale_events": 0,
            "chunks": 0, "dropped_chunks": 0, "policy_errors": 0, "invalid_chunks": 0, "load_failures": 0,
            "delay_clamped": 0,
        }  # fmt: skip
        self.rejections: dict[str, int] = {}  # kind of rejected input (InputRejected.kind) -> messages
        # Whether the control process got real-time scheduling and locked memory ("granted", or why
        # not); `serve` fills it in, and it is reported on /diagnostics and in the final summary.
        self.scheduling: dict[str, str] = {}
        self.log_limiter = LogLimiter(self._log_line, period_s=1.0, clock=log_clock)
        if self.unchecked_state:
            self.get_logger().warning(
                f"state entries {self.unchecked_state} have no plausibility bounds, so a sensor fault there "
                f"reaches the policy; give each a [low, high] under safety.state_bounds in the serve YAML"
            )
        self.latencies_ms: list[float] = []  # request -> result, per chunk
        self.obs_to_command_ms: list[float] = []  # joint state arrival -> first command of its chunk
        self._seam_obs_arrival = 0.0
        self._last_state_tick = time.monotonic()

        self._create_interfaces()
        self.worker = InferenceWorker(
            load_policy, mode=cfg.inference, cpu=cfg.inference_cpu, num_threads=cfg.inference_threads,
            nice=cfg.inference_nice, load_retry_s=cfg.load_retry_s,
        )  # fmt: skip
        self.get_logger().info(
            f"serving {cfg.checkpoint} at {cfg.control_hz:g} Hz ({cfg.clock} clock), merge={cfg.merge}, "
            f"{cfg.action_mode} {cfg.action_space} actions {cfg.action_names}" + (", DRY RUN" if cfg.dry_run else "")
        )

    # -- setup -----------------------------------------------------------------------------------

    def _log_line(self, level: str, line: str) -> None:
        # One call per severity: rclpy keys a logger call's context by its call site and refuses a
        # site whose severity changes between calls.
        logger = self.get_logger()
        if level == "error":
            logger.error(line)
        elif level == "warning":
            logger.warning(line)
        else:
            logger.info(line)

    def _apply_parameter_overrides(self) -> None:
        """Declare every scalar/list config field as a ROS parameter; values set at launch override the config."""
        overrides = {}
        for name, (value, type_name) in flat_fields(self.config).items():
            descriptor = ParameterDescriptor(dynamic_typing=True)
            if isinstance(value, list) and not value:
                param = self.declare_parameter(name, LIST_PARAMETER_TYPES[type_name])
            else:
                param = self.declare_parameter(name, value, descriptor)
            if param.type_ != Parameter.Type.NOT_SET and param.value != value:
                overrides[name] = param.value
        apply_overrides(self.config, overrides)

    def _create_interfaces(self) -> None:
        cfg = self.config
        reliability = {"best_effort": ReliabilityPolicy.BEST_EFFORT, "reliable": ReliabilityPolicy.RELIABLE}
        sensor_qos = QoSProfile(
            history=HistoryPolicy.KEEP_LAST, depth=cfg.qos.sensor_depth,
            reliability=reliability[cfg.qos.sensor_reliability],
        )  # fmt: skip
        command_qos = QoSProfile(
            history=HistoryPolicy.KEEP_LAST, depth=cfg.qos.command_depth, reliability=ReliabilityPolicy.RELIABLE
        )
        self.create_subscription(JointState, cfg.topics.joint_states, self._on_joint_state, sensor_qos)
        for cam in cfg.cameras:
            msg_type = CompressedImage if cam.compressed else Image
            self.create_subscription(msg_type, cam.topic, lambda msg, c=cam: self._on_image(c, msg), sensor_qos)
        self.create_subscription(String, cfg.topics.instruction, self._on_instruction, command_qos)
        self.create_subscription(Bool, cfg.topics.estop, self._on_estop, command_qos)
        # Dry run: the command topics do not exist at all, so nothing can reach the robot.
        self._trajectory_pub = (
            None if cfg.dry_run else self.create_publisher(JointTrajectory, cfg.topics.joint_trajectory, command_qos)
        )
        self._array_pub = None
        if cfg.publish_array and not cfg.dry_run:
            self._array_pub = self.create_publisher(Float64MultiArray, cfg.topics.command_array, command_qos)
        self._chunk_pub = self.create_publisher(String, cfg.topics.chunk_info, command_qos)
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, cfg.topics.diagnostics, command_qos)
        self._period_msg = Duration(sec=int(self.period), nanosec=round((self.period % 1.0) * 1e9))
        if cfg.clock == "timer":
            self._next_scheduled = time.monotonic() + self.period
            self.create_timer(self.period, self._on_timer)
        else:
            # Without joint states there are no ticks: this watchdog keeps commanding the hold.
            self.create_timer(self.period, self._on_watchdog)
        self.create_timer(1.0 / cfg.diagnostics_hz, self.publish_diagnostics)

    # -- inputs ----------------------------------------------------------------------------------

    def _accept(self, source: str, stamp: float, arrival: float) -> None:
        """Check the header stamp is not older than the last accepted one from source; record it."""
        last = self._stamp.get(source)
        if last is not None and stamp < last:
            self.counters["out_of_order"] += 1
            raise InputRejected(
                f"out-of-order stamp {stamp:.6f} s, older than the last accepted {last:.6f} s", "out_of_order"
            )
        self._stamp[source] = stamp
        self._arrival[source] = arrival
        self._faults.pop(source, None)

    def _reject(self, source: str, err: InputRejected) -> None:
        self.counters["rejected_messages"] += 1
        self.rejections[err.kind] = self.rejections.get(err.kind, 0) + 1
        reason = f"{source}: {err}"
        # One line per source and cause per second: the details (a value, a stamp) change with
        # every message of a persisting fault, the cause does not.
        self.log_limiter(f"rejected {source} {err.kind}", "warning", f"rejected {reason} [{err.kind}]; holding")
        self._faults[source] = (err.kind, reason)
        self.last_error = reason

    def _on_joint_state(self, msg: JointState) -> None:
        # The callback's start stands for the arrival: rclpy's EventsExecutor cannot pass MessageInfo
        # (the DDS receive time), and dispatches within tens of microseconds of it.
        arrival = time.monotonic()
        try:
            vector = joint_state_vector(msg.name, msg.position, self.config.state_names)
            check_bounds(vector, self.config.state_names, self._state_low, self._state_high,
                         self.config.safety.state_margin)  # fmt: skip
            self._accept("joint_states", stamp_seconds(msg.header.stamp), arrival)
            self._state = vector
            self._state_stamp = msg.header.stamp  # echoed exactly in the commands it leads to
        except InputRejected as err:
            self._reject("joint_states", err)
        if self.config.clock == "joint_states":
            self._last_state_tick = arrival
            self._control_tick(scheduled=arrival)

    def _on_image(self, camera, msg) -> None:
        arrival = time.monotonic()
        source = f"camera {camera.name}"
        try:
            rgb = compressed_to_rgb(msg) if camera.compressed else image_to_rgb(msg)
            size = self._image_size()
            if size:
                rgb = fit_image(rgb, size, self.config.resize_images)
            self._accept(source, stamp_seconds(msg.header.stamp), arrival)
            self._images[camera.name] = rgb
        except InputRejected as err:
            self._reject(source, err)

    def _on_instruction(self, msg: String) -> None:
        if msg.data != self.instruction:
            self.get_logger().info(f"instruction: {msg.data!r} (from the next chunk on)")
        self.instruction = msg.data

    def _on_estop(self, msg: Bool) -> None:
        if msg.data and not self.safety.estopped:
            self.safety.engage_estop()
            self.get_logger().error("E-STOP engaged: holding until False arrives on the estop topic")
        elif not msg.data and self.safety.estopped:
            self.safety.release_estop()
            self.get_logger().warning("e-stop released")

    def _image_size(self) -> int | None:
        return self.config.image_size or self.policy_info.get("image_size")

    # -- control ---------------------------------------------------------------------------------

    def _on_timer(self) -> None:
        now = time.monotonic()
        late = now - self._next_scheduled
        if late > self.period:  # whole periods lost (the process was starved): each is a missed command
            skipped = int(late // self.period)
            self.counters["missed_deadlines"] += skipped
            self._next_scheduled += skipped * self.period
        scheduled = self._next_scheduled
        self._next_scheduled += self.period
        self._control_tick(scheduled)

    def _on_watchdog(self) -> None:
        # Once joint states stop for 1.5 periods, this timer ticks every period until one arrives.
        now = time.monotonic()
        if now - self._last_state_tick > 1.5 * self.period:
            self._control_tick(scheduled=now)

    def _control_tick(self, scheduled: float) -> None:
        now = time.monotonic()
        cause_key, cause = self._hold_cause(now)
        target = self._next_target if cause is None else None
        command = self._command(target)
        if command is not None:
            self._publish_command(command)
        published = time.monotonic()
        # Everything below runs after the command went out.
        self._set_cause(cause_key, cause)  # may log and publish diagnostics
        self.counters["ticks"] += 1
        if published - scheduled > self.config.deadline_ms / 1e3:
            self.counters["missed_deadlines"] += 1
        if self.on_tick is not None:
            record = TickRecord(
                self._next_step, scheduled, published, command, target is not None, self.node_state,
                self._next_is_seam, self._stamp.get("joint_states", 0.0),
            )  # fmt: skip
            self.on_tick(record)
        if self._next_is_seam:
            self.obs_to_command_ms.append((published - self._seam_obs_arrival) * 1e3)
        self._prepare_next_action(cause, now)

    def _prepare_next_action(self, cause: str | None, now: float) -> None:
        """Merge returned chunks, request the next one when due, and take the next step's action."""
        self._handle_worker_messages(now)
        ex = self.executor_
        self._next_target, self._next_step, self._next_is_seam = None, -1, False
        if ex is None:
            return
        if cause is not None and not self._holding:
            ex.discard_queue()
            self._epoch += 1
        self._holding = cause is not None
        self._maybe_request(now)
        self._next_step = int(ex.step[0])
        action, valid = ex.next_action()  # also while holding: the step counter keeps time
        if bool(valid[0]) and not self._holding:
            self._next_target = action[0].numpy()
            self._next_is_seam = self._merged
            self._merged = False

    def _hold_cause(self, now: float) -> tuple[str | None, str | None]:
        """(key, text): why the next command must be a hold, or (None, None) when the policy's action can go out.

        The key names the cause without the details that change from message to message (a value,
        a stamp), so a persisting fault is one cause: logged once, counted once as a state change.
        """
        if self.safety.estopped:
            return "estop", "e-stop engaged"
        if self._worker_state != "ready":
            return f"worker {self._worker_state}", self._worker_error or "loading the policy"
        if not self.worker.alive():
            self._worker_state, self._worker_error = "failed", "the inference worker died; restart the node"
            self.get_logger().error(self._worker_error)
            return "worker died", self._worker_error
        if self._faults:
            key = "rejected " + ", ".join(f"{source} {kind}" for source, (kind, _) in sorted(self._faults.items()))
            return key, "rejected input: " + "; ".join(reason for _, reason in self._faults.values())
        stale = self._stale_inputs(now)
        if stale:
            text = f"stale input (none newer than {self.config.safety.stale_after_s:g} s): {', '.join(stale)}"
            return "stale " + ", ".join(stale), text
        if self._policy_error is not None:
            return f"policy {self._policy_error_kind}", self._policy_error
        return None, None

    def _stale_inputs(self, now: float) -> list[str]:
        limit = self.config.safety.stale_after_s
        sources = ["joint_states"] + [f"camera {c.name}" for c in self.config.cameras]
        return [s for s in sources if now - self._arrival.get(s, -math.inf) > limit]

    def _set_cause(self, key: str | None, cause: str | None) -> None:
        if key == self._cause_key:
            # The same cause with new details (the next out-of-order stamp, another value): the
            # diagnostics timer reports the newest text; no log line, no state change.
            if cause != self.cause:
                self.cause = cause
                self.last_error = cause or self.last_error
            return
        if key is None:
            state = "RUNNING"
        elif self.safety.estopped:
            state = "ESTOP"
        elif self._worker_state in ("loading", "failed"):
            state = self._worker_state.upper() if self._worker_state == "failed" else "LOADING"
        else:
            state = "HOLDING"
        # Rejections, policy errors, load failures and the e-stop are logged where they are found;
        # only staleness (an absence: nothing arrives to be logged) and recovery are logged here.
        # Both are rate-limited: input that flickers between good and bad would flip the state every tick.
        if key is None:
            self.log_limiter("recovered", "info", f"{self.node_state} -> RUNNING (recovered from: {self.cause})")
        else:
            if key.startswith("stale"):
                self.counters["stale_events"] += 1
                self.log_limiter(key, "warning", f"{state}: {cause}")
            self.last_error = cause
        self.node_state, self.cause, self._cause_key = state, cause, key
        self.publish_diagnostics()

    def _command(self, target: np.ndarray | None) -> np.ndarray | None:
        """The safety-filtered command for this tick; a hold when target is None; None before any state."""
        if self.safety.last_command is None:
            if self._state is None:
                return None
            self.safety.start_from(self._measured_command())
        if target is None:
            return self.safety.hold()
        if self.config.action_mode == "delta":
            target = self.safety.last_command + target
        return self.safety.step(target)

    def _measured_command(self) -> np.ndarray:
        """(A,) the hold before any command: state entries named like the actions, else safety.initial_command."""
        cfg = self.config
        index = {n: i for i, n in enumerate(cfg.state_names)}
        return np.array([
            self._state[index[n]] if n in index else cfg.safety.initial_command[n] for n in cfg.action_names
        ])  # fmt: skip

    def _publish_command(self, command: np.ndarray) -> None:
        if self._trajectory_pub is None:
            return
        values = command.tolist()
        msg = JointTrajectory()
        msg.header.stamp = self._state_stamp
        msg.joint_names = self.config.action_names
        msg.points = [JointTrajectoryPoint(positions=values, time_from_start=self._period_msg)]
        self._trajectory_pub.publish(msg)
        if self._array_pub is not None:
            self._array_pub.publish(Float64MultiArray(data=values))

    # -- inference -------------------------------------------------------------------------------

    def _handle_worker_messages(self, now: float) -> None:
        for message in self.worker.poll():
            if isinstance(message, WorkerStatus):
                self._on_worker_status(message)
            elif self._in_flight is not None and message.request_id == self._in_flight["id"]:
                request = self._in_flight
                self._in_flight = None
                self._on_result(message, request, now)

    def _on_worker_status(self, status: WorkerStatus) -> None:
        if status.state == "failed":
            self.counters["load_failures"] += 1
            self._worker_state, self._worker_error = "failed", status.error
            self.get_logger().error(f"{status.error}; retrying in {self.config.load_retry_s:g} s")
        elif status.state == "loading":
            self._worker_state = "loading" if self._worker_state != "failed" else "failed"
        elif status.state == "ready":
            self.policy_info = status.info
            problem = self._check_policy(status.info)
            if problem:
                self._worker_state, self._worker_error = "failed", problem
                self.get_logger().error(problem)
                return
            cfg = self.config
            self.executor_ = ActionChunkExecutor(
                1, len(cfg.action_names), cfg.horizon or status.info["horizon"], merge=cfg.merge,
                ensemble_coeff=cfg.ensemble_coeff, max_delay=cfg.max_delay_steps,
            )  # fmt: skip
            self._worker_state, self._worker_error = "ready", None
            self.get_logger().info(f"policy ready: {status.info}")

    def _check_policy(self, info: dict[str, Any]) -> str | None:
        """A one-line config error when the loaded policy does not fit the config, else None."""
        cfg = self.config
        if info.get("state_dim") not in (None, len(cfg.state_names)):
            return f"the policy expects {info['state_dim']} state values but state_names lists {len(cfg.state_names)}"
        if info.get("action_dim") not in (None, len(cfg.action_names)):
            return f"the policy outputs {info['action_dim']} action dims but action_names lists {len(cfg.action_names)}"
        horizon = cfg.horizon or info.get("horizon")
        if not horizon:
            return "the policy does not tell its chunk length; set horizon in the serve config"
        if cfg.execute_steps > horizon:
            return f"execute_steps={cfg.execute_steps} exceeds the chunk length {horizon}; lower execute_steps"
        return None

    def _on_result(self, result: InferenceResult, request: dict[str, Any], now: float) -> None:
        latency = now - request["sent"]
        ex = self.executor_
        if result.error is not None:
            self._policy_failed(result.error, "policy_raised", now)
            return
        actions = result.actions
        problem = chunk_problem(actions, ex.horizon, self.config.action_names)
        if problem is not None:  # never merged: a NaN or misshapen plan must not reach the safety filter
            self._policy_failed(problem, "invalid_chunk", now)
            return
        if request["epoch"] != self._epoch:
            self.counters["dropped_chunks"] += 1  # planned before a hold: stale by definition
            return
        # Steps that ran between the observation and this merge: the chunk's delay, in the steps
        # the delay augmentation counts (the sim's d). The next request announces it.
        lag = int(ex.step[0]) - result.obs_step
        ex.add_chunk(ActionChunk(torch.from_numpy(actions), torch.tensor([result.obs_step])))
        self._merged = True
        self._seam_obs_arrival = request["obs_arrival"]
        self._policy_error = None
        self.counters["chunks"] += 1
        self.latencies_ms.append(latency * 1e3)
        if lag > self.config.max_delay_steps:
            self.counters["delay_clamped"] += 1
        self._delay_steps = min(lag, self.config.max_delay_steps)
        info = {
            "chunk_id": result.request_id, "obs_stamp": request["obs_stamp"], "obs_step": result.obs_step,
            "merged_at_step": int(ex.step[0]), "lag_steps": lag, "inference_latency_ms": round(latency * 1e3, 3),
            "compute_ms": round(result.compute_s * 1e3, 3), "delay_steps": request["delay_steps"],
            "horizon": int(actions.shape[1]), "merge": self.config.merge, "guided": request["guided"],
            "instruction": request["instruction"], "dry_run": self.config.dry_run,
        }  # fmt: skip
        self._chunk_pub.publish(String(data=json.dumps(info)))

    def _policy_failed(self, error: str, kind: str, now: float) -> None:
        """Hold on a policy that raised (kind policy_raised) or returned an unusable chunk (invalid_chunk);
        ask again after ``error_retry_s``."""
        self.counters["policy_errors" if kind == "policy_raised" else "invalid_chunks"] += 1
        self._retry_at = now + self.config.error_retry_s
        retry = f"; holding, asking again in {self.config.error_retry_s:g} s"
        self.log_limiter(f"policy {kind}", "error", error + retry)
        self._policy_error, self._policy_error_kind = error, kind
        self.last_error = error

    def _maybe_request(self, now: float) -> None:
        """Ask for the next chunk when one is due and the inputs are good (never blocks)."""
        ex = self.executor_
        if ex is None or self.worker.busy or self._in_flight is not None:
            return
        if self.cause is not None and self.cause != self._policy_error:
            return
        step = int(ex.step[0])
        if step < self._next_request_step or (self._policy_error is not None and now < self._retry_at):
            return
        observation: dict[str, Any] = {OBS_STATE: self._state[None].astype(np.float32), TASK: [self.instruction]}
        size = self._image_size()
        for cam in self.config.cameras:
            try:
                rgb = (
                    fit_image(self._images[cam.name], size, self.config.resize_images)
                    if size
                    else self._images[cam.name]
                )
            except InputRejected as err:  # arrived before the policy told its image size
                self._reject(f"camera {cam.name}", err)
                return
            observation[cam.feature] = rgb[None]
        delay = torch.tensor([self._delay_steps])
        observation.update({k: v.numpy() for k, v in ex.delay_augmentation(delay).items()})
        guidance = None
        if self.config.merge == "rtc" and self.policy_info.get("supports_inpainting"):
            # The previous plan reaches index queue_length, so s = H - queue_length steps of it ran.
            s = min(max(ex.horizon - int(ex.queue_length()[0]), 1), ex.horizon)
            target, weights = ex.rtc_guidance(delay, s)
            guidance = (target.numpy(), weights.numpy())
        self._request_id += 1
        self.worker.submit(InferenceRequest(self._request_id, observation, step, guidance))
        self._in_flight = {
            "id": self._request_id, "sent": now, "epoch": self._epoch, "delay_steps": self._delay_steps,
            "obs_stamp": self._stamp.get("joint_states", 0.0), "obs_arrival": self._arrival["joint_states"],
            "guided": guidance is not None,
            "instruction": self.instruction,
        }  # fmt: skip
        self._next_request_step = step + self.config.execute_steps

    # -- diagnostics -----------------------------------------------------------------------------

    def status_values(self) -> dict[str, str]:
        ex = self.executor_
        lat = self.latencies_ms[-100:]
        values = {
            "state": self.node_state,
            "cause": self.cause or "",
            "inference_latency_ms": f"{lat[-1]:.2f}" if lat else "",
            "inference_latency_p50_ms": f"{np.percentile(lat, 50):.2f}" if lat else "",
            "queue_depth": str(int(ex.queue_length()[0])) if ex is not None else "0",
            "delay_steps": str(self._delay_steps),
            "stale_inputs": ", ".join(self._stale_inputs(time.monotonic())),
            "last_error": self.last_error,
            "instruction": self.instruction,
            "dry_run": str(self.config.dry_run),
        }
        values.update({k: str(v) for k, v in self.counters.items()})
        values.update({f"rejected_{kind}": str(n) for kind, n in sorted(self.rejections.items())})
        values.update(self.scheduling)
        return values

    def publish_diagnostics(self) -> None:
        status = DiagnosticStatus(
            level=DIAGNOSTIC_LEVELS[self.node_state], name="vla_rl serve", hardware_id=self.get_name(),
            message=self.node_state + (f": {self.cause}" if self.cause else ""),
            values=[KeyValue(key=k, value=v) for k, v in self.status_values().items()],
        )  # fmt: skip
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diagnostics_pub.publish(msg)

    def close(self) -> None:
        self.worker.close()
        self.destroy_node()


def make_executor(kind: str, context: rclpy.Context):
    """The rclpy executor named by ``ServeConfig.ros_executor``: "events" or "single_threaded"."""
    if kind == "events":
        return EventsExecutor(context=context)
    if kind == "single_threaded":
        return rclpy.executors.SingleThreadedExecutor(context=context)
    raise ValueError(f"ros_executor must be 'events' or 'single_threaded', got {kind!r}")


def spin(node: Node, executor, duration_s: float = 0.0) -> None:
    """Run the node's callbacks on executor in this thread, for duration_s seconds (0 = until Ctrl-C or shutdown)."""
    executor.add_node(node)
    end = time.monotonic() + duration_s if duration_s > 0 else math.inf
    try:
        while node.context.ok() and time.monotonic() < end:
            executor.spin_once(timeout_sec=min(0.1, max(end - time.monotonic(), 0.0)))
    finally:
        executor.remove_node(node)


def granted(asked: bool, problem: str | None) -> str:
    """What a scheduling request came to: "off" (not asked for), "granted", or "refused: <why>"."""
    if not asked:
        return "off"
    return f"refused: {problem}" if problem else "granted"


def serve(config: ServeConfig, load_policy: Callable[[], Policy], ros_args: list[str] | None = None) -> dict[str, str]:
    """Run the bridge until ``config.duration_s`` passes or Ctrl-C; returns the final diagnostics values.

    The control loop (this thread, and the DDS threads rclpy starts from it) is pinned to
    ``control_cpu`` and the inference worker to ``inference_cpu``, so the two never compete for a core.
    """
    import os

    config.validate()
    cores = os.cpu_count() or 1
    if config.control_cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {config.control_cpu % cores})
    # Before rclpy.init, so the DDS threads it starts inherit the real-time policy.
    rt_problem = use_realtime(config.control_rt_priority) if config.control_rt_priority else None
    lock_problem = lock_memory() if config.control_lock_memory else None
    torch.set_num_threads(1)  # the executor's tensors are tiny; a thread pool would only add wake-ups
    context = rclpy.Context()
    rclpy.init(args=ros_args, context=context)
    node = PolicyBridge(config, load_policy, context=context)
    node.scheduling = {
        "realtime_scheduling": granted(config.control_rt_priority > 0, rt_problem),
        "memory_locking": granted(config.control_lock_memory, lock_problem),
    }
    if rt_problem:
        node.get_logger().warning(f"control loop runs with normal scheduling: {rt_problem}")
    if lock_problem:
        node.get_logger().warning(f"control loop memory is not locked: {lock_problem}")
    quiet_interpreter()
    try:
        spin(node, make_executor(node.config.ros_executor, context), node.config.duration_s)
    except KeyboardInterrupt:
        pass
    finally:
        summary = node.status_values()
        node.close()
        rclpy.try_shutdown(context=context)
    return summary
