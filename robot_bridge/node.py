"""`vla-rl serve`: the ROS 2 node that streams a policy's actions to a robot at the control rate.

One thread runs every callback (subscriptions, timers), so a control tick never waits on a lock.
`PolicyBridge` is the ROS glue around four parts, each with one job and no ROS import of its own:

- `robot_bridge.inputs.BridgeInputs`: subscriptions, the newest joint state, images and
  instruction, decoded by `robot_bridge.codec` and checked on arrival;
- `robot_bridge.hold.Hold`: whether a tick may send the policy's action or must hold and why
  (e-stop, loading, rejected or stale input, policy error), the watchdog, and the `SafetyFilter`;
- `robot_bridge.chunk_scheduler.ChunkScheduler`: the inference worker (its own process by
  default), the in-flight request, and the `vla_core.runtime.ActionChunkExecutor` chunks merge into;
- `robot_bridge.diagnostics.BridgeDiagnostics`: counters, latencies and the /diagnostics report;
- `robot_bridge.description.DescriptionSource`: the robot description (a URDF file, the
  /robot_description topic, or the simulated Panda's) and how the policy's actions map onto it;
- `robot_bridge.trajectory.TrajectoryPlanner` (``output=trajectory``): each merged chunk as joint trajectories.

Control tick (one per arriving joint state with ``clock=joint_states``, at most ``control_hz`` a
second, else one per timer period): pass the action prepared for this step through the safety filter and publish it. Only
then, off the latency path: the scheduler merges any chunk that came back, asks for the next one
when due, and takes the next step's action from the executor.

Hold: the node publishes the previous command (the measured position before any command) whenever
it cannot trust the next action, and names the cause on /diagnostics and in its log. Entering a
hold discards the queued plan and any chunk still in flight, so the robot never resumes a plan
made before it stopped. The e-stop latches: ``True`` on the estop topic holds until ``False``. A
fault that repeats with every message is logged at most once a second per cause (`LogLimiter`);
the exact counts, per cause, are on /diagnostics (``rejected_<kind>``, ``invalid_chunks``, ...).

Commands, ``output=ticks``: JointTrajectory with ``joint_names = action_names`` and one point (the
command, ``time_from_start`` = one period); ``header.stamp`` is the stamp of the newest joint state the
command was computed with. Delta actions are integrated against the last command, never
re-anchored on the measured state. ``output=trajectory``: after each merge, one JointTrajectory over the
arm's joints and one over the gripper's (`robot_bridge.trajectory`: the seam, the stamps, the IK); a
tick publishes only while holding (the held setpoint, every tick).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import rclpy
import rclpy.executors
import torch
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.experimental import EventsExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import Float64MultiArray, String

from robot_bridge import codec, topics
from robot_bridge.chunk_scheduler import ChunkScheduler
from robot_bridge.commanders import CommanderWatch, Endpoint
from robot_bridge.config import ServeConfig, apply_overrides, flat_fields
from robot_bridge.description import ActionMapping, DescriptionSource, safety_limits
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.hold import Hold, TickBudget
from robot_bridge.inputs import BridgeInputs
from robot_bridge.log_limit import LogLimiter
from robot_bridge.qos_check import QosWatch, read_graph
from robot_bridge.scheduling import lock_memory, quiet_interpreter, use_realtime
from robot_bridge.trajectory import IKFailure, PlannedTrajectory, TrajectoryPlanner
from vla_core.renamed import RENAMED, renamed_line
from vla_core.robot import RobotDescription
from vla_core.types import Policy

LIST_PARAMETER_TYPES = {
    "list[float]": Parameter.Type.DOUBLE_ARRAY,
    "list[int]": Parameter.Type.INTEGER_ARRAY,
    "list[str]": Parameter.Type.STRING_ARRAY,
    "list[bool]": Parameter.Type.BOOL_ARRAY,
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
    seam: bool  # the first command of a merged chunk (chunking.lead_steps after the step after its merge)
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
        logger = self.get_logger()
        self.log_limiter = LogLimiter(self._log_line, period_s=1.0, clock=log_clock)
        self.diagnostics = BridgeDiagnostics()
        self.inputs = BridgeInputs(cfg, self.diagnostics, self.log_limiter, logger.info, self._on_joint_state,
                                   clock_now=lambda: self.get_clock().now().nanoseconds * 1e-9)  # fmt: skip
        self.tick_budget = TickBudget(cfg.control_hz)
        self._create_publishers()
        self.scheduler = ChunkScheduler(
            cfg, load_policy, self.inputs, self.diagnostics, self.log_limiter, logger, self._publish_chunk
        )
        self.robot = DescriptionSource(cfg, self.diagnostics, self.log_limiter, self._on_description)
        self.commanders = self._commander_watch()
        self.qos_watch = QosWatch([])  # its endpoints read from the node at each check
        self.hold = Hold(cfg, self.period, self.inputs, self.scheduler, self.diagnostics, self.log_limiter, logger,
                         self.robot, self.commanders)  # fmt: skip
        self.planner: TrajectoryPlanner | None = None  # output=trajectory, once the description is known
        self._arm_in_state: list[int] = []  # where the arm joints are in the joint state (output=trajectory)
        self._tick_step, self._tick_ns = -1, 0  # the step of the latest tick and its time (ns, this node's clock)
        fallback = self.robot.start()
        if fallback:
            logger.info(fallback)
        if self.inputs.unchecked_state:
            logger.warning(
                f"state entries {self.inputs.unchecked_state} have no plausibility bounds, so a sensor fault there "
                f"reaches the policy; give each a [low, high] under safety.state_bounds in the serve YAML"
            )
        self._create_subscriptions_and_timers()
        # The graph's answers (other commanders, QoS mismatches) are asked for off the control thread: a query is
        # about half a millisecond, up to a few on a loaded machine, which a tick must not wait for.
        self._closing = threading.Event()
        self._graph_watch = threading.Thread(target=self._watch_graph, name="vla-rl-graph-watch", daemon=True)
        self._graph_watch.start()
        logger.info(
            f"serving {cfg.checkpoint} at {cfg.control_hz:g} Hz ({cfg.clock} clock), merge={cfg.chunking.merge}, "
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
        fields = flat_fields(self.config)
        for old, (new, until) in RENAMED.items():  # a renamed field's old parameter name, for one release
            if new not in fields or old in fields:
                continue
            param = self.declare_parameter(old, None, ParameterDescriptor(dynamic_typing=True))
            if param.type_ != Parameter.Type.NOT_SET:
                self.get_logger().warning(renamed_line(old, new, until))
                overrides[new] = param.value
        apply_overrides(self.config, overrides)

    def _qos(self, sensor: bool, command: bool = False) -> QoSProfile:
        """Sensors: the configured reliability, durability and depth; commands (``command``: the configured
        durability) and reports: reliable."""
        q = self.config.qos
        if sensor:
            durability = {"volatile": DurabilityPolicy.VOLATILE, "transient_local": DurabilityPolicy.TRANSIENT_LOCAL}
            reliability = {"best_effort": ReliabilityPolicy.BEST_EFFORT, "reliable": ReliabilityPolicy.RELIABLE}
            return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=q.sensor_depth,
                              reliability=reliability[q.sensor_reliability], durability=durability[q.sensor_durability])  # fmt: skip
        latched = command and q.command_durability == "transient_local"
        # Latched commands keep only the last: a controller that (re)starts must not be replayed a queue of old ones.
        return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1 if latched else q.command_depth,
                          reliability=ReliabilityPolicy.RELIABLE,
                          durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)  # fmt: skip

    def _create_publishers(self) -> None:
        cfg, qos, report = self.config, self._qos(sensor=False, command=True), self._qos(sensor=False)
        # Dry run: the command topics do not exist at all, so nothing can reach the robot; each output has its own.
        per_tick = cfg.output == "ticks" and not cfg.dry_run
        self._trajectory_pub = (
            self.create_publisher(topics.JOINT_TRAJECTORY.message_class(), cfg.topics.joint_trajectory, qos)
            if per_tick else None
        )  # fmt: skip
        self._array_pub = None
        if cfg.publish_array and per_tick:
            self._array_pub = self.create_publisher(Float64MultiArray, cfg.topics.command_array, qos)
        self._arm_pub = self._gripper_pub = self._follow = None
        if cfg.output == "trajectory" and not cfg.dry_run:
            trajectory_type = topics.ARM_TRAJECTORY.message_class()
            self._gripper_pub = self.create_publisher(trajectory_type, cfg.topics.gripper_trajectory, qos)
            if cfg.trajectory_action:  # the arm's trajectories as action goals instead of on the topic
                from robot_bridge.follow_joint_trajectory import FollowJointTrajectoryClient

                self._follow = FollowJointTrajectoryClient(self, cfg.trajectory_action, self.diagnostics,
                                                           self.log_limiter)  # fmt: skip
            else:
                self._arm_pub = self.create_publisher(trajectory_type, cfg.topics.arm_trajectory, qos)
        self._chunk_pub = self.create_publisher(String, cfg.topics.chunk_info, report)
        self._diagnostics_pub = self.create_publisher(
            topics.DIAGNOSTICS.message_class(), cfg.topics.diagnostics, report
        )
        self._period_msg = codec.duration_msg(self.period)

    def _commander_watch(self) -> CommanderWatch:
        """The watch over this node's command topics (per-tick commands, the arm's and gripper's trajectories;
        not the FollowJointTrajectory action, whose goals are no topic's messages)."""
        own: dict[str, int] = {}
        for pub in (self._trajectory_pub, self._array_pub, self._arm_pub, self._gripper_pub):
            if pub is not None:
                own[pub.topic_name] = own.get(pub.topic_name, 0) + 1
        return CommanderWatch(Endpoint(self.get_name(), self.get_namespace()), own)

    def _watch_graph(self) -> None:
        """Graph-watch thread: the other commanders and the QoS mismatches, at the diagnostics rate, until close."""
        while not self._closing.is_set():
            try:
                self._check_commanders()
                self._check_qos()
            except Exception as err:  # noqa: BLE001 (the node's context shut down under it: nothing left to watch)
                if not self._closing.is_set() and self.context.ok():
                    self.log_limiter("graph watch", "warning", f"could not read the ROS graph: {err}")
            self._closing.wait(1.0 / self.config.diagnostics_hz)

    def _check_qos(self) -> None:
        """Ask the graph for the QoS of every peer on this node's topics; a change of the mismatches is logged."""
        cfg = self.config
        resolve = self.resolve_topic_name  # the graph names topics resolved (namespace, remaps)
        commands = {resolve(t) for t in (cfg.topics.joint_trajectory, cfg.topics.command_array, cfg.topics.arm_trajectory,
                                         cfg.topics.gripper_trajectory)}  # fmt: skip
        sensors = {resolve(t) for t in (cfg.topics.joint_states, *cfg.topics.more_joint_states,
                                         *(c.topic for c in cfg.cameras))}  # fmt: skip

        def settings(topic: str, direction: str) -> tuple[tuple[str, str], ...]:
            if topic in commands and direction == "publish":
                return (("durability", "qos.command_durability"),)
            if topic in sensors and direction == "subscribe":
                return ("reliability", "qos.sensor_reliability"), ("durability", "qos.sensor_durability")
            return ()

        endpoints, peers = read_graph(self, settings)
        self.qos_watch.endpoints = endpoints
        if self.qos_watch.update(peers):
            line = self.qos_watch.describe()
            if line:
                self.log_limiter("qos " + line, "warning", f"incompatible QoS, these endpoints never connect: {line}")
            else:
                self.log_limiter("qos", "info", "no incompatible QoS on this node's topics any more")

    def _check_commanders(self) -> None:
        """Ask the graph who publishes on the command topics; a change is logged once."""
        graph = {t: [Endpoint(i.node_name, i.node_namespace) for i in self.get_publishers_info_by_topic(t)]
                 for t in self.commanders.topics}  # fmt: skip
        if self.commanders.update(graph):
            line = self.commanders.describe()
            if line:
                rule = "holding until it is gone" if self.config.other_commanders == "hold" else "commanding beside it"
                self.log_limiter("commanders " + line, "warning", f"another node commands the robot ({line}): {rule}")
            else:
                self.log_limiter("commanders", "info", "no other node publishes on the command topics any more")

    def _create_subscriptions_and_timers(self) -> None:
        cfg = self.config
        self.inputs.subscribe(self, self._qos(sensor=True), self._qos(sensor=False))
        self.create_subscription(topics.ESTOP.message_class(), cfg.topics.estop, self.hold.on_estop,
                                 self._qos(sensor=False))  # fmt: skip
        if cfg.topics.robot_description and not cfg.robot_description:
            # robot_state_publisher's QoS: reliable, transient local, so the URDF published before we started arrives.
            latched = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                 durability=DurabilityPolicy.TRANSIENT_LOCAL)  # fmt: skip
            self.create_subscription(topics.ROBOT_DESCRIPTION.message_class(), cfg.topics.robot_description,
                                     self.robot.on_message, latched)  # fmt: skip
        if cfg.clock == "timer":
            self._next_scheduled = time.monotonic() + self.period
            self.create_timer(self.period, self._on_timer)
        else:
            # Without joint states there are no ticks: this watchdog keeps commanding the hold.
            self.create_timer(self.period, self._on_watchdog)
        self.create_timer(1.0 / cfg.diagnostics_hz, self.publish_diagnostics)

    # -- control ---------------------------------------------------------------------------------

    def _on_joint_state(self, arrival: float) -> None:
        """With ``clock=joint_states`` every joint state, accepted or not, ticks the control loop, at most
        ``control_hz`` times a second (`TickBudget`); the rest count as ``excess_states``."""
        if self.config.clock != "joint_states":
            return
        if not self.tick_budget.allow(arrival):
            self.diagnostics.count("excess_states")
            return
        self.hold.state_ticked(arrival)
        self._control_tick(scheduled=arrival)

    def _on_timer(self) -> None:
        now = time.monotonic()
        late = now - self._next_scheduled
        if late > self.period:  # whole periods lost (the process was starved): each is a missed command
            skipped = int(late // self.period)
            self.diagnostics.count("missed_deadlines", skipped)
            self._next_scheduled += skipped * self.period
        scheduled = self._next_scheduled
        self._next_scheduled += self.period
        self._control_tick(scheduled)

    def _on_watchdog(self) -> None:
        now = time.monotonic()
        if self.hold.watchdog_due(now):
            self._control_tick(scheduled=now)

    def _control_tick(self, scheduled: float) -> None:
        now = time.monotonic()
        plan = self.scheduler
        new_episode = plan.start_episode_if_due()  # the robot's next episode (topics.episode) starts at this state
        if new_episode:
            self.hold.start_episode()
        self._tick_step, self._tick_ns = plan.next_step, self._tick_time_ns()
        cause_key, cause = self.hold.check(now)
        target = plan.next_target if cause is None else None
        if self.config.output == "ticks":
            if cause is None and plan.low_latency is not None:  # the part acts on this tick's freshest inputs
                target = plan.low_latency_target(target, self.hold.hold_target())
            command = self.hold.command(target)
            if command is not None:
                self._publish_command(command)
        else:
            command = self._trajectory_tick(cause, new_episode, target)
        published = time.monotonic()
        # Everything below runs after the command went out.
        if self.hold.update(cause_key, cause):
            self.publish_diagnostics()
        self.diagnostics.count("ticks")
        if published - scheduled > self.config.deadline_ms / 1e3:
            self.diagnostics.count("missed_deadlines")
        if self.on_tick is not None:
            record = TickRecord(
                plan.next_step, scheduled, published, command, cause is None and plan.next_target is not None,
                self.hold.state, plan.next_is_seam, self.inputs.state_time if self.inputs.state is not None else 0.0,
            )  # fmt: skip
            self.on_tick(record)
        if plan.next_is_seam:
            self.diagnostics.obs_to_command_ms.append((published - plan.seam_obs_arrival) * 1e3)
        plan.prepare_next_action(cause, now)
        # Between the robot's episodes nothing goes out (the planner is anchored on the ended one).
        if plan.merged_plan is not None and self.planner is not None and self.planner.anchored \
                and self.inputs.ended_episode is None:  # fmt: skip
            self._send_plan(*plan.merged_plan)
        after_command = time.monotonic() - published
        self.diagnostics.after_command_max_ms = max(self.diagnostics.after_command_max_ms, after_command * 1e3)
        if after_command > self.period:
            self.diagnostics.count("overrun_ticks")

    def _tick_time_ns(self) -> int:
        """This tick's time, ns: with ``clock=joint_states`` the stamp of the joint state that ticked it (the
        robot's time of that step, so a trajectory's points land on the robot's control instants without the
        transport's jitter; the robot's and this node's clocks agree, see ``safety.future_stamp_tolerance_s``),
        else this node's clock now."""
        if self.config.clock == "joint_states" and self.inputs.state_stamp is not None:
            return codec.stamp_ns(self.inputs.state_stamp)
        return self.get_clock().now().nanoseconds

    # -- trajectory output -----------------------------------------------------------------------

    def _on_description(self, description: RobotDescription, mapping: ActionMapping, given: bool) -> None:
        """A robot description was accepted. One given (file or topic): the safety limits the config leaves empty
        become its own and its joints' limits bound the state (the simulated Panda's default leaves the config's
        limits as they are). Trajectory output plans on it."""
        cfg = self.config
        if given:
            low, high, velocity = safety_limits(description, cfg)
            self.hold.set_limits(low, high, velocity)
            self.inputs.set_state_bounds(description.state_bounds)
        else:
            s = cfg.safety
            low, high, velocity = s.position_min, s.position_max, s.max_velocity
        if cfg.output == "trajectory":
            self.planner = TrajectoryPlanner(description, mapping, self.period, cfg.ik_tolerance, low, high, velocity,
                                             cfg.safety.max_acceleration, delta=cfg.action_mode == "delta")  # fmt: skip
            self._arm_in_state = [cfg.state_names.index(n) for n in mapping.arm_joints]
        how = "end-effector targets solved to" if mapping.end_effector else "joint actions on"
        grip = f", grip on {list(mapping.gripper_joints)}" if mapping.gripper_joints else ""
        self.get_logger().info(f"robot {description.name!r}: {how} joints {list(mapping.arm_joints)}{grip}")

    def _trajectory_tick(self, cause: str | None, new_episode: bool, target: np.ndarray | None) -> np.ndarray | None:
        """``output=trajectory``: anchor the planner on the measured state (the first one, and each episode's), and
        while holding publish the held setpoint, stamped now and reached ``safety.stale_after_s`` later (at least a
        period): the point is where the controller already is, and a robot that reads it late (a loaded machine)
        must not find it in the past and reject it. With a low-latency part, a tick that does not hold sends the
        part's correction of ``target`` (the queue's action of this tick's step; None: the queue ran dry, and the
        part corrects the sent trajectory's point of this step) as the next point (`_send_correction`). Returns the action
        the controller executes at this tick's step (None before the description and a joint state are in)."""
        planner = self.planner
        if planner is None or self.inputs.state is None:
            return None
        if self.inputs.ended_episode is not None:
            # The robot's episode ended and it resets (topics.episode): a hold of the ended episode's setpoint reaching
            # it after its reset would pull the arm back there. Nothing until the next episode's first state.
            return None
        if new_episode or not planner.anchored:
            planner.anchor(self.hold.measured_command(), self.inputs.state[self._arm_in_state])
        if cause is None:
            planner.release()
            if self.scheduler.low_latency is not None:
                self._send_correction(target if target is not None else planner.action_at(self._tick_step))
            return planner.action_at(self._tick_step)
        held = planner.hold(self._tick_step)
        lead = max(self.period, self.config.safety.stale_after_s)
        self._publish_trajectory(held, self.get_clock().now().nanoseconds, lead)
        return held.actions[0].copy()

    def _send_correction(self, base: np.ndarray) -> None:
        """The low-latency part's correction of ``base`` (A,) as the trajectory from this tick's step on, stamped
        with this tick's time: its point 0 is reached one period later, as the per-tick command of the step would
        be, and the sent plan's later points follow it (the controller runs them if later ticks are lost). When the
        part cannot act, or the IK does not reach the corrected point, nothing is sent: the trajectory sent before
        runs on uncorrected (counted in ``low_latency_fallbacks``)."""
        corrected = self.scheduler.low_latency_correction(base)
        if corrected is None:
            return
        result = self.planner.correct(self._tick_step, corrected)
        if isinstance(result, IKFailure):
            self.scheduler.low_latency_fell_back(
                f"the corrected point is out of the IK's reach: {result.line(self.config.ik_tolerance)}"
            )
            return
        self._publish_trajectory(result, self._tick_ns)

    def _send_plan(self, first_step: int, actions: np.ndarray) -> None:
        """The merged plan (P, A) from ``first_step`` as trajectories, stamped with the tick time of that step;
        not sent when a waypoint is out of the IK's reach (counted, logged once a second: the previous runs on)."""
        # The points from the step before this tick's on stay known: the controller runs them until the plan's first
        # step, and a low-latency part corrects them at their ticks (its seam's velocity reads the step before).
        result = self.planner.plan(first_step, actions, keep_from=self._tick_step - 1)
        if result is None:
            return
        if isinstance(result, IKFailure):
            # The executor forgets the plan the controller never got: the next request's committed prefix and
            # guidance must not describe it. The controller runs the previous trajectory to its end.
            self.scheduler.discard_plan(first_step)
            line = result.line(self.config.ik_tolerance)
            self.diagnostics.count("ik_failures")
            self.diagnostics.last_error = line
            self.log_limiter("ik failure", "warning", line)
            return
        self.diagnostics.count("trajectories")
        self.diagnostics.count("velocity_limited_points", result.limited_points)
        self._publish_trajectory(result, self._tick_ns + round((first_step - self._tick_step) * self.period * 1e9))

    def _publish_trajectory(self, trajectory: PlannedTrajectory, stamp_ns: int, first_s: float | None = None) -> None:
        """The arm's and the gripper's trajectory, stamped ``stamp_ns``, point 0 reached ``first_s`` after it (a
        period by default), the next a period apart."""
        if self._arm_pub is None and self._follow is None:  # dry run
            return
        # A topic takes the serialized message, built with numpy: message objects would cost the control core
        # milliseconds of a long chunk's two-period budget (`codec.trajectory_points_cdr`). The action client
        # sends a goal, which needs the message.
        if self._follow is not None:
            arm_msg = codec.trajectory_points_msg(list(trajectory.arm_joints), trajectory.arm,
                                                  codec.time_msg(stamp_ns), self.period, first_s)  # fmt: skip
            self._follow.send(arm_msg)
        else:
            self._arm_pub.publish(
                codec.trajectory_points_cdr(list(trajectory.arm_joints), trajectory.arm, stamp_ns, self.period, first_s)
            )
        if trajectory.gripper_joints:
            self._gripper_pub.publish(codec.trajectory_points_cdr(list(trajectory.gripper_joints), trajectory.gripper,
                                                                  stamp_ns, self.period, first_s))  # fmt: skip

    def _publish_command(self, command: np.ndarray) -> None:
        if self._trajectory_pub is None:
            return
        self._trajectory_pub.publish(
            codec.trajectory_msg(command, self.config.action_names, self.inputs.state_stamp, self._period_msg)
        )
        if self._array_pub is not None:
            self._array_pub.publish(Float64MultiArray(data=command.tolist()))

    def _publish_chunk(self, info: dict[str, Any]) -> None:
        self._chunk_pub.publish(String(data=json.dumps(info)))

    # -- diagnostics -----------------------------------------------------------------------------

    def status_values(self) -> dict[str, str]:
        """Everything /diagnostics reports, as text: the state and its cause, latencies, counters."""
        live = {
            "queue_depth": str(self.scheduler.queue_depth()),
            "delay_steps": str(self.scheduler.delay_steps),
            "stale_inputs": ", ".join(self.inputs.stale(time.monotonic())),
            "instruction": self.inputs.instruction,
            "dry_run": str(self.config.dry_run),
            "other_commanders": self.commanders.describe(),
            "qos_mismatches": self.qos_watch.describe(),
        }
        return self.diagnostics.values(self.hold.state, self.hold.cause, live)

    def publish_diagnostics(self) -> None:
        stamp = self.get_clock().now().to_msg()
        warnings = [f"incompatible QoS: {self.qos_watch.describe()}"] if self.qos_watch.problems else []
        if self.commanders.others and self.config.other_commanders == "warn":
            warnings.insert(0, f"other commanders: {self.commanders.describe()}")
        msg = self.diagnostics.message(self.hold.state, self.hold.cause, self.status_values(), self.get_name(), stamp,
                                       "; ".join(warnings))  # fmt: skip
        self._diagnostics_pub.publish(msg)

    def close(self) -> None:
        self._closing.set()
        self._graph_watch.join(timeout=5.0)
        self.scheduler.close()
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
    node.diagnostics.scheduling = {
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
