"""`vla-rl sim-robot`: one world of a MuJoCo task run as a ROS 2 robot, for demos and closed-loop tests.

The world is a `sim.mujoco_env.MujocoBatchedEnv` with one world, so physics, reset distribution,
IK and success are exactly the training task's, and seed s gives the episodes of a batched env
reset with seed s; with ``eval_worlds=N`` episode e starts instead where `vla-rl eval --seed=s
--env.num_envs=N` starts its episode e (world e % N of the round reset with seed s + e // N), so
each episode of the robot has a twin in simulation (`vla-rl bench robot-parity`). Each control step
publishes one observation, all stamped alike:

- ``/camera/<camera>/image_raw`` sensor_msgs/Image rgb8 (H, W, 3), one per camera of the env
  config, and ``.../compressed`` (png) with ``compressed_images=true``, encoded by `robot_bridge.codec`;
- ``/joint_states`` sensor_msgs/JointState: ``name`` = the env's state names (`sim.arm.STATE_NAMES`), ``position`` =
  ``observation.state`` (11,), ``velocity`` = the rates of the same 11 quantities;
- ``/sim_robot/episode`` std_msgs/String JSON ``{"episode", "step", "tick", "success", "done",
  "stamp_ns"}``: where the robot stands at ``stamp_ns``. That is the stamp of the observation
  published with it, or, when ``done``, of the episode's final state (not published: the next
  observation is the first of the next episode, as in the batched env).

``/instruction`` std_msgs/String carries the task's instruction at each episode start (transient
local, so late subscribers get it); ``/diagnostics`` reports commands received and rejected, why,
whether the command is stale, and the real-time factor reached.

Commands (``input=ticks``, the default): ``/command/joint_trajectory`` trajectory_msgs/JointTrajectory
whose ``joint_names`` are `sim.arm.ACTION_NAMES` in any order (the first point is the next step's action),
or ``/command/array`` std_msgs/Float64MultiArray in ACTION_NAMES order. See :class:`CommandGate` for what
is rejected and what the robot holds meanwhile.

Trajectories (``input=trajectory``), as a ros2_control robot with a joint_trajectory_controller per
group takes them (`vla-rl serve --output=trajectory` sends them): ``/arm_controller/joint_trajectory``
over the arm's joints (`sim.arm.ARM_JOINTS`, any order) and ``/gripper_controller/joint_trajectory``
over the fingers' (`sim.arm.FINGER_JOINTS`), each interpolated at the physics rate (every substep) and
replaced at the new one's start time by `robot_bridge.trajectory_follower.TrajectoryFollower`, which drives
the servos directly (`MujocoBatchedEnv.step_servo_targets`, no IK). Before the first trajectory of an
episode the arm holds where it is. The summary and /diagnostics report the joints' tracking error (RMS
and max, rad) and ``starved_ticks``: control ticks that started after the trajectory in force had run
out. A trajectory that is malformed, ends in the past or is stamped before its episode began is
rejected and counted as a command is.

Topic names and types are those of `robot_bridge.topics`, the table `serve`, `record-ros` and `convert`
use too.

Between episodes a robot with ``episode_gap_s`` publishes nothing for that long, as a real robot
resetting would (a server answers the inference still in flight meanwhile), and with
``wait_for_controller`` it starts its first episode only once a node subscribes to its joint states
and publishes commands. ``episode_log`` records each finished episode (its outcome, length and
initial state), one JSON line each.

The simulated robot composes the simulator and the bridge, so it lives with the commands: like
every command module it imports `robot_bridge` (and through it ROS) only inside its functions.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Literal, get_args

import numpy as np

from sim.config import EnvConfig
from vla_core.types import ACTION, OBS_STATE, image_key

CommandInput = Literal["ticks", "trajectory"]

FINAL_DELIVERY_TIMEOUT_S = 5.0  # how long a stopping robot waits for subscribers to acknowledge its last messages


@dataclass
class SimRobotConfig:
    """Run one simulated world of a task as a ROS 2 robot node (joint states and images out, commands in)."""

    env: EnvConfig = field(
        default_factory=lambda: EnvConfig(num_envs=1)
    )  # the simulated task (one world: env.num_envs is ignored)
    seed: int = 0  # seed of the episodes' initial states: the same seed replays the same episodes
    sync: bool = (
        False  # lock-step: one control step per received command (deterministic tests); else a wall-clock timer
    )
    realtime_factor: float = 1.0  # simulated seconds per wall second of the control timer (without sync)
    command_timeout_s: float = (
        0.5  # a command this old (wall seconds since it arrived) is stale: the arm holds position
    )
    compressed_images: bool = False  # also publish /camera/<camera>/image_raw/compressed (png)
    max_episodes: int = 0  # exit after this many episodes; 0 = run until Ctrl-C
    diagnostics_period_s: float = 1.0  # seconds between /diagnostics reports (rejections report at once too)
    sync_republish_s: float = (
        0.5  # with sync, republish the waiting observation this often, freshly stamped, for late subscribers
    )
    node_name: str = "sim_robot"  # ROS 2 node name
    # > 0: episode e starts where `vla-rl eval --seed=<seed> --env.num_envs=<eval_worlds>` starts its episode e
    # (world e % eval_worlds of the round reset with seed + e // eval_worlds); 0: the episodes follow each other
    # on one stream (a batched env's world 0 under autoreset)
    eval_worlds: int = 0
    # seconds with nothing published between episodes (and before the first, with wait_for_controller), as a
    # robot resetting; a server answers its inference in flight meanwhile. Real time only (not with sync).
    episode_gap_s: float = 0.0
    # publish nothing until a node subscribes to the joint states and publishes commands (the server): no
    # episode starts before anyone listens
    wait_for_controller: bool = False
    episode_log: str = ""  # JSON lines, one per finished episode: episode, success, length, initial state; "" = none
    # ticks: a command per control step (/command/joint_trajectory or /command/array, the action); trajectory:
    # whole joint trajectories for the arm and the gripper, followed at the physics rate, as a ros2_control
    # robot's joint_trajectory_controller does (`vla-rl serve --output=trajectory`). Real time only.
    input: CommandInput = "ticks"


def episode_seed(cfg: SimRobotConfig, episode: int):
    """The reset seed of the robot's episode ``episode``: with ``eval_worlds`` N, the stream of world e % N of a
    batch reset with seed + e // N (`sim.config.batch_world_seed`), where `vla-rl eval` runs its episode e;
    else ``seed`` for the first and None after it (the stream goes on, as an autoreset's)."""
    from sim.config import batch_world_seed

    if cfg.eval_worlds:
        return [batch_world_seed(cfg.seed + episode // cfg.eval_worlds, episode % cfg.eval_worlds)]
    return cfg.seed if episode == 0 else None


class CommandGate:
    """Turns command messages into the action of the next control step, rejecting bad ones.

    A command is rejected when its values are not finite, their number or names do not match the
    action names, it has no trajectory point, or its header stamp (when set) is older than the last
    accepted one or than ``timeout_s``. A rejected command is counted and leaves the last valid action
    in force; a valid action older than ``timeout_s`` (since it arrived) is stale, and so is no action
    at all: then :meth:`action` returns None and the robot holds position. Times are nanoseconds.
    """

    def __init__(self, action_names: list[str], timeout_s: float):
        self.action_names = list(action_names)
        self.timeout_ns = int(timeout_s * 1e9)
        self.received = 0
        self.rejected: Counter[str] = Counter()  # kind -> count
        self.last_rejection = ""  # why the latest rejected command was rejected
        self.last_rejected_ns = 0  # when it arrived
        self._action: np.ndarray | None = None  # (A,) the last valid action
        self._arrived_ns = 0
        self._last_stamp_ns = 0

    def offer(self, msg, now_ns: int) -> str | None:
        """A JointTrajectory (its first point is the action; its header stamp is checked when set) or a
        Float64MultiArray (in action order, unstamped); the rejection reason, or None when accepted."""
        from robot_bridge import codec
        from robot_bridge.codec import InputRejected

        self.received += 1
        try:
            action = codec.command_action(msg, self.action_names)
        except InputRejected as err:
            return self.reject(err.kind, str(err), now_ns)
        stamp_ns = codec.stamp_ns(msg.header.stamp) if hasattr(msg, "header") else 0
        if stamp_ns:
            if stamp_ns < self._last_stamp_ns:
                lag_ms = (self._last_stamp_ns - stamp_ns) / 1e6
                return self.reject("out_of_order", f"stamped {lag_ms:.1f} ms before the last accepted command", now_ns)
            if now_ns - stamp_ns > self.timeout_ns:
                return self.reject(
                    "stale", f"stamped {(now_ns - stamp_ns) / 1e9:.2f} s ago (limit {self.timeout_ns / 1e9} s)", now_ns
                )
            self._last_stamp_ns = stamp_ns
        self._action, self._arrived_ns = action, now_ns
        return None

    def action(self, now_ns: int) -> np.ndarray | None:
        """(A,) the action for the next step, or None to hold position (no command yet, or stale)."""
        return self._action if self.state(now_ns) == "fresh" else None

    def state(self, now_ns: int) -> str:
        """none (no valid command yet), fresh, or stale."""
        if self._action is None:
            return "none"
        return "fresh" if now_ns - self._arrived_ns <= self.timeout_ns else "stale"

    def age_s(self, now_ns: int) -> float:
        return (now_ns - self._arrived_ns) / 1e9

    def clear(self) -> None:
        """Forget the last action (at an episode start: commands for the previous episode no longer apply)."""
        self._action = None

    def reject(self, kind: str, reason: str, now_ns: int) -> str:
        """Count a rejected command (or trajectory) of ``kind``; returns the line that says why."""
        self.rejected[kind] += 1
        self.last_rejection, self.last_rejected_ns = f"{kind}: {reason}", now_ns
        return self.last_rejection


class SimRobot:
    """The node: an env of one world, its publishers and command subscriptions, and the control loop."""

    def __init__(self, cfg: SimRobotConfig, node, env):
        from rclpy.qos import DurabilityPolicy, QoSProfile
        from rclpy.task import Future

        from robot_bridge import topics

        self.cfg, self.node, self.env = cfg, node, env
        self.log = node.get_logger()
        # The names the robot speaks are the env's own (its LeRobot features), so a dataset recorded
        # from this robot and one recorded in simulation name their dimensions alike.
        self.state_names = list(env.features[OBS_STATE]["names"])
        self.gate = CommandGate(list(env.features[ACTION]["names"]), cfg.command_timeout_s)
        sensor_qos = 10  # keep-last depth; reliable, so best-effort and reliable subscribers both match
        latched = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL)

        def publisher(topic: topics.Topic, qos=sensor_qos):
            return node.create_publisher(topic.message_class(), topic.name, qos)

        self.joint_pub = publisher(topics.JOINT_STATES)
        self.image_pubs = {cam: publisher(topics.camera(cam)) for cam in env.config.cameras}
        compressed = env.config.cameras if cfg.compressed_images else []
        self.compressed_pubs = {cam: publisher(topics.camera(cam, compressed=True)) for cam in compressed}
        self.episode_pub = publisher(topics.EPISODE)
        self.instruction_pub = publisher(topics.INSTRUCTION, latched)
        self.diagnostics_pub = publisher(topics.DIAGNOSTICS)
        self.arm = self.gripper = None  # input=trajectory: the arm's and the gripper's trajectory followers
        commands = ((topics.JOINT_TRAJECTORY, self._on_trajectory), (topics.COMMAND_ARRAY, self._on_array))
        from robot_bridge.qos_check import QosWatch
        from robot_bridge.trajectory_follower import TrackingError, TrajectoryFollower

        if cfg.input == "trajectory":
            from sim.arm import ARM_JOINTS, FINGER_JOINTS

            self.arm, self.gripper = TrajectoryFollower(ARM_JOINTS), TrajectoryFollower(FINGER_JOINTS)
            commands = tuple((topic, partial(self._on_joint_trajectory, follower, topic.name))
                             for topic, follower in ((topics.ARM_TRAJECTORY, self.arm),
                                                     (topics.GRIPPER_TRAJECTORY, self.gripper)))  # fmt: skip
        self._command_subs = [node.create_subscription(topic.message_class(), topic.name, callback, 10)
                              for topic, callback in commands]  # fmt: skip
        self.tracking, self.starved_ticks = TrackingError(), 0  # input=trajectory: the arm's tracking, starvation
        self._episode_start_ns = 0  # the stamp of the current episode's first observation

        self.finished = Future()  # done after max_episodes episodes
        self.episode, self.step, self.tick = 0, 0, 0
        self.successes = 0
        self._last_stamp_ns = 0
        self._hold: np.ndarray | None = None  # (4,) latched when the arm starts holding position
        self._command_state = "none"
        self._logged_rejection: dict[str, float] = {}  # rejection kind -> monotonic time it was last logged
        self._step_seconds = 0.0  # wall seconds spent stepping and publishing
        self._started = time.monotonic()
        self._first_tick_wall: float | None = None  # monotonic start of the first and of the latest control step
        self._latest_tick_wall = 0.0
        self._waiting = cfg.wait_for_controller  # no node listens and commands yet: nothing is published
        self._resume_at: float | None = None  # between episodes: monotonic time the next one is published
        self._paused_s, self._pause_started = 0.0, 0.0  # wall seconds between episodes (left out of the
        # real-time factor), and when the current pause began
        self._episode_log = open(cfg.episode_log, "w") if cfg.episode_log else None  # noqa: SIM115 (closed in close)

        self.obs = env.reset(seed=episode_seed(cfg, 0))
        self._initial_state = self.obs[OBS_STATE][0].tolist()
        if cfg.wait_for_controller:
            node.create_timer(0.05, self._check_controller)
        else:
            self._begin_episode()
        if cfg.sync:
            node.create_timer(cfg.sync_republish_s, self._republish_if_idle)
        else:
            node.create_timer(env.control_dt / cfg.realtime_factor, self._control_step)
        self.qos_watch = QosWatch([], own="the robot")  # peers whose QoS never connects, asked at each report
        node.create_timer(cfg.diagnostics_period_s, self._publish_diagnostics)
        self._idle_since = time.monotonic()

    def _begin_episode(self) -> None:
        """Publish the new episode's instruction and first observation: from now on it runs. A command that
        came before (a server holding through the pause) was not computed from this episode: forgotten."""
        self.gate.clear()
        self._clear_trajectories()
        self._publish_instruction()
        self._publish_observation()
        self._episode_start_ns = self._last_stamp_ns

    def _check_controller(self) -> None:
        """While waiting for a controller: once a node subscribes to the joint states and one publishes
        commands, the first episode starts (after ``episode_gap_s``, for the server's side to match too)."""
        if not self._waiting:
            return
        if self.joint_pub.get_subscription_count() and any(sub.get_publisher_count() for sub in self._command_subs):
            self._waiting = False
            self._pause(time.monotonic())

    def _pause(self, start: float) -> None:
        """Publish the next episode ``episode_gap_s`` after ``start`` (at once without a gap)."""
        if self.cfg.episode_gap_s > 0:
            self._resume_at, self._pause_started = start + self.cfg.episode_gap_s, start
        else:
            self._begin_episode()

    def _paused(self) -> bool:
        """Whether this control step runs no step: waiting for a controller, or between episodes (the step
        that ends the pause publishes the episode's first observation)."""
        if self._waiting:
            return True
        if self._resume_at is None:
            return False
        now = time.monotonic()
        if now >= self._resume_at:
            self._resume_at = None
            self._paused_s += now - self._pause_started
            self._begin_episode()
        return True

    # -- commands ---------------------------------------------------------------------------

    def _on_trajectory(self, msg) -> None:
        from robot_bridge import topics

        self._after_command(topics.JOINT_TRAJECTORY.name, self.gate.offer(msg, self._now_ns()))

    def _on_array(self, msg) -> None:
        from robot_bridge import topics

        self._after_command(topics.COMMAND_ARRAY.name, self.gate.offer(msg, self._now_ns()))

    def _on_joint_trajectory(self, follower, topic: str, msg) -> None:
        """A trajectory for ``follower`` (the arm's or the gripper's): checked, then taken by the replacement rule
        (`robot_bridge.trajectory_follower`), or rejected and counted."""
        from robot_bridge import codec
        from robot_bridge.codec import InputRejected

        now = self._now_ns()
        self.gate.received += 1
        reason = None
        try:
            start, times, positions = codec.trajectory_points(msg, follower.joint_names)
        except InputRejected as err:
            reason = self.gate.reject(err.kind, str(err), now)
        else:
            if start and start < self._episode_start_ns:  # computed for the previous episode
                early_ms = (self._episode_start_ns - start) / 1e6
                reason = self.gate.reject("before_episode", f"stamped {early_ms:.1f} ms before this episode began", now)
            else:
                servos = self.env.data[0].ctrl
                current = (servos[:7] if follower is self.arm else servos[7:9]).copy()  # the setpoint in force
                why = follower.offer(start, times, positions, now, current)
                if why is not None:
                    kind, _, detail = why.partition(": ")
                    reason = self.gate.reject(kind, detail, now)
        self._after_command(topic, reason)

    def _held(self) -> str:
        """What the robot goes on with after a rejected command."""
        if self.arm is not None:
            return "the trajectory in force" if self.arm.active else "position"
        return "the last valid action" if self.gate.state(self._now_ns()) == "fresh" else "position"

    def _clear_trajectories(self) -> None:
        if self.arm is not None:
            self.arm.clear()
            self.gripper.clear()

    def _after_command(self, topic: str, reason: str | None) -> None:
        if reason is not None:
            kind, now = reason.split(":")[0], time.monotonic()
            if now - self._logged_rejection.get(kind, -math.inf) >= 1.0:  # each kind at most once a second
                self._logged_rejection[kind] = now
                self.log.warning(f"rejected command on {topic}: {reason}; holding {self._held()}")
            self._publish_diagnostics()
        if self.cfg.sync and not self.finished.done():
            self._control_step()

    # -- control ----------------------------------------------------------------------------

    def _control_step(self) -> None:
        """One control step with the gate's action (or holding position), then publish what follows."""
        import torch

        if self.finished.done() or self._paused():
            return
        start = time.monotonic()
        if self._first_tick_wall is None:
            self._first_tick_wall = start
        self._latest_tick_wall = start
        if self.arm is not None and self.arm.active:
            obs, _, terminated, truncated, info = self._follow_trajectories()
        else:
            action = self._action()
            obs, _, terminated, truncated, info = self.env.step(torch.from_numpy(action[None]))
        self.tick += 1
        self.step += 1
        done = bool(terminated[0] or truncated[0])
        success = bool(info["success"][0])
        if not done:  # hence not successful either: success terminates the episode
            self.obs = obs
            self._publish_observation()
        else:
            # The final state is not published (the env has already reset), but its status is.
            self._publish_status(success, done, self._next_stamp()[1])
            self.successes += success
            self.log.info(f"episode {self.episode} {'succeeded' if success else 'ended'} after {self.step} steps")
            self._log_episode(success)
            self.episode, self.step = self.episode + 1, 0
            self.gate.clear()
            self._clear_trajectories()
            self._hold = None
            if self.cfg.max_episodes and self.episode >= self.cfg.max_episodes:
                self.finished.set_result(True)
            else:
                seed = episode_seed(
                    self.cfg, self.episode
                )  # the autoreset drew from the old stream; eval's twin's instead
                self.obs = obs if seed is None else self.env.reset(seed=seed)
                self._initial_state = self.obs[OBS_STATE][0].tolist()
                self._pause(time.monotonic())
        self._step_seconds += time.monotonic() - start
        self._idle_since = time.monotonic()

    def _follow_trajectories(self):
        """One control step with the servos at the followers' setpoints, substep by substep (the fingers held
        where they are until the gripper's first trajectory); counts starvation and the tracking error."""
        env, servos = self.env, self.env.data[0].ctrl
        start = self._last_stamp_ns  # the stamp of the state this step starts from: the step's start time
        substeps = env.config.substeps
        step_ns = env.control_dt / self.cfg.realtime_factor * 1e9  # wall nanoseconds of one control step
        times = start + np.round(np.arange(1, substeps + 1) * step_ns / substeps).astype(np.int64)  # substeps' ends
        self.starved_ticks += self.arm.starved(start)
        arm = self.arm.setpoint(times)  # (substeps, 7)
        fingers = self.gripper.setpoint(times) if self.gripper.active else np.repeat(servos[None, 7:9], substeps, 0)
        result = env.step_servo_targets(np.concatenate([arm, fingers], axis=1)[None])
        measured = result[4]["final_obs"][OBS_STATE][0, :7].double().numpy()  # before an episode's reset
        self.tracking.add(measured, arm[-1])
        return result

    def _trajectory_report(self) -> dict:
        """input=trajectory: the arm's tracking error (rad) and the starved ticks; {} otherwise."""
        if self.arm is None:
            return {}
        return {"tracking_error_rms_rad": round(self.tracking.rms, 5),
                "tracking_error_max_rad": round(self.tracking.max, 5), "starved_ticks": self.starved_ticks}  # fmt: skip

    def _log_episode(self, success: bool) -> None:
        if self._episode_log is None:
            return
        record = {
            "episode": self.episode,
            "success": success,
            "length": self.step,
            "initial_state": self._initial_state,
        }
        if self.cfg.eval_worlds:  # where its twin runs in `vla-rl eval`
            record.update(eval_seed=self.cfg.seed + self.episode // self.cfg.eval_worlds,
                          eval_world=self.episode % self.cfg.eval_worlds)  # fmt: skip
        self._episode_log.write(json.dumps(record) + "\n")
        self._episode_log.flush()  # a killed robot keeps every episode it finished

    def close(self) -> None:
        if self._episode_log is not None:
            self._episode_log.close()

    def _action(self) -> np.ndarray:
        """(4,) the gate's action, or the pose latched when holding began; logs the transitions."""
        now = self._now_ns()
        state = self.gate.state(now)
        if state != self._command_state:
            if state == "stale":
                self.log.warning(
                    f"last command is {self.gate.age_s(now):.2f} s old (limit {self.cfg.command_timeout_s} s); holding position"
                )
            elif state == "fresh" and self._command_state == "stale":
                self.log.info("commands resumed")
            self._command_state = state
        action = self.gate.action(now)
        if action is not None:
            self._hold = None
            return action
        if self._hold is None:
            self._hold = self.env.hold_actions()[0].double().numpy()
        return self._hold

    def _republish_if_idle(self) -> None:
        """With sync, a waiting observation goes out again so subscribers that joined late see it."""
        running = not (self.finished.done() or self._waiting or self._resume_at is not None)
        if time.monotonic() - self._idle_since >= self.cfg.sync_republish_s and running:
            self._publish_observation()

    # -- publishing -------------------------------------------------------------------------

    def _next_stamp(self):
        """(builtin_interfaces/Time, ns) of now, strictly after the previous stamp, so each stamp names one state."""
        from robot_bridge import codec

        ns = max(self._now_ns(), self._last_stamp_ns + 1)
        self._last_stamp_ns = ns
        return codec.time_msg(ns), ns

    def _publish_observation(self) -> None:
        """Images, joint state and status of ``self.obs`` (mid-episode: not done, not successful), stamped alike."""
        from robot_bridge import codec

        stamp, ns = self._next_stamp()
        for cam, pub in self.image_pubs.items():
            frame = self.obs[image_key(cam)][0].permute(1, 2, 0).mul(255).round().byte().numpy()  # (H, W, 3)
            pub.publish(codec.image_msg(frame, stamp, cam))
            if cam in self.compressed_pubs:
                self.compressed_pubs[cam].publish(codec.compressed_image_msg(frame, stamp, cam))
        state = self.obs[OBS_STATE][0].numpy()
        self.joint_pub.publish(codec.joint_state_msg(self.state_names, state, self._state_rates(), stamp))
        self._publish_status(False, False, ns)

    def _state_rates(self) -> np.ndarray:
        """(11,) rates of the state quantities: 7 joint velocities, gripper opening rate, ee linear velocity."""
        import mujoco

        model, data = self.env.model, self.env.data[0]
        site_vel = np.zeros(6)  # [angular, linear] in the world frame
        mujoco.mj_objectVelocity(model, data, mujoco.mjtObj.mjOBJ_SITE, model.site("grasp").id, site_vel, 0)
        return np.concatenate([data.qvel[:7], [data.qvel[7] + data.qvel[8]], site_vel[3:]])

    def _publish_status(self, success: bool, done: bool, stamp_ns: int) -> None:
        from std_msgs.msg import String

        status = {"episode": self.episode, "step": self.step, "tick": self.tick, "success": success, "done": done,
                  "stamp_ns": stamp_ns}  # fmt: skip
        self.episode_pub.publish(String(data=json.dumps(status)))

    def _publish_instruction(self) -> None:
        from std_msgs.msg import String

        self.instruction_pub.publish(String(data=self.env.task.instruction))

    def _check_qos(self) -> str:
        """The graph's peers on this robot's topics whose QoS never connects (`robot_bridge.qos_check`), one line;
        a change is logged. Its own QoS is fixed (reliable, volatile; the instruction transient local): the peer
        is the one to change."""
        from robot_bridge.qos_check import read_graph

        try:
            endpoints, peers = read_graph(self.node, lambda topic, direction: ())
        except Exception as err:  # noqa: BLE001 (a graph query that fails must not stop the robot)
            return f"the ROS graph could not be read: {err}"
        self.qos_watch.endpoints = endpoints
        if self.qos_watch.update(peers) and self.qos_watch.problems:
            self.log.warning(f"incompatible QoS, these endpoints never connect: {self.qos_watch.describe()}")
        return self.qos_watch.describe()

    def _publish_diagnostics(self) -> None:
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

        now = self._now_ns()
        state = self.gate.state(now)
        recent_rejection = (
            self.gate.last_rejected_ns and now - self.gate.last_rejected_ns <= 1e9 * self.cfg.diagnostics_period_s
        )
        if recent_rejection:
            level, message = (
                DiagnosticStatus.WARN,
                f"rejected command ({self.gate.last_rejection}); holding {self._held()}",
            )
        elif state == "stale":
            level, message = (
                DiagnosticStatus.WARN,
                f"command stale ({self.gate.age_s(now):.2f} s old); holding position",
            )
        elif self.arm is not None:  # input=trajectory
            state = "none" if not self.arm.active else "ended" if self.arm.starved(now) else "following"
            level, message = {"none": (DiagnosticStatus.OK, "no trajectory yet; holding position"),
                              "ended": (DiagnosticStatus.WARN, "the trajectory ran out; holding its last point"),
                              "following": (DiagnosticStatus.OK, "following the trajectory")}[state]  # fmt: skip
        elif state == "none":
            level, message = DiagnosticStatus.OK, "no command yet; holding position"
        else:
            level, message = DiagnosticStatus.OK, "following commands"
        mismatches = self._check_qos()
        if mismatches:  # a peer that never connects: at least WARN, named with its fix
            level, message = max(level, DiagnosticStatus.WARN), f"{message}; incompatible QoS: {mismatches}"
        values = {
            "command_state": state,
            "commands_received": self.gate.received,
            "commands_rejected": sum(self.gate.rejected.values()),
            **{f"rejected_{kind}": n for kind, n in sorted(self.gate.rejected.items())},
            "last_rejection": self.gate.last_rejection,
            "episode": self.episode,
            "step": self.step,
            "successes": self.successes,
            "realtime_factor": f"{self.realtime_factor():.3f}",
            "step_ms_mean": f"{1e3 * self._step_seconds / max(1, self.tick):.2f}",
            **self._trajectory_report(),
            "qos_mismatches": mismatches,
        }
        status = DiagnosticStatus(level=level, name=f"{self.cfg.node_name}: commands", message=message,
                                  hardware_id=self.cfg.node_name,
                                  values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])  # fmt: skip
        report = DiagnosticArray(status=[status])
        report.header.stamp = self.node.get_clock().now().to_msg()
        self.diagnostics_pub.publish(report)

    # -- summary ----------------------------------------------------------------------------

    def realtime_factor(self) -> float:
        """Simulated seconds per wall second between the starts of the first and the latest control step."""
        if self._first_tick_wall is None or self.tick < 2:
            return 0.0
        running = self._latest_tick_wall - self._first_tick_wall - self._paused_s
        return (self.tick - 1) * self.env.control_dt / max(1e-9, running)

    def summary(self) -> dict:
        return {
            "steps": self.tick,
            "episodes_done": self.episode,
            "successes": self.successes,
            "commands_received": self.gate.received,
            "commands_rejected": dict(self.gate.rejected),
            "input": self.cfg.input,
            **self._trajectory_report(),
            "realtime_factor": round(self.realtime_factor(), 3),
            "step_ms_mean": round(1e3 * self._step_seconds / max(1, self.tick), 2),
            "wall_s": round(time.monotonic() - self._started, 1),
        }

    def deliver_pending(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` in all until every subscriber has acknowledged what was published.

        The episode's final status goes out just before the node is destroyed; destroying a reliable
        publisher drops whatever a loaded machine has not yet delivered, so a client waiting for that
        status would wait for ever. True when everything was acknowledged in time.
        """
        from rclpy.duration import Duration

        end = time.monotonic() + timeout_s
        delivered = True
        for pub in self.node.publishers:
            left = max(0.0, end - time.monotonic())
            delivered &= pub.wait_for_all_acked(Duration(nanoseconds=int(left * 1e9)))
        if not delivered:
            self.log.warning(f"some messages were not acknowledged by every subscriber within {timeout_s} s")
        return delivered

    def _now_ns(self) -> int:
        return self.node.get_clock().now().nanoseconds


def run_sim_robot(cfg: SimRobotConfig) -> dict:
    """Run the node until ``max_episodes`` episodes are done or Ctrl-C; returns a summary dict."""
    import rclpy
    from rclpy._rclpy_pybind11 import RCLError
    from rclpy.executors import ExternalShutdownException

    from sim.factory import make_env

    if cfg.env.backend != "cpu":
        raise ValueError(
            f"the sim robot runs on the cpu backend, got env.backend={cfg.env.backend!r}; pass --env.backend=cpu"
        )
    if cfg.realtime_factor <= 0:
        raise ValueError(f"realtime_factor must be positive, got {cfg.realtime_factor}")
    if cfg.eval_worlds < 0 or cfg.episode_gap_s < 0:
        raise ValueError(f"eval_worlds and episode_gap_s must be >= 0, got {cfg.eval_worlds}, {cfg.episode_gap_s}")
    if cfg.sync and cfg.episode_gap_s:
        raise ValueError(
            "episode_gap_s pauses a real-time robot; with --sync=true the robot waits for commands: drop one"
        )
    if cfg.input not in get_args(CommandInput):
        raise ValueError(f"input={cfg.input!r} is not one of {get_args(CommandInput)}; pass --input=ticks")
    from sim.tasks import instruction_changes

    if instruction_changes(cfg.env.task):
        raise ValueError(f"the sim robot publishes one instruction per run, and {cfg.env.task}'s changes mid-episode "
                         "(not supported yet): pick a task whose instruction stays")  # fmt: skip
    if cfg.sync and cfg.input == "trajectory":
        raise ValueError("a trajectory runs on the robot's clock, not one step per command: with --input=trajectory "
                         "drop --sync=true")  # fmt: skip
    # One world whatever env.num_envs says: the node is one robot.
    env = make_env(replace(cfg.env, num_envs=1))
    if cfg.input == "trajectory" and not hasattr(env, "step_servo_targets"):
        env.close()
        raise ValueError(f"--input=trajectory drives the arm's servos at the physics rate, which only the MuJoCo CPU "
                         f"suite offers (got {type(env).__name__}); pass --env.backend=cpu with a suite task, or "
                         f"--input=ticks")  # fmt: skip
    rclpy.init()
    node = rclpy.create_node(cfg.node_name)
    robot = None
    try:
        robot = SimRobot(cfg, node, env)
        mode = "lock-step (one step per command)" if cfg.sync else f"{cfg.realtime_factor}x real time"
        node.get_logger().info(
            f"task {cfg.env.task!r}, {1 / env.control_dt:.0f} Hz control, {mode}; cameras {list(env.config.cameras)}"
        )
        rclpy.spin_until_future_complete(node, robot.finished)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except RuntimeError:
        # Ctrl-C landing inside rclpy's native take of a message surfaces as a RuntimeError (pybind11 converts
        # the interrupt); rclpy's handler shuts the context down on its own thread, so wait briefly for that
        # before calling it a real error.
        end = time.monotonic() + 1.0
        while rclpy.ok() and time.monotonic() < end:
            time.sleep(0.01)
        if rclpy.ok():
            raise
    finally:
        if robot is not None and rclpy.ok():  # after Ctrl-C the context is gone, and nobody waits for a status
            try:
                robot.deliver_pending(FINAL_DELIVERY_TIMEOUT_S)
            except RCLError:  # Ctrl-C landed after the check: rclpy's handler invalidated the context meanwhile
                pass
        summary = robot.summary() if robot is not None else {}
        if robot is not None:
            robot.close()
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
        env.close()
    return {**summary, "config": asdict(cfg)}
