"""`vla-rl serve`'s node over real rclpy: streaming, chunk metadata, and bad input injected into a running node.

A test robot node in the same process publishes joint states and images at the control rate and
records what the bridge sends back. Every fault must leave the node running and publishing the
hold command, name its cause on /diagnostics, and clear when good input returns.

The machine running these may be loaded: every test waits for an event or a count (with generous
timeouts), never for a wall-clock window; the command-rate check is the slow test at the end.
"""

import itertools
import json
import os
import time
from functools import partial

import numpy as np
import pytest

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"

from extras import require

rclpy = require("rclpy", "ros")

from bridge_policies import IMAGE_SIZE, RAISE_INSTRUCTION, STEP, bad_chunk_policy, ramp_policy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Bool, String
from trajectory_msgs.msg import JointTrajectory

from robot_bridge.config import SIM_ACTION_NAMES, SIM_STATE_NAMES, CameraTopic, QosConfig, ServeConfig, TopicsConfig
from robot_bridge.node import PolicyBridge
from vla_core.runtime import ChunkingConfig

DOMAIN_ID = 41
HZ = 50.0
EE = (0.5, 0.0, 0.2)  # the test robot's end-effector position
# The sim Panda's home pose (sim/assets/panda_lift.xml): inside the default safety.state_bounds.
HOME_JOINTS = [0.0, 0.1, 0.0, -2.2, 0.0, 2.3, 0.7854]
TIMEOUT = 20.0  # seconds to wait for an event: generous, for a loaded machine
# A worker process imports torch and the policy code first, at nice +10: on a busy machine, minutes.
SPAWN_TIMEOUT = 180.0


class FakeRobot:
    """Publishes JointState + rgb8 image at HZ (when ``publishing``); records commands, diagnostics, chunks."""

    def __init__(self, context, compressed: bool = False):
        self.node = rclpy.create_node("test_robot", context=context)
        best_effort = QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
        self.state_pub = self.node.create_publisher(JointState, "/joint_states", best_effort)
        self.image_pub = self.node.create_publisher(Image, "/camera/front/image_raw", best_effort)
        self.compressed_pub = self.node.create_publisher(
            CompressedImage, "/camera/front/image_raw/compressed", best_effort
        )
        self.estop_pub = self.node.create_publisher(Bool, "/estop", 10)
        self.instruction_pub = self.node.create_publisher(String, "/instruction", 10)
        self.commands: list[tuple[float, list[float], list[str]]] = []
        self.diagnostics: list[dict] = []
        self.chunks: list[dict] = []
        self.node.create_subscription(JointTrajectory, "/command/joint_trajectory", self._on_command, 10)
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)
        self.node.create_subscription(String, "/vla_rl/chunk", lambda m: self.chunks.append(json.loads(m.data)), 10)
        # output=trajectory: what the arm's and the gripper's controllers receive
        self.arm_trajectories: list[JointTrajectory] = []
        self.gripper_trajectories: list[JointTrajectory] = []
        self.node.create_subscription(JointTrajectory, "/arm_controller/joint_trajectory", self.arm_trajectories.append,
                                      10)  # fmt: skip
        self.node.create_subscription(JointTrajectory, "/gripper_controller/joint_trajectory",
                                      self.gripper_trajectories.append, 10)  # fmt: skip
        self.publishing = {"state": True, "image": True}
        self.state_override = None  # callable(JointState) -> JointState, for injecting bad states
        self.image_override = None  # callable(Image) -> Image
        self.stamp = 1000.0
        self.states_sent = 0
        self.node.create_timer(1.0 / HZ, self._publish)

    def close(self, executor) -> None:
        """Stop publishing: a second robot on the same topics would otherwise meet this one's older stamps."""
        executor.remove_node(self.node)
        self.node.destroy_node()

    def flood(self, hz: float) -> None:
        """Publish joint states (only) at ``hz`` as well, as a driver publishing at its own rate would."""
        self.node.create_timer(1.0 / hz, self._publish_state)

    def _on_command(self, msg):
        self.commands.append((time.monotonic(), list(msg.points[0].positions), list(msg.joint_names)))

    def _on_diagnostics(self, msg):
        status = msg.status[0]
        self.diagnostics.append({"message": status.message, **{kv.key: kv.value for kv in status.values}})

    def joint_state(self) -> JointState:
        msg = JointState()
        self.stamp += 1.0 / HZ
        msg.header.stamp.sec, msg.header.stamp.nanosec = int(self.stamp), int((self.stamp % 1) * 1e9)
        msg.name = list(SIM_STATE_NAMES)
        msg.position = [*HOME_JOINTS, 0.04, *EE]
        return msg

    def image(self) -> Image:
        msg = Image(height=IMAGE_SIZE, width=IMAGE_SIZE, encoding="rgb8", step=3 * IMAGE_SIZE)
        msg.header.stamp.sec, msg.header.stamp.nanosec = int(self.stamp), int((self.stamp % 1) * 1e9)
        msg.data = bytes(np.full(3 * IMAGE_SIZE * IMAGE_SIZE, 128, np.uint8))
        return msg

    def _publish(self):
        if self.publishing["image"]:  # image first: the joint state triggers the bridge's tick
            msg = self.image()
            self.image_pub.publish(self.image_override(msg) if self.image_override else msg)
        self._publish_state()

    def _publish_state(self):
        if self.publishing["state"]:
            msg = self.joint_state()
            self.state_pub.publish(self.state_override(msg) if self.state_override else msg)
            self.states_sent += 1


@pytest.fixture
def ros():
    """(context, executor) on a private domain; both torn down after the test."""
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=DOMAIN_ID)
    executor = SingleThreadedExecutor(context=context)
    yield context, executor
    executor.shutdown()
    rclpy.shutdown(context=context)


def make_bridge(
    context,
    executor,
    load=None,
    parameters=(),
    on_tick=None,
    log_clock=time.monotonic,
    merge="rtc",
    execute_steps=4,
    **overrides,
):
    cfg = ServeConfig(
        checkpoint="(test policy)", control_hz=HZ, inference="thread", inference_cpu=-1,
        chunking=ChunkingConfig(execute_steps=execute_steps, merge=merge), max_delay_steps=7, instruction="lift the cube",
        diagnostics_hz=10.0, load_retry_s=0.3, error_retry_s=0.1, latency_log="",
        cameras=[CameraTopic("front", "/camera/front/image_raw")],
    )  # fmt: skip
    cfg.safety.stale_after_s = 0.3
    for key, value in overrides.items():
        setattr(cfg, key, value)
    bridge = PolicyBridge(
        cfg, load or partial(ramp_policy, 8), on_tick=on_tick, log_clock=log_clock, context=context,
        parameter_overrides=list(parameters),
    )  # fmt: skip
    robot = FakeRobot(context)
    executor.add_node(bridge)
    executor.add_node(robot.node)
    return bridge, robot


def spin_until(executor, predicate, timeout=TIMEOUT):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        executor.spin_once(timeout_sec=0.01)
        if predicate():
            return True
    return False


def expect_hold_then_recover(executor, bridge, robot, inject, restore, cause_words):
    """Inject a fault: HOLDING with the cause named and constant commands; restore: RUNNING again."""
    assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
    inject()
    assert spin_until(executor, lambda: bridge.hold.state == "HOLDING"), bridge.hold.state
    for word in cause_words:
        assert word in bridge.hold.cause, (word, bridge.hold.cause)
    first = len(robot.commands)
    # Eight more commands: the first three may have left before the hold (still in transport).
    assert spin_until(executor, lambda: len(robot.commands) >= first + 8), "the node must keep commanding the hold"
    held = [c[1] for c in robot.commands[first + 3 : first + 8]]
    assert all(c == held[0] for c in held), "a hold repeats one command"
    assert bridge.hold.state == "HOLDING", bridge.hold.state
    assert spin_until(executor, lambda: any(all(w in d["message"] for w in cause_words) for d in robot.diagnostics)), (
        "diagnostics name the cause"
    )
    restore()
    assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
    resumed = len(robot.commands)
    assert spin_until(executor, lambda: len({c[1][0] for c in robot.commands[resumed:]}) > 1), (
        "after recovery the policy's commands flow again"
    )


def test_streams_commands_chunks_and_diagnostics(ros):
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    try:
        assert spin_until(executor, lambda: len(robot.chunks) >= 3)
        assert bridge.hold.state == "RUNNING"
        _, positions, names = robot.commands[-1]
        assert names == ["ee_x", "ee_y", "ee_z", "grip"]
        assert positions[1:] == pytest.approx([EE[1], EE[2], 0.5])
        chunk = robot.chunks[-1]
        for key in ("chunk_id", "obs_stamp", "obs_step", "inference_latency_ms", "delay_steps", "merge", "lag_steps"):
            assert key in chunk
        assert chunk["merge"] == "rtc" and chunk["instruction"] == "lift the cube" and chunk["obs_stamp"] > 1000
        assert spin_until(executor, lambda: any(d["state"] == "RUNNING" for d in robot.diagnostics))
        diag = robot.diagnostics[-1]
        assert int(diag["queue_depth"]) > 0 and float(diag["inference_latency_ms"]) > 0
        # A new instruction takes effect at the next chunk request.
        robot.instruction_pub.publish(String(data="stack the cubes"))
        seen = len(robot.chunks)
        assert spin_until(executor, lambda: any(c["instruction"] == "stack the cubes" for c in robot.chunks[seen:]))
    finally:
        bridge.close()


def test_chunk_takes_effect_the_step_after_it_is_found_with_its_lag_announced(ros):
    """The tick publishes first and merges after: a chunk's first command is chunk index lag, at
    step merged_at_step, and the next request announces that lag as its delay (as the sim counts it).
    Runs on rclpy's EventsExecutor, the one `serve` uses."""
    from rclpy.experimental import EventsExecutor

    context, _ = ros
    executor = EventsExecutor(context=context)
    ticks = []
    bridge, robot = make_bridge(context, executor, on_tick=ticks.append, merge="latest", horizon=8)
    try:
        assert spin_until(executor, lambda: len(robot.chunks) >= 6)
        chunks = {c["merged_at_step"]: c for c in robot.chunks}
        seams = [t for t in ticks if t.seam]
        assert len(seams) >= 5
        for tick in seams:
            chunk = chunks[tick.step]
            lag = tick.step - chunk["obs_step"]
            assert lag == chunk["lag_steps"] >= 1
            # RampPolicy: chunk index j commands ee_x + STEP * (j + 1); index lag is the first to run.
            assert tick.command[0] == pytest.approx(EE[0] + STEP * (lag + 1), abs=1e-6)
        # Each request announces the largest lag of the (up to) 4 chunks merged before it.
        for i, chunk in enumerate(robot.chunks[1:], start=1):
            assert chunk["delay_steps"] == max(c["lag_steps"] for c in robot.chunks[max(0, i - 4) : i])
    finally:
        bridge.close()
        executor.shutdown()


def _bad_state(kind):
    def mutate(msg):
        if kind == "nan":
            msg.position = [float("nan")] + list(msg.position[1:])
        elif kind == "missing":
            msg.name, msg.position = msg.name[:-1], msg.position[:-1]
        elif kind == "length":
            msg.position = list(msg.position) + [0.0]
        elif kind == "old":
            msg.header.stamp.sec -= 100
        elif kind == "future":  # 30 s ahead of the node's clock: a driver's clock that stepped forward
            msg.header.stamp.sec = time.time_ns() // 10**9 + 30
        elif kind == "far":  # a sensor fault: 1e6 rad on every joint, finite and well-formed
            msg.position = [1e6] * 7 + list(msg.position[7:])
        return msg

    return mutate


@pytest.mark.parametrize(
    "kind, rejection, words",
    [("nan", "not_finite", ["joint_states", "non-finite", "joint1"]),
     ("length", "wrong_length", ["joint_states", "names", "positions"]),
     ("old", "out_of_order", ["joint_states", "out-of-order"]),
     # Accepted before, after which every valid state was out of order until the clock caught up.
     ("future", "future_stamp", ["joint_states", "ahead of this node's clock"]),
     # The entry, its value and the configured bound (the sim Panda's joint1 limit).
     ("far", "out_of_bounds", ["joint_states", "out of bounds", "joint1=1e+06 outside [-2.8973, 2.8973]"])],
)  # fmt: skip
def test_bad_joint_states_hold_and_recover(ros, kind, rejection, words):
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    try:

        def inject():
            robot.state_override = _bad_state(kind)

        def restore():
            robot.state_override = None  # the robot's own stamps moved on: newer than anything accepted

        expect_hold_then_recover(executor, bridge, robot, inject, restore, words)
        # Counted under its own cause, and only there: the robot sent nothing else that was bad.
        assert set(bridge.diagnostics.rejections) == {rejection} and bridge.diagnostics.rejections[rejection] > 0
        assert bridge.diagnostics.counters["rejected_messages"] == bridge.diagnostics.rejections[rejection]
        assert spin_until(executor, lambda: f"rejected_{rejection}" in robot.diagnostics[-1])
        if kind == "old":
            assert bridge.diagnostics.counters["out_of_order"] == bridge.diagnostics.rejections["out_of_order"]
    finally:
        bridge.close()


def test_a_joint_no_message_carries_any_more_holds_stale_by_name_and_rejects_nothing(ros):
    """Joint states that stop carrying ee_z (a partial message is a source of the joints it carries, not a bad
    message): the hold names ee_z as stale, nothing is rejected, and it recovers once ee_z is reported again."""
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    try:
        expect_hold_then_recover(executor, bridge, robot, lambda: setattr(robot, "state_override", _bad_state("missing")),
                                 lambda: setattr(robot, "state_override", None), ["stale", "joint_states ee_z"])  # fmt: skip
        assert bridge.diagnostics.counters["rejected_messages"] == 0
    finally:
        bridge.close()


class GripperDriver:
    """A second driver: publishes gripper_width alone (stamped as the test robot's latest state) at ``hz``, on
    ``topic``; ``value`` what it reports (the test robot's own is 0.04)."""

    def __init__(self, context, robot, topic="/joint_states", hz=HZ / 2):
        self.node = rclpy.create_node("gripper_driver", context=context)
        self.pub = self.node.create_publisher(
            JointState, topic, QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
        )
        self.robot, self.value, self.publishing, self.sent = robot, 0.04, True, 0
        self.node.create_timer(1.0 / hz, self._publish)

    def _publish(self):
        if self.publishing:
            msg = JointState(name=["gripper_width"], position=[self.value])
            msg.header.stamp.sec, msg.header.stamp.nanosec = int(self.robot.stamp), int((self.robot.stamp % 1) * 1e9)
            self.pub.publish(msg)
            self.sent += 1


def _without_gripper(msg):
    keep = [i for i, n in enumerate(msg.name) if n != "gripper_width"]
    msg.name, msg.position = [msg.name[i] for i in keep], [msg.position[i] for i in keep]
    return msg


@pytest.mark.parametrize("topic", ["/joint_states", "/gripper/joint_states"])
def test_joint_states_from_two_drivers_at_their_own_rates_are_assembled_by_name(ros, topic):
    """The arm's driver (every joint but gripper_width, at the control rate) and a gripper driver (gripper_width
    alone, at half of it), on one topic or on a second one (topics.more_joint_states): the policy runs on the
    assembled state; the gripper driver stopping holds naming gripper_width; it coming back recovers. Before the
    gripper is first reported the hold names it missing."""
    context, executor = ros
    more = [topic] if topic != "/joint_states" else []
    bridge, robot = make_bridge(context, executor, topics=TopicsConfig(more_joint_states=more))
    robot.state_override = _without_gripper
    try:
        assert spin_until(executor, lambda: bridge.hold.cause and "gripper_width (missing)" in bridge.hold.cause)
        driver = GripperDriver(context, robot, topic)
        executor.add_node(driver.node)
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
        assert bridge.inputs.state[SIM_STATE_NAMES.index("gripper_width")] == 0.04
        assert bridge.diagnostics.counters["rejected_messages"] == 0
        expect_hold_then_recover(executor, bridge, robot, lambda: setattr(driver, "publishing", False),
                                 lambda: setattr(driver, "publishing", True), ["stale", "joint_states gripper_width"])  # fmt: skip
    finally:
        bridge.close()


def test_two_drivers_disagreeing_about_a_joint_is_a_fault_naming_it(ros):
    """A gripper driver reporting gripper_width 1 cm away from the arm driver's value, at the same stamps: a
    rejection (``disagreement``) naming the joint and both values; the driver stopping recovers (its fault expires),
    and so does its agreeing again."""
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    driver = GripperDriver(context, robot, hz=HZ)
    driver.value = 0.05
    executor.add_node(driver.node)
    try:
        assert spin_until(executor, lambda: bridge.diagnostics.rejections.get("disagreement", 0) > 0)
        assert spin_until(executor, lambda: bridge.hold.state == "HOLDING" and "gripper_width" in bridge.hold.cause)
        assert (
            "0.04" in bridge.hold.cause
            and "0.05" in bridge.hold.cause
            and "joint_agreement_tolerance" in bridge.hold.cause
        )
        driver.publishing = False  # the user removed the driver the fault named
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
        driver.publishing = True
        assert spin_until(executor, lambda: bridge.hold.state == "HOLDING" and "gripper_width" in bridge.hold.cause)
        driver.value = 0.0405  # within the tolerance (0.01)
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
    finally:
        bridge.close()


def test_rejections_are_counted_per_cause_and_logged_once_a_second_per_cause(ros):
    """Callbacks called directly, not spun (so every message arrives and the counts are exact), with
    the log limiter on an injected clock: 20 out-of-bounds and 7 NaN states in what the limiter sees
    as one instant give one log line per cause, every tick holds, and a second later the next line
    says how many were held back. (The burst is a flood too: it ticks at most at the control rate.)"""
    context, executor = ros
    now = [1000.0]
    ticks = []
    bridge, robot = make_bridge(context, executor, on_tick=ticks.append, log_clock=lambda: now[0])
    lines = []
    bridge.log_limiter.sink = lambda level, line: lines.append((level, line))
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
        assert bridge.diagnostics.rejections == {}
        first, excess = len(ticks), bridge.diagnostics.counters["excess_states"]
        far, nan = _bad_state("far"), _bad_state("nan")
        time.sleep(2 / HZ)  # not spinning: no state arrives, so the burst's first state finds a whole tick banked
        started = time.monotonic()
        for _ in range(20):
            bridge.inputs.on_joint_state(far(robot.joint_state()))
        for _ in range(7):
            bridge.inputs.on_joint_state(nan(robot.joint_state()))
        burst_s = time.monotonic() - started
        assert bridge.diagnostics.rejections == {"out_of_bounds": 20, "not_finite": 7}
        assert bridge.diagnostics.counters["rejected_messages"] == 27
        values = bridge.status_values()
        assert (values["rejected_out_of_bounds"], values["rejected_not_finite"]) == ("20", "7")
        rejected = [line for level, line in lines if line.startswith("rejected")]
        assert len(rejected) == 2, rejected
        assert "joint_states out of bounds: joint1=1e+06 outside [-2.8973, 2.8973]" in rejected[0]
        assert "(and 4 more)" in rejected[0] and "[out_of_bounds]" in rejected[0]
        assert "non-finite values for ['joint1']" in rejected[1] and "[not_finite]" in rejected[1]
        assert all(level == "warning" for level, line in lines if line.startswith("rejected"))
        # 27 states in a burst tick at most burst_s * HZ + 1.5 times (`TickBudget`); the rest are excess. Every
        # tick held the command that went out before the first bad state.
        held = ticks[first:]
        assert 1 <= len(held) <= burst_s * HZ + 1.5 and not any(t.from_policy for t in held)
        assert bridge.diagnostics.counters["excess_states"] - excess == 27 - len(held)
        assert all(t.command.tolist() == held[0].command.tolist() for t in held)
        # Holding; the next tick names the newest fault (the burst's last ticked state may have been out of bounds).
        assert bridge.hold.state == "HOLDING" and bridge.inputs.faults["joint_states"][0] == "not_finite"
        # One second later (on the limiter's clock) the cause may be logged again, with the count held back.
        now[0] += 1.0
        bridge.inputs.on_joint_state(far(robot.joint_state()))
        rejected = [line for _, line in lines if line.startswith("rejected")]
        assert len(rejected) == 3 and rejected[2].endswith("(19 more like it in the last 1.0 s)"), rejected[2]
    finally:
        bridge.close()


def _bad_image(kind):
    def mutate(msg):
        if kind == "size":
            msg.height = msg.width = IMAGE_SIZE // 2
            msg.step = 3 * msg.width
            msg.data = bytes(3 * msg.width * msg.height)
        elif kind == "truncated":
            msg.data = bytes(10)
        elif kind == "encoding":
            msg.encoding = "32FC1"
        return msg

    return mutate


@pytest.mark.parametrize(
    "kind, words",
    [("size", ["camera front", "8x8", "16x16"]), ("truncated", ["camera front", "bytes"]),
     ("encoding", ["camera front", "32FC1"])],
)  # fmt: skip
def test_bad_images_hold_and_recover(ros, kind, words):
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    try:
        expect_hold_then_recover(
            executor, bridge, robot, lambda: setattr(robot, "image_override", _bad_image(kind)),
            lambda: setattr(robot, "image_override", None), words,
        )  # fmt: skip
    finally:
        bridge.close()


def test_stale_inputs_hold_and_the_watchdog_keeps_commanding(ros):
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    try:
        # The camera stops: joint states keep ticking the node, which holds.
        expect_hold_then_recover(
            executor, bridge, robot, lambda: robot.publishing.update(image=False),
            lambda: robot.publishing.update(image=True), ["stale", "camera front"],
        )  # fmt: skip
        # The joint states stop: no more ticks from the robot, the watchdog timer commands the hold.
        expect_hold_then_recover(
            executor, bridge, robot, lambda: robot.publishing.update(state=False),
            lambda: robot.publishing.update(state=True), ["stale", "joint_states"],
        )  # fmt: skip
        assert bridge.diagnostics.counters["stale_events"] >= 2
    finally:
        bridge.close()


def test_policy_exception_holds_and_recovers(ros):
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    try:
        expect_hold_then_recover(
            executor, bridge, robot, lambda: robot.instruction_pub.publish(String(data=RAISE_INSTRUCTION)),
            lambda: robot.instruction_pub.publish(String(data="lift the cube")),
            ["policy raised RuntimeError", "injected policy failure"],
        )  # fmt: skip
        assert bridge.diagnostics.counters["policy_errors"] >= 1
    finally:
        bridge.close()


def test_missing_checkpoint_holds_then_recovers_once_one_is_written(ros, tmp_path):
    """`serve`'s own loader (vla_rl.cli._policy_from_checkpoint -> vla_rl.checkpoint.load_policy) in a
    worker process, pointed at a directory that does not exist yet; a checkpoint written there while
    the node holds is loaded at the next retry, and its chunks flow."""
    from bridge_policies import random_diffusion_policy

    from vla_rl.checkpoint import save_checkpoint
    from vla_rl.cli import _policy_from_checkpoint

    context, executor = ros
    run_dir = tmp_path / "train"  # a training output dir, as --checkpoint takes it
    load = partial(_policy_from_checkpoint, str(run_dir), "cpu")
    ticks = []
    bridge, robot = make_bridge(
        context, executor, load=load, on_tick=ticks.append, inference="process", resize_images=True
    )
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "FAILED", timeout=SPAWN_TIMEOUT), bridge.hold.cause
        assert bridge.hold.cause.startswith(f"checkpoint failed to load: FileNotFoundError: no checkpoint at {run_dir}")
        assert "train one with `vla-rl train` or pass the right --checkpoint" in bridge.hold.cause
        assert spin_until(executor, lambda: any("checkpoint failed to load" in d["message"] for d in robot.diagnostics))
        assert robot.diagnostics[-1]["state"] == "FAILED"
        # Holding at the measured position (no policy yet): ee as measured, grip from initial_command.
        assert spin_until(executor, lambda: len(robot.commands) > 3)
        assert robot.commands[-1][1] == pytest.approx([*EE, 0.0])
        assert bridge.diagnostics.counters["load_failures"] >= 1 and bridge.diagnostics.counters["chunks"] == 0

        saved = random_diffusion_policy()
        save_checkpoint(run_dir / "checkpoints", 1, saved, {"note": "written while serve held"})
        assert spin_until(executor, lambda: bridge.diagnostics.counters["chunks"] >= 2, timeout=SPAWN_TIMEOUT), (
            bridge.hold.cause
        )
        assert bridge.hold.state == "RUNNING" and bridge.hold.cause is None
        # The policy that loaded is the one written: its config, as the worker reported it.
        info = bridge.scheduler.policy_info
        assert (info["horizon"], info["image_size"], info["state_dim"], info["action_dim"]) == (8, 64, 11, 4)
        failures = bridge.diagnostics.counters["load_failures"]
        assert spin_until(executor, lambda: sum(t.from_policy for t in ticks) >= 3), "the policy's commands flow"
        assert np.isfinite(robot.commands[-1][1]).all()
        assert bridge.diagnostics.counters["load_failures"] == failures  # loaded: no more retries
    finally:
        bridge.close()


def test_nan_and_misshapen_chunks_from_the_worker_hold_and_recover(ros):
    """A policy in the worker process (as `serve` runs it) whose 3rd chunk has one NaN (step 2, ee_y)
    and whose 5th is one action dim short: each is rejected, counted as an invalid chunk, named on
    /diagnostics, and held through (one command repeated) until the next good chunk."""
    context, executor = ros
    ticks = []
    bridge, robot = make_bridge(
        context, executor, load=bad_chunk_policy, inference="process",
        on_tick=lambda record: ticks.append((record, bridge.hold.cause)),
    )  # fmt: skip
    nan_cause = (
        "policy returned a chunk with 1 non-finite (NaN/inf) values of 32, the first at step 2, ee_y; "
        "check the checkpoint's weights and normalization statistics"
    )
    shape_cause = (
        "policy returned a chunk of shape (1, 8, 3), expected (1, 1..8, 4) for action_names "
        "['ee_x', 'ee_y', 'ee_z', 'grip']; serve a checkpoint whose action_dim and horizon match the serve config"
    )
    try:
        # Until the hold for the second bad chunk (it starts at the tick after the chunk came back) is over.
        assert spin_until(
            executor,
            lambda: any(c == shape_cause for _, c in ticks) and bridge.hold.state == "RUNNING",
            timeout=SPAWN_TIMEOUT,
        ), (bridge.diagnostics.counters, bridge.hold.cause)
        assert bridge.diagnostics.counters["invalid_chunks"] == 2
        assert (
            bridge.diagnostics.counters["policy_errors"] == 0 and bridge.diagnostics.counters["rejected_messages"] == 0
        )
        assert bridge.scheduler.worker.alive()
        causes = [cause for record, cause in ticks if record.state == "HOLDING"]
        assert nan_cause in causes and shape_cause in causes
        # While held for a bad chunk, every command repeats the one before: nothing of the chunk went out.
        for (before, _), (record, cause) in itertools.pairwise(ticks):
            if cause in (nan_cause, shape_cause):
                assert not record.from_policy and record.command.tolist() == before.command.tolist()
        assert all(np.isfinite(record.command).all() for record, _ in ticks if record.command is not None)
        assert spin_until(executor, lambda: robot.diagnostics and robot.diagnostics[-1]["invalid_chunks"] == "2")
        # The good chunks after the second bad one drive the robot again.
        resumed = len(ticks)
        assert spin_until(executor, lambda: sum(r.from_policy for r, _ in ticks[resumed:]) >= 3)
        assert bridge.diagnostics.counters["invalid_chunks"] == 2
    finally:
        bridge.close()


def test_execute_steps_zero_takes_the_policys_n_action_steps(ros):
    """chunking.execute_steps=0: a request every n_action_steps (3) steps of the policy at the soonest (later
    only while one is in flight); a policy that does not tell its n_action_steps fails, naming the flag."""
    context, executor = ros
    bridge, robot = make_bridge(context, executor, load=partial(ramp_policy, 8, False, 3), execute_steps=0)
    try:
        assert spin_until(executor, lambda: len(robot.chunks) >= 5), bridge.hold.cause
        assert bridge.scheduler.protocol.execute_steps == 3
        gaps = np.diff([c["obs_step"] for c in robot.chunks])
        assert gaps.min() == 3 and (gaps >= 3).all(), gaps
    finally:
        bridge.close()
        robot.close(executor)
    bridge, _ = make_bridge(context, executor, execute_steps=0)  # the ramp policy tells no n_action_steps
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "FAILED"), bridge.hold.cause
        assert "does not tell its n_action_steps; set --chunking.execute_steps" in bridge.hold.cause
    finally:
        bridge.close()


def test_estop_latches_until_released(ros):
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING")
        robot.estop_pub.publish(Bool(data=True))
        assert spin_until(executor, lambda: bridge.hold.state == "ESTOP")
        first = len(robot.commands)
        # Good inputs and chunks keep coming: still held.
        chunks = bridge.diagnostics.counters["chunks"]
        assert spin_until(executor, lambda: len(robot.commands) >= first + 15)
        held = [c[1] for c in robot.commands[first + 3 : first + 15]]
        assert all(c == held[0] for c in held) and bridge.hold.state == "ESTOP"
        assert bridge.diagnostics.counters["chunks"] == chunks  # no request while the e-stop holds
        robot.estop_pub.publish(Bool(data=False))
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING")
    finally:
        bridge.close()


def test_another_node_on_the_command_topic_holds_until_it_is_gone_and_is_named(ros):
    """A second node publishing on serve's command topic (a teleop left running) is a fault naming the topic and
    the node: serve holds (constant commands) until its publisher is gone, then runs again."""
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    intruder = rclpy.create_node("teleop", namespace="/operator", context=context)
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
        assert spin_until(executor, lambda: robot.diagnostics) and robot.diagnostics[-1]["other_commanders"] == ""
        publisher = intruder.create_publisher(JointTrajectory, "/command/joint_trajectory", 10)
        assert spin_until(executor, lambda: bridge.hold.state == "HOLDING"), bridge.hold.state
        assert "/command/joint_trajectory: /operator/teleop" in bridge.hold.cause
        assert "other_commanders: warn" in bridge.hold.cause  # the fix named
        assert spin_until(executor, lambda: robot.diagnostics[-1]["other_commanders"] == "/command/joint_trajectory: "
                          "/operator/teleop")  # fmt: skip
        first = len(robot.commands)
        assert spin_until(executor, lambda: len(robot.commands) >= first + 12)
        held = [c[1] for c in robot.commands[first + 3 : first + 12]]
        assert all(c == held[0] for c in held)
        intruder.destroy_publisher(publisher)
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
    finally:
        intruder.destroy_node()
        bridge.close()


def test_with_other_commanders_warn_serve_commands_beside_it_and_reports_warn(ros):
    """``other_commanders: warn``: the policy's commands go on (they change), and /diagnostics is at WARN with the
    other node named while the state stays RUNNING."""
    from diagnostic_msgs.msg import DiagnosticStatus

    context, executor = ros
    bridge, robot = make_bridge(context, executor, other_commanders="warn")
    levels = []
    robot.node.create_subscription(DiagnosticArray, "/diagnostics", lambda m: levels.append(m.status[0]), 10)
    intruder = rclpy.create_node("teleop", context=context)
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
        intruder.create_publisher(JointTrajectory, "/command/joint_trajectory", 10)
        warned = "RUNNING; other commanders: /command/joint_trajectory: /teleop"  # the level OK raised to WARN
        assert spin_until(executor, lambda: levels and levels[-1].message == warned), levels[-1:]
        assert levels[-1].level == DiagnosticStatus.WARN
        first = len(robot.commands)
        assert spin_until(executor, lambda: len(robot.commands) >= first + 12)
        assert bridge.hold.state == "RUNNING"
        assert len({tuple(c[1]) for c in robot.commands[first:]}) > 1  # the ramp policy's commands, not a hold
    finally:
        intruder.destroy_node()
        bridge.close()


def test_a_controller_requesting_transient_local_is_named_with_the_setting_that_reaches_it(ros):
    """A controller subscribing to the command topic with transient-local durability never connects to a volatile
    publisher: /diagnostics names the topic, the node, the policy and the setting (WARN), and clears when it goes;
    with qos.command_durability: transient_local it receives the commands."""
    from diagnostic_msgs.msg import DiagnosticStatus
    from rclpy.qos import DurabilityPolicy

    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    latched = QoSProfile(depth=10, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    controller = rclpy.create_node("controller", context=context)
    received = []
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
        subscription = controller.create_subscription(JointTrajectory, "/command/joint_trajectory", received.append,
                                                      latched)  # fmt: skip
        executor.add_node(controller)
        expected = ("/command/joint_trajectory: /controller requests durability transient_local, serve offers "
                    "volatile (set qos.command_durability: transient_local)")  # fmt: skip
        assert spin_until(
            executor, lambda: robot.diagnostics and robot.diagnostics[-1].get("qos_mismatches") == expected
        )
        commands = len(robot.commands)
        assert spin_until(executor, lambda: len(robot.commands) > commands + 10) and received == []
        controller.destroy_subscription(subscription)
        assert spin_until(executor, lambda: robot.diagnostics[-1].get("qos_mismatches") == ""), robot.diagnostics[-1]
    finally:
        controller.destroy_node()
        bridge.close()
        robot.close(executor)
    bridge, robot = make_bridge(context, executor, qos=QosConfig(command_durability="transient_local"))
    levels = []
    robot.node.create_subscription(DiagnosticArray, "/diagnostics", lambda m: levels.append(m.status[0]), 10)
    controller = rclpy.create_node("controller", context=context)
    controller.create_subscription(JointTrajectory, "/command/joint_trajectory", received.append, latched)
    executor.add_node(controller)
    try:
        assert spin_until(executor, lambda: len(received) > 10)
        assert spin_until(executor, lambda: any(d.level == DiagnosticStatus.OK for d in levels))
        assert all(d.get("qos_mismatches") == "" for d in robot.diagnostics)
    finally:
        controller.destroy_node()
        bridge.close()


def test_dry_run_publishes_nothing_to_the_robot(ros):
    context, executor = ros
    bridge, robot = make_bridge(context, executor, dry_run=True)
    try:
        # Four chunks of four executed steps each: many commands would have been published by now.
        assert spin_until(executor, lambda: len(robot.chunks) >= 4)
        assert bridge.diagnostics.counters["ticks"] > 8 and robot.commands == []
        assert bridge.count_publishers("/command/joint_trajectory") == 0
        assert robot.chunks[-1]["dry_run"] is True
        assert any(d["state"] == "RUNNING" for d in robot.diagnostics)
    finally:
        bridge.close()


def test_delta_actions_integrate_against_the_last_command(ros):
    context, executor = ros
    bridge, robot = make_bridge(context, executor, load=partial(ramp_policy, 8, True), action_mode="delta")
    try:
        assert spin_until(executor, lambda: len(robot.chunks) >= 3)
        start = len(robot.commands)
        assert spin_until(executor, lambda: len(robot.commands) >= start + 12)
        xs = np.array([c[1][0] for c in robot.commands[start : start + 12]])
        # The measured ee_x never changes, yet x keeps growing by STEP per command: anchored on the
        # last command, not on the observation.
        assert len(xs) > 5 and np.diff(xs) == pytest.approx(STEP, abs=1e-9)
        assert xs[-1] > EE[0] + 10 * STEP
    finally:
        bridge.close()


def test_process_worker_and_ros_parameter_overrides(ros):
    context, executor = ros
    params = [
        Parameter("chunking.merge", value="ensemble"),
        Parameter("safety.max_velocity", value=[0.01, 1.0, 1.0, 1.0]),
        Parameter("delay_estimate_window", value=3),  # renamed chunking.estimate_window: still read, for a release
    ]
    bridge, robot = make_bridge(context, executor, parameters=params, inference="process")
    try:
        assert bridge.config.chunking.merge == "ensemble" and bridge.config.safety.max_velocity[0] == 0.01
        assert bridge.config.chunking.estimate_window == 3
        assert spin_until(executor, lambda: len(robot.chunks) >= 2, timeout=SPAWN_TIMEOUT), bridge.hold.cause
        assert robot.chunks[-1]["merge"] == "ensemble"
        xs = np.array([c[1][0] for c in robot.commands])
        # 0.01 m/s at 50 Hz: at most 0.2 mm per command although the policy ramps faster at first.
        assert np.abs(np.diff(xs)).max() <= 0.01 / HZ + 1e-12
    finally:
        bridge.close()


def test_compressed_camera_decodes_and_corrupt_frames_hold(ros):
    import cv2

    context, executor = ros
    cam = CameraTopic("front", "/camera/front/image_raw/compressed", compressed=True)
    bridge, robot = make_bridge(context, executor, cameras=[cam])
    good = np.frombuffer(cv2.imencode(".png", np.full((IMAGE_SIZE, IMAGE_SIZE, 3), 90, np.uint8))[1], np.uint8)
    corrupt = {"on": False}

    def publish_compressed():
        msg = CompressedImage(format="png")
        msg.header.stamp.sec, msg.header.stamp.nanosec = int(robot.stamp), int((robot.stamp % 1) * 1e9)
        msg.data = b"\x89PNG garbage" if corrupt["on"] else good.tobytes()
        robot.compressed_pub.publish(msg)

    robot.publishing["image"] = False
    robot.node.create_timer(1.0 / HZ, publish_compressed)
    try:
        expect_hold_then_recover(
            executor, bridge, robot, lambda: corrupt.update(on=True), lambda: corrupt.update(on=False),
            ["camera front", "does not decode"],
        )  # fmt: skip
    finally:
        bridge.close()


def test_serves_the_project_diffusion_policy_with_resized_images(ros):
    from bridge_policies import random_diffusion_policy

    context, executor = ros
    bridge, robot = make_bridge(context, executor, load=random_diffusion_policy, resize_images=True)
    try:
        # The robot's 16x16 images are resized to the policy's 64x64; chunks flow and commands are finite.
        assert spin_until(executor, lambda: len(robot.chunks) >= 2, timeout=60), bridge.hold.cause
        assert bridge.scheduler.policy_info["image_size"] == 64 and robot.chunks[-1]["horizon"] == 8
        assert np.isfinite(robot.commands[-1][1]).all()
    finally:
        bridge.close()


def test_a_low_latency_part_corrects_every_command_in_a_ros_graph(ros):
    """A checkpoint with a low-latency part: the node holds until the part is loaded in its own process, then every
    command the robot receives carries the part's correction (ee_y one STEP off the observed, where the ramp's
    chunks keep it), its per-tick time is on /diagnostics, and nothing fell back."""
    from bridge_policies import STEP, side_step_policy

    context, executor = ros
    bridge, robot = make_bridge(context, executor, load=side_step_policy, merge="latest")
    try:
        assert spin_until(executor, lambda: len(robot.chunks) >= 3), bridge.hold.cause
        assert bridge.scheduler.low_latency is not None and bridge.scheduler.low_latency.ready
        first = len(robot.commands)
        assert spin_until(executor, lambda: len(robot.commands) >= first + 10)
        y = robot.commands[-1][2].index("ee_y")
        assert all(c[1][y] == pytest.approx(EE[1] + STEP, abs=1e-6) for c in robot.commands[first:])
        assert spin_until(executor, lambda: robot.diagnostics and robot.diagnostics[-1]["low_latency_p99_ms"] != "")
        assert robot.diagnostics[-1]["low_latency_fallbacks"] == "0" and bridge.hold.state == "RUNNING"
        # A hold for a cause is not corrected: under the e-stop the part is not asked, and the hold repeats.
        robot.estop_pub.publish(Bool(data=True))
        assert spin_until(executor, lambda: bridge.hold.state == "ESTOP")
        calls, first = bridge.scheduler.low_latency.policy.calls, len(robot.commands)
        assert spin_until(executor, lambda: len(robot.commands) >= first + 8)
        assert bridge.scheduler.low_latency.policy.calls == calls
        assert calls > 10  # it was asked every tick before
    finally:
        bridge.close()


def test_a_low_latency_part_corrects_the_next_point_of_each_trajectory_in_a_ros_graph(ros):
    """output=trajectory with a low-latency part: every tick that does not hold sends the trajectory from its step
    on, its first point the part's correction (ee_y one STEP off the observed, where the ramp's chunks keep it),
    reached one period after the tick, solved on the URDF; its later points the merged plan's, uncorrected. Each
    step's action, as the tick records it, is the corrected one, and nothing fell back. (IK tolerance 10 um, so a
    1 mm correction shows in the joints.)"""
    from bridge_policies import STEP, side_step_policy

    from vla_core.robot import SIM_PANDA

    context, executor = ros
    ticks = []
    bridge, robot = make_bridge(context, executor, load=side_step_policy, merge="latest", on_tick=ticks.append,
                                output="trajectory", ik_tolerance=1e-5)  # fmt: skip
    robot.state_override = _at_home_pose
    chain, period_ns = SIM_PANDA.chain(), round(1e9 / HZ)
    home = chain.forward(np.array(HOME_JOINTS))[0][0]
    try:
        assert spin_until(executor, lambda: len(robot.chunks) >= 3), bridge.hold.cause
        assert bridge.scheduler.low_latency is not None and bridge.scheduler.low_latency.ready
        first_tick, first_sent = len(ticks), len(robot.arm_trajectories)
        assert spin_until(
            executor, lambda: len(ticks) >= first_tick + 15 and len(robot.arm_trajectories) >= first_sent + 15
        )
        y = SIM_ACTION_NAMES.index("ee_y")
        assert all(t.command[y] == pytest.approx(home[1] + STEP, abs=1e-9) for t in ticks[first_tick + 1 :])
        sent = robot.arm_trajectories[first_sent + 1 :]  # the first may be in transport from before
        corrections = [
            t for t in sent if abs(chain.forward(np.array(t.points[0].positions))[0][0][1] - home[1]) > STEP / 2
        ]
        assert len(corrections) >= 10
        for trajectory in corrections:
            reached = chain.forward(np.array([list(p.positions) for p in trajectory.points]))[0]
            assert reached[0, 1] == pytest.approx(home[1] + STEP, abs=1e-5)  # within the IK's tolerance
            assert _ns(trajectory.points[0].time_from_start) == period_ns
            # The points after the first are the plan's: ee_y as observed, the IK's tolerance away at most.
            assert np.abs(reached[1:, 1] - home[1]).max(initial=0.0) <= 1e-5 + 1e-9
        assert robot.commands == [] and bridge.hold.state == "RUNNING"
        assert spin_until(executor, lambda: robot.diagnostics and robot.diagnostics[-1]["low_latency_p99_ms"] != "")
        assert robot.diagnostics[-1]["low_latency_fallbacks"] == "0"
    finally:
        bridge.close()


def test_serves_a_flow_vla_with_rtc_guidance_in_a_worker_process(ros):
    """merge=rtc with a flow VLA: every request after the first carries RTC guidance, which the
    worker process computes with autograd (a vector-Jacobian product) on each denoising step."""
    from bridge_policies import random_flow_vla_policy

    context, executor = ros
    bridge, robot = make_bridge(context, executor, load=random_flow_vla_policy, merge="rtc", inference="process")
    try:
        assert spin_until(executor, lambda: len(robot.chunks) >= 4, timeout=SPAWN_TIMEOUT), bridge.hold.cause
        assert bridge.scheduler.policy_info["supports_inpainting"] is True
        assert all(c["guided"] for c in robot.chunks[1:])
        assert bridge.diagnostics.counters["policy_errors"] == 0 and bridge.hold.state == "RUNNING"
        assert np.isfinite(robot.commands[-1][1]).all()
    finally:
        bridge.close()


def test_deadline_is_deadline_ms_not_a_fraction_of_the_period(ros):
    """With deadline_ms = 1 ns every tick is late (handing a command to ROS takes microseconds), at 50 Hz
    where half a period would be 10 ms: the node counts every tick as a missed deadline."""
    context, executor = ros
    bridge, _ = make_bridge(context, executor, deadline_ms=1e-6)
    try:
        assert spin_until(executor, lambda: bridge.diagnostics.counters["ticks"] >= 10)
        assert bridge.diagnostics.counters["missed_deadlines"] == bridge.diagnostics.counters["ticks"]
    finally:
        bridge.close()


def test_work_after_a_command_longer_than_a_period_is_an_overrun_tick(ros):
    """One tick's work after its command (merging, requesting) is made to take three periods: it is counted as an
    overrun and its length is the longest after-command work on /diagnostics; the ticks around it are not overruns."""
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    stall_s, calls = 3.0 / HZ, []
    prepare = bridge.scheduler.prepare_next_action

    def prepare_stalling_once(cause, now):
        calls.append(now)
        if len(calls) == 5:
            time.sleep(stall_s)
        prepare(cause, now)

    try:
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
        before = bridge.diagnostics.counters["overrun_ticks"]
        bridge.scheduler.prepare_next_action = prepare_stalling_once
        assert spin_until(executor, lambda: len(calls) >= 40)
        counters = bridge.diagnostics.counters
        assert counters["overrun_ticks"] - before >= 1 and counters["overrun_ticks"] < counters["ticks"] / 2
        assert bridge.diagnostics.after_command_max_ms >= stall_s * 1e3
        assert spin_until(
            executor, lambda: float(robot.diagnostics[-1].get("after_command_max_ms", 0)) >= stall_s * 1e3
        )
    finally:
        bridge.close()


@pytest.mark.slow
def test_commands_arrive_at_the_control_rate(ros):
    context, executor = ros
    bridge, robot = make_bridge(context, executor)
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
        first = len(robot.commands)
        assert spin_until(executor, lambda: len(robot.commands) >= first + 40)
        times = [c[0] for c in robot.commands[first : first + 40]]
        assert np.median(np.diff(times)) == pytest.approx(1 / HZ, abs=0.004)
    finally:
        bridge.close()


def test_a_flood_of_joint_states_commands_at_the_control_rate_and_counts_the_excess(ros):
    """Joint states at about 6x the control rate (a driver publishing at its own rate; before, each one ticked
    a command): the node ticks at most control_hz times a second (over a span T, T * HZ + 1.5 at most,
    `TickBudget`), and counts the states it did not tick for on /diagnostics."""
    context, executor = ros
    ticks = []
    bridge, robot = make_bridge(context, executor, on_tick=ticks.append)
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING"), bridge.hold.cause
        robot.flood(5 * HZ)
        sent, first, excess, started = robot.states_sent, len(ticks), bridge.diagnostics.counters["excess_states"], \
            time.monotonic()  # fmt: skip
        assert spin_until(executor, lambda: robot.states_sent >= sent + 200)
        span, flood_ticks = time.monotonic() - started, len(ticks) - first
        assert flood_ticks <= span * HZ + 1.5, (flood_ticks, span, robot.states_sent - sent)
        assert bridge.diagnostics.counters["excess_states"] - excess >= flood_ticks  # at 6x, most states are excess
        assert spin_until(executor, lambda: int(robot.diagnostics[-1].get("excess_states", 0)) > 0)
    finally:
        bridge.close()


def test_state_entries_without_bounds_are_named_at_start(ros, capfd):
    """A robot whose joint names the bounds do not cover would pass its sensor faults on: the node says which."""
    from robot_bridge.config import SafetyConfig

    context, executor = ros
    safety = SafetyConfig(stale_after_s=0.3)
    del safety.state_bounds["joint7"], safety.state_bounds["ee_z"]
    capfd.readouterr()
    bridge, _ = make_bridge(context, executor, safety=safety)
    try:
        assert bridge.inputs.unchecked_state == ["joint7", "ee_z"]
        assert "state entries ['joint7', 'ee_z'] have no plausibility bounds" in capfd.readouterr().err
    finally:
        bridge.close()
    bridge, _ = make_bridge(context, executor)
    try:
        assert bridge.inputs.unchecked_state == []  # the defaults cover every entry of the sim arm
        assert "plausibility bounds" not in capfd.readouterr().err
    finally:
        bridge.close()


# -- output=trajectory ---------------------------------------------------------------------------------------


def _ns(stamp) -> int:
    return stamp.sec * 10**9 + stamp.nanosec


def _at_home_pose(msg):
    """The joint state of an arm really at HOME_JOINTS: its end effector where the URDF puts it (FakeRobot's EE is
    5 cm off, which a per-tick command never notices but an IK warm-started at the measured joints would)."""
    from vla_core.robot import SIM_PANDA

    msg.position = [*HOME_JOINTS, 0.04, *SIM_PANDA.chain().forward(np.array(HOME_JOINTS))[0][0]]
    return msg


@pytest.mark.parametrize("lead", [0, 2])
def test_trajectory_output_sends_each_merged_plan_from_the_step_after_its_tick_stamped_at_that_ticks_time(ros, lead):
    """RampPolicy's chunk row j commands ee_x + STEP * (j + 1) (ee as observed) and grip 0.5. A chunk merged at the
    tick of step n - 1 (merged_at_step n, lag d) is sent as one arm and one gripper trajectory: stamped with the
    tick time of step n + L (the stamp of the joint state that ticked step n - 1, plus 1 + L periods; L =
    chunking.lead_steps, whose steps the controller runs from the trajectory before), point k = chunk row d + L + k
    reached (k + 1) periods later, H - d - L points, the arm's joints putting the end effector there (URDF forward
    kinematics), the fingers at 0.04 * (1 - 0.5) = 0.02. Nothing goes on the per-tick topic."""
    from vla_core.robot import SIM_PANDA

    context, executor = ros
    ticks = []
    # max_delay_steps + lead must stay inside the chunk of 8
    bridge, robot = make_bridge(context, executor, on_tick=ticks.append, horizon=8, output="trajectory",
                                chunking=ChunkingConfig(execute_steps=4, merge="latest", lead_steps=lead),
                                max_delay_steps=7 - lead)  # fmt: skip
    robot.state_override = _at_home_pose
    chain, period_ns = SIM_PANDA.chain(), round(1e9 / HZ)
    try:
        assert spin_until(executor, lambda: len(robot.chunks) >= 4 and len(robot.arm_trajectories) >= 5)
        plans = [t for t in robot.arm_trajectories if len(t.points) > 1]  # a hold has one point
        chunks = {c["merged_at_step"]: c for c in robot.chunks}
        state_stamp = {t.step: round(t.obs_stamp * 1e9) for t in ticks}  # the joint state each tick ran on
        checked = 0
        for plan, gripper in zip(plans, [g for g in robot.gripper_trajectories if len(g.points) > 1], strict=False):
            first = next(n for n, c in chunks.items() if abs(_ns(plan.header.stamp) - state_stamp.get(n - 1, 0)
                                                            - (1 + lead) * period_ns) < 1000)  # fmt: skip
            skip = chunks[first]["lag_steps"] + lead
            assert len(plan.points) == 8 - skip and list(plan.joint_names) == [f"joint{i}" for i in range(1, 8)]
            assert [_ns(p.time_from_start) for p in plan.points] == [(k + 1) * period_ns for k in range(8 - skip)]
            reached = chain.forward(np.array([list(p.positions) for p in plan.points]))[0]
            ee = chain.forward(np.array(HOME_JOINTS))[0][0]
            expected = ee + np.array([[STEP * (skip + k + 1), 0, 0] for k in range(8 - skip)])
            assert np.abs(reached - expected).max() <= 0.001 + 1e-9  # the IK's tolerance
            assert gripper.header.stamp == plan.header.stamp and list(gripper.joint_names) == [
                "finger_joint1",
                "finger_joint2",
            ]
            assert [list(p.positions) for p in gripper.points] == [[0.02, 0.02]] * (8 - skip)
            checked += 1
        assert checked >= 3 and robot.commands == []
        # The seam tick is the one whose action is a merged chunk's first: lead steps after the step after the merge.
        seams = {t.step for t in ticks if t.seam}
        assert seams and seams <= {n + lead for n in chunks}
        assert (
            bridge.diagnostics.counters["trajectories"] >= checked and bridge.diagnostics.counters["ik_failures"] == 0
        )
    finally:
        bridge.close()


def test_trajectory_output_holds_the_setpoint_in_force_with_one_point_stamped_now(ros):
    """E-stop: every tick sends the same one-point arm and gripper trajectory, stamped with this node's clock at the
    tick; released, the merged plans flow again."""
    context, executor = ros
    bridge, robot = make_bridge(context, executor, output="trajectory")
    robot.state_override = _at_home_pose
    try:
        assert spin_until(executor, lambda: bridge.diagnostics.counters["trajectories"] >= 2)
        before = bridge.get_clock().now().nanoseconds
        robot.estop_pub.publish(Bool(data=True))
        assert spin_until(executor, lambda: bridge.hold.state == "ESTOP")
        first = len(robot.arm_trajectories)
        assert spin_until(executor, lambda: len(robot.arm_trajectories) >= first + 6)
        held = robot.arm_trajectories[first + 1 : first + 6]  # the first may be a plan still in transport
        assert all(
            len(t.points) == 1 and list(t.points[0].positions) == list(held[0].points[0].positions) for t in held
        )
        # Reached safety.stale_after_s (0.3 s) later: where the controller is already, and valid if read late.
        assert _ns(held[0].points[0].time_from_start) == 300_000_000
        assert before < _ns(held[0].header.stamp) <= bridge.get_clock().now().nanoseconds
        assert list(robot.gripper_trajectories[-1].points[0].positions) == [0.02, 0.02]
        robot.estop_pub.publish(Bool(data=False))
        sent = bridge.diagnostics.counters["trajectories"]
        assert spin_until(executor, lambda: bridge.diagnostics.counters["trajectories"] >= sent + 2)
        assert len(robot.arm_trajectories[-1].points) > 1
    finally:
        bridge.close()


@pytest.mark.parametrize("lead", [0, 2])
def test_an_ik_failure_sends_nothing_and_is_counted_with_the_fix(ros, lead):
    """With an IK tolerance no solver reaches (1 nm), every waypoint fails: no trajectory leaves (the robot's
    controller holds its last point), ik_failures counts each chunk on /diagnostics, and the log names the fix
    once a second at most. With a lead the steps before the unsent plan's first stay (none was ever sent here,
    so the queue is empty in every slot)."""
    context, executor = ros
    lines = []
    bridge, robot = make_bridge(context, executor, output="trajectory", ik_tolerance=1e-9, max_delay_steps=7 - lead,
                                chunking=ChunkingConfig(execute_steps=4, merge="rtc", lead_steps=lead))  # fmt: skip
    bridge.log_limiter.sink = lambda level, line: lines.append(line)
    robot.state_override = _at_home_pose
    started = time.monotonic()
    try:
        assert spin_until(executor, lambda: bridge.diagnostics.counters["ik_failures"] >= 3)
        # Checked in the spin of the failing tick: the plan the robot never got is not the protocol's queue.
        assert bridge.scheduler.queue_depth() == 0 and bridge.scheduler.protocol.executor.queue_end().item() == 0
        assert bridge.diagnostics.counters["trajectories"] == 0 and bridge.hold.state == "RUNNING"
        assert all(len(t.points) == 1 for t in robot.arm_trajectories)  # only holds, before the policy was ready
        assert spin_until(executor, lambda: int(robot.diagnostics[-1].get("ik_failures", 0)) >= 3)
        failures = [line for line in lines if line.startswith("end-effector target")]
        assert failures and "safety.position_min / position_max" in failures[0]
        assert len(failures) <= 1 + (time.monotonic() - started)  # at most one a second
    finally:
        bridge.close()


def test_the_robot_description_from_its_topic_holds_until_a_good_one_arrives(ros):
    """topics.robot_description: the node holds, saying it waits; a URDF that does not parse is counted and named;
    the simulated Panda's URDF (published transient local, as robot_state_publisher does; ee_link names the link
    its end-effector actions command) lets it run."""
    from rclpy.qos import DurabilityPolicy

    from robot_bridge.config import TopicsConfig
    from vla_core.robot import SIM_PANDA

    context, executor = ros
    bridge, robot = make_bridge(context, executor, output="trajectory", ee_link="grasp",
                                topics=TopicsConfig(robot_description="/robot_description"))  # fmt: skip
    latched = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    description_pub = robot.node.create_publisher(String, "/robot_description", latched)
    robot.state_override = _at_home_pose
    try:
        assert spin_until(executor, lambda: "waiting for the robot description" in (bridge.hold.cause or ""))
        description_pub.publish(String(data="<robot name='arm'><link name='a'/>"))
        assert spin_until(executor, lambda: bridge.diagnostics.counters["description_rejected"] == 1)
        assert spin_until(executor, lambda: "not valid XML" in bridge.hold.cause) and bridge.hold.state == "HOLDING"
        assert spin_until(executor, lambda: any("rejected" in d["message"] for d in robot.diagnostics))
        description_pub.publish(String(data=SIM_PANDA.urdf))
        assert spin_until(executor, lambda: bridge.diagnostics.counters["trajectories"] >= 1), bridge.hold.cause
        assert bridge.robot.description.name == "sim_panda"
    finally:
        bridge.close()


def test_trajectory_output_sends_no_hold_between_the_robots_episodes(ros):
    """topics.episode: once the robot announces its episode's end it resets, so a hold of the ended episode's
    setpoint (which would pull the reset arm back) is not sent while the node holds on the silent inputs; the next
    episode's first state re-anchors the planner and its plans flow."""
    from robot_bridge.config import TopicsConfig

    context, executor = ros
    ticks = []
    bridge, robot = make_bridge(context, executor, on_tick=ticks.append, output="trajectory",
                                topics=TopicsConfig(episode="/sim_robot/episode"))  # fmt: skip
    episode_pub = robot.node.create_publisher(String, "/sim_robot/episode", 10)
    robot.state_override = _at_home_pose
    try:
        assert spin_until(executor, lambda: bridge.diagnostics.counters["trajectories"] >= 2)
        robot.publishing.update(state=False, image=False)  # the robot resets: it publishes nothing
        ended = bridge.get_clock().now().nanoseconds
        stamp_ns = round(robot.stamp * 1e9)
        episode_pub.publish(String(data=json.dumps({"episode": 0, "done": True, "stamp_ns": stamp_ns})))
        first = len(ticks)
        assert spin_until(executor, lambda: sum(t.state == "HOLDING" for t in ticks[first:]) >= 10)  # watchdog ticks
        holds = [t for t in robot.arm_trajectories if len(t.points) == 1 and _ns(t.header.stamp) > ended]
        assert holds == [] and bridge.inputs.ended_episode == (0, stamp_ns * 1e-9)
        sent = bridge.diagnostics.counters["trajectories"]
        robot.publishing.update(state=True, image=True)  # the next episode's first state, stamped after the end
        assert spin_until(executor, lambda: bridge.diagnostics.counters["trajectories"] >= sent + 2)
        assert bridge.scheduler.episode == 1
    finally:
        bridge.close()
