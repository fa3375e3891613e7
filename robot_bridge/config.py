"""`vla-rl serve` configuration: the topic<->feature map, action semantics, rates, QoS, safety and checkpoint.

One YAML file (configs/serve.yaml) declares everything; ROS parameters of the same dotted names
(``--ros-args -p control_hz:=50.0 -p safety.stale_after_s:=0.1``) override its scalar and list
fields when the node starts. No ROS import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, get_args

from robot_bridge import topics as topic_table
from vla_core.robot import SIM_PANDA, ActionSpace
from vla_core.runtime import ChunkingConfig
from vla_core.types import SteerMode, image_key

# The defaults serve the simulated Panda (`vla-rl sim-robot`), as its description
# (`vla_core.robot.SIM_PANDA`) states: the state it publishes, the actions it accepts and what it
# can physically report per state entry (radians, metres).
SIM_STATE_NAMES = list(SIM_PANDA.state_names)
SIM_ACTION_NAMES = list(SIM_PANDA.action_names)
SIM_STATE_BOUNDS = {name: list(bound) for name, bound in SIM_PANDA.state_bounds.items()}

# The choices of each field, as Literal types: the parser rejects anything else with the choices
# listed, and validate() checks them for configs built in code. ActionSpace is the robot description's.
ActionMode = Literal["absolute", "delta"]
Clock = Literal["joint_states", "timer"]
RosExecutor = Literal["events", "single_threaded"]
InferenceMode = Literal["process", "thread", "remote"]
Reliability = Literal["best_effort", "reliable"]
# ticks: one single-point JointTrajectory per control tick, in the action's own terms; trajectory: each merged
# chunk as one JointTrajectory over the arm's joints (and one over the gripper's), as joint trajectory
# controllers take them (`robot_bridge.trajectory`).
Output = Literal["ticks", "trajectory"]
GripperOpen = Literal["upper", "lower"]  # which of a gripper joint's limits is open (grip 0)
OtherCommanders = Literal["hold", "warn"]
Durability = Literal["volatile", "transient_local"]


@dataclass
class CameraTopic:
    name: str = "front"  # camera name; the policy feature is observation.images.<name>
    # sensor_msgs/Image topic, or sensor_msgs/CompressedImage when compressed
    topic: str = topic_table.camera("front").name
    compressed: bool = False  # the topic carries sensor_msgs/CompressedImage (png or jpeg)

    @property
    def feature(self) -> str:
        return image_key(self.name)


@dataclass
class TopicsConfig:
    """Topic names of each role; the defaults and the message types are those of `robot_bridge.topics`."""

    joint_states: str = topic_table.JOINT_STATES.name  # sensor_msgs/JointState from the robot
    # More topics of sensor_msgs/JointState (a gripper's driver publishing its own): the state is assembled by joint
    # name from every message on all of them, and on joint_states from every publisher (`robot_bridge.joint_states`).
    more_joint_states: list[str] = field(default_factory=list)
    instruction: str = topic_table.INSTRUCTION.name  # std_msgs/String; a new one takes effect at the next chunk request
    estop: str = topic_table.ESTOP.name  # std_msgs/Bool; True latches a hold until False arrives
    # trajectory_msgs/JointTrajectory, one point per control step
    joint_trajectory: str = topic_table.JOINT_TRAJECTORY.name
    # std_msgs/Float64MultiArray with the same values (when publish_array)
    command_array: str = topic_table.COMMAND_ARRAY.name
    # output=trajectory: trajectory_msgs/JointTrajectory of each merged chunk over the arm's joints, and over
    # the gripper's joints (joint_trajectory_controller's topic interface, /<controller>/joint_trajectory)
    arm_trajectory: str = topic_table.ARM_TRAJECTORY.name
    gripper_trajectory: str = topic_table.GRIPPER_TRAJECTORY.name
    # std_msgs/String holding the robot's URDF, as robot_state_publisher publishes it (transient local); read
    # when robot_description (the file) is empty; serve holds until it arrives. "" = none.
    robot_description: str = ""
    chunk_info: str = topic_table.CHUNK_INFO.name  # std_msgs/String, JSON metadata of each merged chunk
    diagnostics: str = topic_table.DIAGNOSTICS.name  # diagnostic_msgs/DiagnosticArray
    # std_msgs/String JSON status of the robot's episodes ({"episode", "done", "stamp_ns"}, as `vla-rl
    # sim-robot` publishes on /sim_robot/episode): from the first joint state stamped after an episode's end,
    # the latency protocol starts a new episode as simulation does (empty queue, step 0, the hold anchored
    # on the measured state) and the latency log numbers requests by episode. "" = none: one long episode.
    episode: str = ""


@dataclass
class QosConfig:
    sensor_reliability: Reliability = "best_effort"  # best_effort or reliable, for joint states and images
    # volatile or transient_local requested of the joint states and images (transient_local: only from publishers
    # that offer it)
    sensor_durability: Durability = "volatile"
    sensor_depth: int = 1  # queue depth of the sensor subscriptions (1 = only the newest matters)
    command_depth: int = 10  # queue depth of the reliable command publishers
    # volatile or transient_local offered by the command publishers: a controller that requests transient_local
    # receives nothing from a volatile publisher (transient_local serves both)
    command_durability: Durability = "volatile"


@dataclass
class SafetyConfig:
    # Lowest and highest command per action dim; empty = unbounded, or with a robot_description given, its
    # limits (a joint's, the grip's [0, 1]).
    position_min: list[float] = field(default_factory=list)
    position_max: list[float] = field(default_factory=list)
    # |command change| / period per action dim; empty = unlimited, or with a robot_description given, its
    # joints' velocity limits
    max_velocity: list[float] = field(default_factory=list)
    # |velocity change| / period per action dim; empty = unlimited
    max_acceleration: list[float] = field(default_factory=list)
    stale_after_s: float = 0.25  # hold when the newest joint state or any camera image is older than this
    # A message stamped more than this ahead of the node's clock is rejected (rejected_future_stamp): a bad
    # stamp, or a driver's clock that stepped forward. Stamps are compared across machines, so their clocks
    # must agree to well within it (chrony, PTP).
    future_stamp_tolerance_s: float = 0.5
    # Each image the policy sees is paired with the joint state it runs on by header stamp (as message_filters'
    # approximate synchronizer pairs them): of a camera's last IMAGE_BUFFER images the one closest in stamp,
    # and none further apart than this (seconds); else no request goes out (unpaired_observations), and a camera
    # unpaired longer than stale_after_s holds the robot.
    pair_tolerance_s: float = 0.1
    # One joint reported by two sources (two messages of different joint sets) at stamps within 5 ms of each other,
    # with values further apart than this (rad or m), is a fault: two drivers disagree.
    joint_agreement_tolerance: float = 0.01
    # [low, high] per JointState entry (by name): a state outside [low - state_margin, high +
    # state_margin] is a sensor fault and is rejected (hold) before it reaches the policy. Names not
    # in state_names are ignored and entries without bounds are unchecked; {} checks nothing, except, with a
    # robot_description given, the entries that are its joints: they are bounded by its joint limits.
    state_bounds: dict[str, list[float]] = field(
        default_factory=lambda: {name: list(bound) for name, bound in SIM_STATE_BOUNDS.items()}
    )
    # Tolerance beyond state_bounds, in each entry's own unit: soft joint limits give a little, the
    # fingers can be pushed apart, the arm can overshoot the workspace edge.
    state_margin: float = 0.05
    # Hold value of the action dims no state entry of the same name measures, until the first policy command.
    initial_command: dict[str, float] = field(default_factory=lambda: {"grip": 0.0})


@dataclass
class ServeConfig:
    """Run a policy checkpoint as a ROS 2 node: sensors in, commands at the control rate out."""

    checkpoint: str = "outputs/quickstart/train"  # checkpoint dir (or a training output dir) to load
    # A LeRobot VLA checkpoint's tokenizer, in a local folder (pi0/pi05: PaliGemma's; SmolVLA: its VLM's,
    # with config.json); "": the checkpoint's tokenizer/ folder, else the Hugging Face cache.
    tokenizer_dir: str = ""
    device: str = "cpu"  # torch device of the policy
    # Steering composed with the checkpoint in the inference process ("" = none): a `vla-rl steer` output's
    # steering/ folder (RL²: gated, where its failure predictor expects a failure, or always; weight w and best-of-N
    # candidates, 0: the ones `vla-rl steer` chose), or a `vla-rl dsrl` output's dsrl/ folder (the agent's noise in
    # every chunk).
    # The mode is checked where the steering loads (`vla_rl.steering`), in the inference worker.
    steer_dir: str = ""
    steer_mode: SteerMode = "gated"
    steer_weight: float = 0.0
    steer_best_of: int = 0
    cameras: list[CameraTopic] = field(default_factory=lambda: [CameraTopic()])  # camera topic -> policy image feature
    # JointState names, in observation.state order
    state_names: list[str] = field(default_factory=lambda: list(SIM_STATE_NAMES))
    # JointTrajectory joint_names, in action order
    action_names: list[str] = field(default_factory=lambda: list(SIM_ACTION_NAMES))
    action_space: ActionSpace = SIM_PANDA.action_space  # joint or end_effector: what the action dims command
    action_mode: ActionMode = "absolute"  # absolute targets, or delta: added to the last commanded target
    # The robot's URDF file: its joints, limits, velocity limits and the chain end-effector actions are solved
    # on. "": topics.robot_description when set, else the simulated Panda's (vla_core/robots/sim_panda.urdf).
    # The safety limits left empty default to its limits.
    robot_description: str = ""
    # The URDF link end-effector actions command (ee_x, ee_y, ee_z in the URDF root link's frame); "" = the
    # simulated Panda's "grasp" with its own URDF, and none with another (an end-effector policy is then refused).
    ee_link: str = ""
    # ticks: one JointTrajectory point per control tick on topics.joint_trajectory (the action as it is);
    # trajectory: each merged chunk as one JointTrajectory over the arm's joints on topics.arm_trajectory
    # (end-effector actions through IK on the robot description), the grip on topics.gripper_trajectory.
    output: Output = "ticks"
    # output=trajectory: the gripper's joints in the URDF; the grip action (0 open, 1 closed) is mapped linearly
    # onto each one's range, gripper_open naming the limit that is open.
    gripper_joints: list[str] = field(default_factory=lambda: ["finger_joint1", "finger_joint2"])
    gripper_open: GripperOpen = "upper"
    # Another node publishing on a command topic serve publishes on (a teleop node left running, a second serve):
    # a fault on /diagnostics naming the topic and the node, logged once. hold: serve holds until it is gone;
    # warn: serve goes on commanding, the report at WARN. (ros2_control's controllers take commands from anyone.)
    other_commanders: OtherCommanders = "hold"
    # output=trajectory: metres within which an end-effector waypoint counts as reached by the IK; a chunk
    # with a waypoint the IK does not reach is not sent (ik_failures), and the previous trajectory runs on.
    ik_tolerance: float = 0.001
    # output=trajectory: send each arm trajectory as a goal of this control_msgs/FollowJointTrajectory
    # action (joint_trajectory_controller's, e.g. /arm_controller/follow_joint_trajectory) instead of on the
    # topic; needs control_msgs, which has no pip wheel. "" = the topic.
    trajectory_action: str = ""
    instruction: str = ""  # task instruction until one arrives on the instruction topic
    image_size: int = 0  # expected square image side; 0 = the policy's config.image_size
    resize_images: bool = False  # resize images of another size instead of rejecting them
    # control rate; with clock=joint_states, the rate the robot publishes at, and the most commands a second
    # (joint states beyond it tick nothing and count as excess_states)
    control_hz: float = 100.0
    deadline_ms: float = 5.0  # a command handed to ROS later than this after its tick was due is a missed deadline
    clock: Clock = "joint_states"  # joint_states: one command per arriving joint state; timer: the node's own timer
    horizon: int = 0  # chunk length H; 0 = the policy's config.horizon
    # steps executed per chunk (0 = the policy's n_action_steps), merge mode (default here: rtc), ensemble
    # weight, and estimate_window: the delay announced is the largest lag of the last this-many chunks
    chunking: ChunkingConfig = field(default_factory=lambda: ChunkingConfig(merge="rtc"))
    # The largest inference delay expected on this robot, in control steps: a policy trained or fine-tuned
    # for less is refused at load, and so is a whole chunk or more. 0 = not checked. The delay augmentation
    # is as wide as the larger of this and what the policy reads; a longer measured delay is announced as
    # that width and counted (delay_clamped). What the clamp costs: `vla-rl bench delay-beyond` (README).
    max_delay_steps: int = 0
    # Send the inference worker a mid-inference observation (the freshest joint state and images)
    # m = floor(mid_fraction * announced delay) ticks into each request, as latency-aware checkpoints
    # (`vla-rl finetune --latency_aware=true`) read; such a checkpoint is refused without it.
    mid_inference: bool = False
    # Every measured inference latency, as JSON lines with the control period (rewritten at start;
    # "" = none): replay it in simulation with --delay.kind=histogram --delay.latencies_file=<this file>.
    latency_log: str = "outputs/serve/latencies.jsonl"
    # process (own core, no GIL sharing), thread, or remote: a `vla-rl policy-server` on another machine
    inference: InferenceMode = "process"
    # remote: the policy server's host:port (`vla-rl policy-server --address=...`, `robot_bridge.policy_server`)
    inference_server: str = ""
    inference_cpu: int = 1  # core the inference is pinned to; -1 = no pinning
    control_cpu: int = 0  # core the control loop is pinned to; -1 = no pinning
    inference_threads: int = 1  # torch threads of the inference
    inference_nice: int = 10  # niceness added to the inference process, so the control loop wins the CPU
    # Seconds added to every inference before its chunk is returned: a slow model's latency on a fast
    # machine, to try the latency path (and latency-aware checkpoints) with `vla-rl sim-robot`. 0 = none.
    added_latency_s: float = 0.0
    # >= 0: the sampler's initial noise of request k of the robot's episode e (topics.episode) is drawn from
    # (noise_seed, e, k) (`vla_core.runtime.noise`), as `vla-rl eval --noise_seed` draws it for the same
    # request in simulation; -1 = the policy draws it.
    noise_seed: int = -1
    # SCHED_FIFO priority (1-99) of the control loop and its DDS threads, so no other work on the core
    # delays a tick (as ros2_control does); 0 = normal scheduling. Needs root or an rtprio limit;
    # without permission the node logs why and runs with normal scheduling.
    control_rt_priority: int = 50
    # Lock the control process's memory in RAM (mlockall), so no tick waits on a page fault; needs
    # CAP_IPC_LOCK or a memlock limit above the process size, else the node logs why and goes on.
    control_lock_memory: bool = True
    # rclpy executor of the control loop: events (rclpy's C++ EventsExecutor: dispatching a
    # message costs tens of microseconds) or single_threaded (the classic Python one, hundreds).
    ros_executor: RosExecutor = "events"
    load_retry_s: float = 5.0  # wait before loading the checkpoint again after a failure
    error_retry_s: float = 0.5  # wait before asking the policy again after it raised
    dry_run: bool = False  # compute everything but publish nothing to the robot (no command topics)
    publish_array: bool = False  # output=ticks: also publish each command as std_msgs/Float64MultiArray
    diagnostics_hz: float = 2.0  # diagnostics rate (state changes are published at once too)
    duration_s: float = 0.0  # stop after this many seconds; 0 = until Ctrl-C
    topics: TopicsConfig = field(default_factory=TopicsConfig)  # topic names
    qos: QosConfig = field(default_factory=QosConfig)  # quality of service
    safety: SafetyConfig = field(default_factory=SafetyConfig)  # limits and watchdog

    def validate(self) -> None:
        """Raise ValueError with a one-line fix for any inconsistent field."""
        choices = {
            "action_mode": (self.action_mode, get_args(ActionMode)),
            "action_space": (self.action_space, get_args(ActionSpace)),
            "clock": (self.clock, get_args(Clock)),
            "inference": (self.inference, get_args(InferenceMode)),
            "ros_executor": (self.ros_executor, get_args(RosExecutor)),
            "output": (self.output, get_args(Output)),
            "gripper_open": (self.gripper_open, get_args(GripperOpen)),
            "other_commanders": (self.other_commanders, get_args(OtherCommanders)),
            "steer_mode": (self.steer_mode, get_args(SteerMode)),
            "qos.sensor_reliability": (self.qos.sensor_reliability, get_args(Reliability)),
            "qos.sensor_durability": (self.qos.sensor_durability, get_args(Durability)),
            "qos.command_durability": (self.qos.command_durability, get_args(Durability)),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {allowed}; set --{name}={allowed[0]}")
        if self.control_hz <= 0 or self.diagnostics_hz <= 0 or self.deadline_ms <= 0:
            raise ValueError("control_hz, diagnostics_hz and deadline_ms must be > 0")
        self.chunking.validate()
        if self.max_delay_steps < 0 or self.horizon < 0 or self.image_size < 0 or self.added_latency_s < 0:
            raise ValueError("max_delay_steps, horizon, image_size and added_latency_s must be >= 0")
        if (self.inference == "remote") != bool(self.inference_server):
            raise ValueError("inference: remote and inference_server: HOST:PORT (a `vla-rl policy-server`) go together; "
                             "set both, or neither")  # fmt: skip
        if steering_flags_without_steering(self):
            raise ValueError("steer_mode, steer_weight and steer_best_of steer nothing without steer_dir (a `vla-rl "
                             "steer` output's steering/ folder): set it, or drop them")  # fmt: skip
        if self.inference == "remote" and self.steer_dir:
            raise ValueError("with inference: remote the policy server runs the policy: give it the steering "
                             "(`vla-rl policy-server --steer_dir=...`) and leave steer_dir empty here")  # fmt: skip
        if self.inference == "remote" and self.added_latency_s:
            raise ValueError("added_latency_s is slept by the local worker; with inference: remote give it to the "
                             "server (`vla-rl policy-server --added_latency_s=...`)")  # fmt: skip
        if self.ik_tolerance <= 0:
            raise ValueError(f"ik_tolerance must be > 0 metres, got {self.ik_tolerance}")
        if self.trajectory_action and self.output != "trajectory":
            raise ValueError("trajectory_action sends whole trajectories; set output: trajectory, or leave it empty")
        if not self.state_names or not self.action_names:
            raise ValueError(
                "state_names and action_names must not be empty; list the JointState names and action dims"
            )
        names = [c.name for c in self.cameras]
        if len(set(names)) != len(names):
            raise ValueError(f"camera names must be unique, got {names}")
        n = len(self.action_names)
        for name in ("position_min", "position_max", "max_velocity", "max_acceleration"):
            values = getattr(self.safety, name)
            if values and len(values) != n:
                raise ValueError(
                    f"safety.{name} has {len(values)} values but there are {n} action_names; give one per action"
                )
        unmeasured = [
            n for n in self.action_names if n not in self.state_names and n not in self.safety.initial_command
        ]
        if unmeasured:
            raise ValueError(
                f"action dims {unmeasured} have no state entry of the same name to hold at start-up; "
                f"give them a value in safety.initial_command"
            )
        if self.safety.stale_after_s <= 0:
            raise ValueError(f"safety.stale_after_s must be > 0, got {self.safety.stale_after_s}")
        if self.safety.pair_tolerance_s <= 0:
            raise ValueError(f"safety.pair_tolerance_s must be > 0 seconds, got {self.safety.pair_tolerance_s}")
        if self.safety.state_margin < 0:
            raise ValueError(f"safety.state_margin must be >= 0, got {self.safety.state_margin}")
        if not self.safety.joint_agreement_tolerance >= 0:
            raise ValueError(f"safety.joint_agreement_tolerance must be >= 0 (rad or m), got "
                             f"{self.safety.joint_agreement_tolerance}")  # fmt: skip
        topics = [self.topics.joint_states, *self.topics.more_joint_states]
        if len(set(topics)) != len(topics) or not all(topics):
            raise ValueError(f"topics.more_joint_states {self.topics.more_joint_states} must name other topics than "
                             f"topics.joint_states ({self.topics.joint_states!r}), each once")  # fmt: skip
        for name, bound in self.safety.state_bounds.items():
            if len(bound) != 2 or not bound[0] <= bound[1]:
                raise ValueError(f"safety.state_bounds.{name} must be [low, high] with low <= high, got {bound}")


def steering_flags_without_steering(cfg) -> bool:
    """Whether a serve or policy-server config sets steer_mode, steer_weight or steer_best_of without steer_dir: flags
    that would steer nothing (a weight of 1.0, the former default still written in copied configs, counts as unset)."""
    return not cfg.steer_dir and (cfg.steer_mode != "gated" or cfg.steer_weight not in (0.0, 1.0) or cfg.steer_best_of)


def flat_fields(config: Any, prefix: str = "") -> dict[str, tuple[Any, str]]:
    """Scalar and list-of-scalar fields of a nested dataclass: dotted name (the ROS parameter name) -> (value, type)."""
    out: dict[str, tuple[Any, str]] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            out.update(flat_fields(value, f"{prefix}{f.name}."))
        elif isinstance(value, (bool, int, float, str)) or (
            isinstance(value, list) and all(isinstance(v, (bool, int, float, str)) for v in value)
        ):
            out[prefix + f.name] = (value, str(f.type))
    return out


def apply_overrides(config: ServeConfig, overrides: dict[str, Any]) -> None:
    """Set dotted fields (from ROS parameters) on config in place, converted to the field's type."""
    for name, value in overrides.items():
        *parents, leaf = name.split(".")
        target = config
        for p in parents:
            target = getattr(target, p)
        current = getattr(target, leaf)
        if isinstance(current, bool):
            value = bool(value)
        elif isinstance(current, float):
            value = float(value)
        elif isinstance(current, list):
            value = list(value)
        setattr(target, leaf, value)
    config.validate()
