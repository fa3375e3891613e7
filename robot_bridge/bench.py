"""`vla-rl bench bridge`: serve's two outputs on a shared machine, against a raw rclpy ping-pong in the same run.

Two processes talk over loopback DDS:

- the **robot** (this process, pinned to the inference core, where it preempts the niced
  inference): publishes JointState (stamped with its send time) and a 64x64 rgb8 image at the
  control rate from a sleeping thread. Against per-tick output (``output=ticks``) it timestamps every
  command on receipt with the DDS receive time (so Python's scheduling in this process does not
  count); against trajectory output (``output=trajectory``) it is a joint trajectory controller ticking
  at the control rate (`robot_bridge.trajectory_follower`, as sim-robot): each tick moves the arm to the
  setpoint and the state it publishes is that setpoint;
- the **serve node** (a spawned process): `PolicyBridge` with its inference worker (a third,
  pinned, niced process) running `BenchPolicy`, a real torch network whose depth is calibrated once,
  on the idle inference core, so one forward pass takes ``inference_ms``. The same process echoes
  pings for the baseline;
- with ``--load`` (the default) a **training run** at normal priority on the inference core (an MLP
  autoencoder trained with AdamW, one thread: the CPU a fine-tuning job on the robot PC takes), from
  before the baseline to the end; control stays on its own core. The chunk horizon is sized from the
  inference latency of a sizing run before the measured ones (``sizing_chunks`` chunks served with
  the robot, the node and the load running; two inference delays at 1.5x their p99, plus the
  trajectory lead and ``execute_steps``), and reported. Trajectory output puts each chunk's first point
  ``trajectory_lead_s`` past the step after its merge (serve's ``chunking.lead_steps``): the time DDS
  has to bring it to the controller.

Per control rate and output mode, ``cycles`` control ticks split evenly over the merge modes (one
serve process each), the first run of a rate preceded by ``ping_cycles`` raw ping-pongs (JointState
out, the same message echoed back by a bare rclpy subscription in the serve process). Measured:

- trajectory output: ``ticks``, the controller's ticks; ``starved_ticks``, ticks with no point left to
  execute (the trajectory in force had ended: the next chunk came too late); ``late_chunks``, chunks
  (trajectories of more than one point; a hold has one) that arrived after the time of their first
  point, with each chunk's margin (that time minus its DDS arrival). Target: 0 and 0 over 100,000
  ticks while the training runs;
- per-tick output: ``tick_mode_late``, commands that reached the robot more than ``deadline_ms`` (5 ms)
  after their joint state was sent, or never (robot side, so DDS both ways counts); the node's own
  count (command handed to ROS more than ``deadline_ms`` after the state's callback started) too. Each
  state counts its first command (the watchdog repeats the stamp in holds);
- command jitter: |interval between the commands of consecutive cycles - period|, p50/p99;
- added latency: p-quantiles of (state sent -> command received) minus those of the raw ping-pong
  round trip;
- observation -> command latency: from a joint state's arrival in the node to the first command
  of the chunk conditioned on it (the inference latency, plus up to one period until the tick
  that merges the chunk, plus one period until the next tick publishes from it);
- seams: the largest joint-velocity jump |v_k - v_(k-1)| (v in units/s) at the commands where
  a new chunk takes over, against the largest elsewhere.

The bench policy follows a smooth periodic reference (0.5 Hz sines, amplitude 0.2) and adds a
per-chunk correction of at most ``chunk_noise`` computed by the network from the image and state,
so consecutive chunks disagree slightly, as a trained policy's do. Trajectory output drives the bench
arm of `bench_arm_urdf` (its joints, revolute, +-pi, 10 rad/s).

Whether the serve processes got real-time scheduling (SCHED_FIFO) and locked memory is recorded
per run and overall (``scheduling`` in the JSON): without them the per-tick misses are not the node's
(in our runs real-time scheduling alone took them from 1,200 to 16), so the summary warns when
either was refused. The final line is ``starved_ticks=<n> late_chunks=<m> tick_mode_late=<k>
ticks=<t>``, each summed over the rates and merge modes; added latency and jitter against the raw
ping-pong are in the JSON (``per_rate``).

Protocol history (runs as README.md reports them: figures over runs, not their final lines):

- 2026-11-29: the first version: a miss was a command reaching the robot more than half a period
  after its state was sent (10 ms at 50 Hz, 5 ms at 100 Hz); each state counted the last command
  stamped with it; jitter ran over every command received; the final line had its first three
  fields. The same day the bench's robot and serve processes took real-time scheduling, as
  ``serve`` does (README.md: misses went from 1,200 to 16; the dates and final lines of those runs
  are not recorded). One full default run, published 2026-11-30: 13 of 10,002 commands more than
  5 ms late at 100 Hz, 2.1 ms added at p99.
- 2026-11-30, an amendment after that run was published: each state counts its first command (the
  watchdog's holds repeat its stamp), jitter runs between the commands of consecutive cycles, and
  the node's own count starts at the state's callback; the serve process runs ``ros_executor``
  (events by default) and, later that day, locks its memory. Runs: one full default run (no
  command late), replaced the same day by three: in the best no command late, in the other two
  one each, at 100 Hz; p99 0.91-1.28 ms at 100 Hz, 0.20-0.41 ms added. Whether those three
  locked memory is not recorded. README.md's 3,000-cycle runs (p50/p99 1.00/2.79 to 0.53/1.05 ms
  at 100 Hz) compare the node before and after that day's changes; their bench version is not
  recorded.
- 2026-12-01, an amendment after those runs were published: the limit is ``deadline_ms`` (5 ms)
  at every rate, so at 50 Hz a miss counts from 5 ms where the runs above counted from 10; whether
  real-time scheduling and memory locking were granted is recorded and ends the final line.
- 2026-12-01, after a CI run printed ``added_latency_p99=nan``: the serve process starts without
  real-time priority and takes it itself, as ``serve`` does; the ping baseline is measured once
  the bridge has loaded its policy, and an empty one is refused. No run of this version or the
  one before is in README.md.
- 2026-12-02: no protocol change: the code was reorganized (imports from `vla_core`; the node's
  config no longer sets ``max_delay_steps`` to the chunk length, which ``serve`` now refuses).
- 2026-12-04, a new protocol, fixed before any run of it: both output modes (``--outputs``), 100 Hz only,
  100,000 ticks per mode (``--quick``: 5,000), a training run on the inference core (``--load``) from
  before the baseline to the end, the bench policy calibrated once on the idle core (not by each worker:
  a loaded core would calibrate it too shallow), the horizon sized from the latency measured under the
  load, and the final line ``starved_ticks=<n> late_chunks=<m> tick_mode_late=<k> ticks=<t>``
  (``tick_mode_late`` counts what ``deadline_misses`` counted; scheduling is in the JSON and the
  warnings). Two full default runs, README.md (Robots): ``starved_ticks=0 late_chunks=2
  tick_mode_late=12 ticks=100002`` and, after trajectories went out as serialized bytes,
  ``starved_ticks=145 late_chunks=4 tick_mode_late=6 ticks=100002``.
- 2026-12-05, an amendment after those two runs: the horizon is sized on the inference latencies of a
  sizing run (``sizing_chunks``, 20; ``--quick`` 5: serve with trajectory output and merge latest, at
  twice the horizon the 20 passes alone on the core give, with the robot, the node and the load
  running). Inference in the runs had been slower than in the passes that sized it: 16-24% at the
  median (46% at the max) in the first, 25-36% (71%) in the second, whose starved ticks came where two
  slow inferences met. The rule (two delays at 1.5x the p99, plus ``execute_steps``) and the final line
  are unchanged; the JSON gains ``sizing``, and per run each chunk's latency
  (``inference_latencies_ms``), the node's ``overrun_ticks`` and ``after_command_max_ms``. A code change
  of the same day, not of the protocol: two threads move the node's messages to and from its inference
  worker (`robot_bridge.inference`), since a message over 16 KiB leaves in two writes and the control
  loop's read waited between them for the niced worker, on the loaded core, to be scheduled again. One full default run of this version (README.md,
  run 3): ``starved_ticks=0 late_chunks=2 tick_mode_late=8 ticks=100002``; its two late chunks came
  200 ms late with no overrun of the control loop. After it, with no protocol change, each chunk's
  transport time is recorded (``chunk_transit_ms``, ``late_chunk_details``).
- 2026-12-05, a second amendment after run 3, fixed before any run of it: trajectory output places each
  chunk's first point ``trajectory_lead_s`` (0.5 s) past the step after its merge (serve's new
  ``chunking.lead_steps``, rounded up to steps: 50 at 100 Hz; the steps between stay as the previous
  trajectory has them), where it was one period past it, and the horizon adds the lead. Chosen from run 3
  alone: its late chunks were 202 and 174 ms late against a budget of about 16 ms, and 0.5 s is over twice
  the worst. A late chunk is still one that arrives after the time of its first point (now its first new
  point); per-tick output is unchanged; the final line is unchanged. One full default run (README.md, run
  4): ``starved_ticks=0 late_chunks=0 tick_mode_late=7 ticks=100002``; transport at most 0.18 ms, smallest
  margin 338 ms.
- 2026-12-07, an addition fixed before any run of it (RL under delay: the low-latency part on the robot):
  ``--low_latency=true`` gives the bench policy a low-latency part (the project's `LowLatencyPolicy` with the
  diffusion policy's keypoint encoder on the 64 px image), which serve runs at every tick before the command
  goes out; per-tick output only (trajectory output does not run a part, and is refused with it). The run:
  ``vla-rl bench bridge --outputs=[ticks] --low_latency=true --output_json=outputs/bench/bridge_low_latency.json``,
  every other setting the default (100 Hz, 100,000 ticks over the three merges, the training load, the horizon
  sized by the sizing run, which serves no part). The issue's target reads trajectory output's counts (0 starved
  ticks, 0 late chunks); with a part there is none, so what is reported is per-tick output's ``tick_mode_late``
  (commands more than 5 ms after their joint state) and the part's time per tick (``low_latency_ms``), beside
  the published runs without a part (other runs: their ratio means little). (After the run below, with no
  protocol change: the part is built from the same layers here, not imported from `policies`, which this
  layer may not import; its shapes and work are the same.)
- 2026-12-07, an amendment after that run stopped, fixed before it runs again: a policy with a low-latency part
  merges latest-only (serve refuses the others), so the run stopped at its second merge mode (``ensemble``),
  after ``latest``'s third of the ticks, with no result written. ``--low_latency=true`` now also needs
  ``--merges=[latest]`` (refused in one line otherwise), and the run is ``vla-rl bench bridge --outputs=[ticks]
  --merges=[latest] --low_latency=true --output_json=outputs/bench/bridge_low_latency.json``: all 100,000 ticks
  with ``latest``, every other setting as above.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from robot_bridge import topics
from robot_bridge.scheduling import lock_memory, normal_scheduling, quiet_interpreter, use_realtime
from robot_bridge.trajectory_follower import TrajectoryFollower
from vla_core.runtime import ChunkingConfig, MergeMode
from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_STATE, ActionChunk, image_key

JOINTS = ["joint1", "joint2", "joint3", "joint4"]
CAMERA = "front"
PING_TOPIC, PONG_TOPIC = "/bench/ping", "/bench/pong"
REFERENCE_HZ, REFERENCE_AMPLITUDE = 0.5, 0.2
LOW_LATENCY_ROWS = 4  # plan rows the bench policy's low-latency part reads


@dataclass
class BenchBridgeConfig:
    """Both of serve's outputs under a training load: starved controller ticks and late chunks of trajectory
    output, late commands of per-tick output, and the latency added over raw rclpy in the same run."""

    outputs: list[str] = field(default_factory=lambda: ["ticks", "trajectory"])  # serve's output modes measured
    rates_hz: list[float] = field(default_factory=lambda: [100.0])  # control rates measured
    deadline_ms: float = 5.0  # a tick-mode command later than this after its joint state was sent is late
    merges: list[MergeMode] = field(default_factory=lambda: ["latest", "ensemble", "rtc"])  # merge modes, one run each
    cycles: int = 100000  # control ticks per output mode and rate, split evenly over the merge modes
    ping_cycles: int = 1000  # raw rclpy ping-pong round trips per rate (the baseline)
    quick: bool = False  # 5,000 ticks per output mode and 500 pings: the plumbing, in about 5 minutes
    # A training run at normal priority on the inference core while measuring (control stays on its own core),
    # the pings included; the chunk horizon is then sized from the inference latency measured under it.
    load: bool = True
    inference_ms: float = 300.0  # forward time the bench network is calibrated to, on one idle core (50-500)
    inference_nice: int = 10  # niceness of the inference worker, as serve's inference_nice
    horizon: int = 0  # chunk length; 0 = sized from the inference latency of a sizing run (see sizing_chunks)
    # Chunks of the sizing run: serve (trajectory output, merge latest) with the robot and the load running, before
    # the measured runs; its inference latencies size the horizon (`size_horizon`). 0 = 20 (--quick: 5); refused
    # beside a given horizon, which skips the sizing run.
    sizing_chunks: int = 0
    execute_steps: int = 10  # steps per chunk before the next request (more when inference is slower)
    # Trajectory output: a chunk's first point this long after it merges (serve's chunking.lead_steps, rounded up
    # to steps at each rate): the time DDS has to bring it to the controller. Ticks output: 0.
    trajectory_lead_s: float = 0.5
    chunk_noise: float = 0.001  # largest per-chunk correction of the bench policy (joint units)
    image_size: int = 64  # camera image side, pixels
    inference: str = "process"  # process or thread: where the serve node runs the policy
    ros_executor: str = "events"  # rclpy executor of the serve process (and its ping echo): events or single_threaded
    domain_id: int = 47  # ROS_DOMAIN_ID of the benchmark (a private one: other nodes would disturb it)
    start_timeout_s: float = 120.0  # longest wait for the serve node's first chunk
    output_json: str = "outputs/bench/bridge.json"  # where the results are written
    # The bench policy with a low-latency part of the project's part's shape (`BenchLowLatencyPolicy`), which serve
    # runs at every tick before the command goes out: ticks output and latest merging only.
    low_latency: bool = False

    def apply_quick(self) -> None:
        if self.quick:
            self.cycles, self.ping_cycles = 5000, 500


# -- the bench policy ---------------------------------------------------------------------------


class BenchPolicy(nn.Module):
    """A patch-MLP over the camera image and state, sized to take ``inference_ms`` per chunk on one core.

    Image (1, 3, S, S) -> 64 patch tokens (1, 64, width) -> ``depth`` residual MLP blocks (the
    calibrated work; 4 distinct blocks applied in turn) -> pooled (1, width) -> a correction
    (offset and slope per action dim, bounded by ``chunk_noise``) added to the reference.
    """

    def __init__(self, horizon: int, control_hz: float, image_size: int, chunk_noise: float, width: int = 256):
        super().__init__()
        self.config = SimpleNamespace(
            horizon=horizon, image_size=image_size, state_dim=len(JOINTS), action_dim=len(JOINTS)
        )
        self.control_hz = control_hz
        self.chunk_noise = chunk_noise
        self.patch = image_size // 8
        self.embed = nn.Linear(3 * self.patch * self.patch, width)
        self.state_embed = nn.Linear(2 * len(JOINTS), width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(4)
        )
        self.head = nn.Linear(width, 2 * len(JOINTS))
        self.depth = 4

    def features(self, obs: dict) -> torch.Tensor:
        """-> (1, width): the network's reading of image, state and committed actions."""
        image = obs[image_key(CAMERA)]  # (1, 3, S, S)
        p = self.patch
        tokens = image.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)
        committed = obs[OBS_COMMITTED_ACTIONS]  # (1, D, A)
        last = committed[:, -1] if committed.shape[1] else torch.zeros_like(obs[OBS_STATE])
        x = self.embed(tokens) + self.state_embed(torch.cat([obs[OBS_STATE], last], -1))[:, None]
        for i in range(self.depth):
            x = x + self.blocks[i % len(self.blocks)](x)
        return x.mean(1)

    def predict_chunk(self, obs: dict, obs_step: torch.Tensor | None = None) -> ActionChunk:
        obs_step = obs_step if obs_step is not None else torch.zeros(1, dtype=torch.long)
        h = self.features(obs)
        offset, slope = (self.chunk_noise / 2 * torch.tanh(self.head(h))).chunk(2, -1)  # (1, A) each
        horizon = self.config.horizon
        j = torch.arange(horizon, dtype=torch.float32)
        t = (obs_step.float()[:, None] + j) / self.control_hz  # (1, H) seconds
        phase = torch.arange(len(JOINTS), dtype=torch.float32) * (math.pi / 4)
        reference = REFERENCE_AMPLITUDE * torch.sin(2 * math.pi * REFERENCE_HZ * t[..., None] + phase)  # (1, H, A)
        correction = offset[:, None] + slope[:, None] * (j / horizon)[None, :, None]
        return ActionChunk(reference + correction, obs_step)


class BenchLowLatencyPolicy(BenchPolicy):
    """BenchPolicy with a low-latency part of the project's part's shape and cost (`policies.low_latency`, which
    this layer may not import): a keypoint CNN of the diffusion policy's default size (32 channels, 32
    keypoints) on the freshest image, then an MLP (256 wide) over it, the state, LOW_LATENCY_ROWS plan rows with
    their mask, the plan's age and the steps since the request; its correction bounded by ``chunk_noise``."""

    def __init__(self, horizon: int, control_hz: float, image_size: int, chunk_noise: float):
        super().__init__(horizon, control_hz, image_size, chunk_noise)
        self.config.low_latency, self.config.low_latency_rows = True, LOW_LATENCY_ROWS
        c, k, a, hidden = 32, 32, len(JOINTS), 256
        self.part_cnn = nn.Sequential(
            nn.Conv2d(3, c, 3, stride=2, padding=1), nn.GroupNorm(8, c), nn.Mish(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.GroupNorm(8, 2 * c), nn.Mish(),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.GroupNorm(8, 2 * c), nn.Mish(),
            nn.Conv2d(2 * c, k, 1),
        )  # fmt: skip
        in_dim = a + 2 * k + LOW_LATENCY_ROWS * (a + 1) + 3
        self.part_mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.Mish(), nn.Linear(hidden, hidden), nn.Mish(),
                                      nn.Linear(hidden, a))  # fmt: skip
        self.max_age = 2 * horizon

    @torch.no_grad()
    def low_latency_step(self, obs: dict, base: torch.Tensor, context) -> torch.Tensor:
        maps = self.part_cnn(obs[image_key(CAMERA)].float() * 2.0 - 1.0)  # (1, K, h, w)
        b, _, h, w = maps.shape
        grid = torch.stack(torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij"), -1)
        keypoints = (maps.flatten(2).softmax(-1) @ grid.reshape(h * w, 2)).reshape(b, -1)  # (1, 2K)
        mask = context.queued.float()
        age = context.plan_age.float()[:, None]
        parts = [obs[OBS_STATE].float(), keypoints, (context.plan.float() * mask[..., None]).flatten(1), mask,
                 age.clamp(min=0) / self.max_age, (age >= 0).float(),
                 context.since_request.float()[:, None] / self.max_age]  # fmt: skip
        return base + self.chunk_noise * torch.tanh(self.part_mlp(torch.cat(parts, -1)))


def build_bench_policy(inference_ms: float, horizon: int, control_hz: float, image_size: int, chunk_noise: float,
                       depth: int = 0, low_latency: bool = False):  # fmt: skip
    """Build BenchPolicy (with ``low_latency``, BenchLowLatencyPolicy) and set its depth so one chunk takes
    ``inference_ms`` here (call it on the inference core), or to ``depth`` when given (calibrated before: a loaded
    core would calibrate it too shallow)."""
    torch.manual_seed(0)
    policy = (BenchLowLatencyPolicy if low_latency else BenchPolicy)(horizon, control_hz, image_size, chunk_noise)
    policy = policy.eval()
    if depth:
        policy.depth = depth
        return policy
    obs = {
        image_key(CAMERA): torch.rand(1, 3, image_size, image_size),
        OBS_STATE: torch.zeros(1, len(JOINTS)),
        OBS_COMMITTED_ACTIONS: torch.zeros(1, horizon, len(JOINTS)),
        "task": [""],
    }

    def seconds(depth: int) -> float:
        policy.depth = depth
        with torch.inference_mode():
            policy.predict_chunk(obs)  # warm-up
            times = []
            for _ in range(5):
                start = time.perf_counter()
                policy.predict_chunk(obs)
                times.append(time.perf_counter() - start)
        return min(times)  # the fastest run is the one other processes disturbed least

    base = seconds(4)
    per_block = max((seconds(36) - base) / 32, 1e-6)
    policy.depth = max(4, round(4 + (inference_ms / 1e3 - base) / per_block))
    return policy


def _bench_obs(horizon: int, image_size: int) -> dict:
    return {image_key(CAMERA): torch.rand(1, 3, image_size, image_size), OBS_STATE: torch.zeros(1, len(JOINTS)),
            OBS_COMMITTED_ACTIONS: torch.zeros(1, horizon, len(JOINTS)), "task": [""]}  # fmt: skip


def _inference_core_side(cfg: BenchBridgeConfig, depth: int, passes: int, results) -> None:
    """Spawned, on the inference core at the worker's niceness with one torch thread, as serve's worker runs: the
    calibrated depth (``depth`` 0), or the latency (ms) of ``passes`` chunks at ``depth``."""
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    if cfg.inference_nice > 0:
        os.nice(cfg.inference_nice)
    torch.set_num_threads(1)
    horizon = 16
    policy = build_bench_policy(cfg.inference_ms, horizon, max(cfg.rates_hz), cfg.image_size, cfg.chunk_noise, depth)
    if not depth:
        results.put(policy.depth)
        return
    obs, times = _bench_obs(horizon, cfg.image_size), []
    with torch.inference_mode():
        policy.predict_chunk(obs)  # warm-up
        for _ in range(passes):
            start = time.perf_counter()
            policy.predict_chunk(obs)
            times.append((time.perf_counter() - start) * 1e3)
    results.put(times)


def _on_inference_core(cfg: BenchBridgeConfig, depth: int = 0, passes: int = 0):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_inference_core_side, args=(cfg, depth, passes, results), name="bench-inference")
    with normal_scheduling():
        process.start()
    try:
        return results.get(timeout=600)
    finally:
        process.join(30)


def _training_load(stop, results) -> None:
    """Spawned: a training run at normal priority on the inference core until ``stop`` (an MLP autoencoder on a
    fixed batch, AdamW, one torch thread): the CPU a fine-tuning job on the robot PC takes. Puts its steps/s."""
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, steps, start = torch.randn(256, 256), 0, time.monotonic()
    while not stop.is_set():
        loss = (model(batch) - batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    results.put(steps / (time.monotonic() - start))


class TrainingLoad:
    """The training run of ``--load`` as a context: started on entry, stopped on exit (``steps_per_s`` then)."""

    def __init__(self, enabled: bool):
        self.enabled, self.steps_per_s = enabled, None

    def __enter__(self):
        if self.enabled:
            ctx = multiprocessing.get_context("spawn")
            self._results, self._stop = ctx.Queue(), ctx.Event()
            self._process = ctx.Process(target=_training_load, args=(self._stop, self._results), name="bench-load")
            with normal_scheduling():
                self._process.start()
            time.sleep(2.0)  # its imports done: the core is busy from here
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self.steps_per_s = round(self._results.get(timeout=60), 2)
            self._process.join(30)


def lead_steps(cfg: BenchBridgeConfig, rate: float, output: str) -> int:
    """serve's ``chunking.lead_steps`` for ``output`` at ``rate``: ``trajectory_lead_s`` in steps, rounded up."""
    return math.ceil(cfg.trajectory_lead_s * rate - 1e-9) if output == "trajectory" else 0


def size_horizon(cfg: BenchBridgeConfig, latencies_ms: list[float]) -> int:
    """The chunk length from inference latencies (the sizing run's, under the load when on): one request is in
    flight at a time, so a chunk must last through two inference delays, taken at 1.5x the p99, the trajectory
    lead after the second (the next chunk's first point; counted for per-tick output too, whose runs then have
    a longer chunk than they need: the sizing run serves trajectories), and the steps executed before the next
    request; at least 16."""
    p99_s = float(np.percentile(latencies_ms, 99)) / 1e3
    rate = max(cfg.rates_hz)
    return max(16, math.ceil(2 * 1.5 * p99_s * rate) + lead_steps(cfg, rate, "trajectory") + cfg.execute_steps)


def bench_arm_urdf() -> str:
    """The bench arm as a URDF: ``JOINTS`` revolute about z in a chain, +-pi, 10 rad/s (its sines stay well
    inside both: amplitude 0.2, at most 0.2 * 2 pi * 0.5 = 0.63 rad/s)."""
    joints, parent = [], "base"
    for i, name in enumerate(JOINTS):
        joints.append(f'''  <link name="link{i + 1}"/>
  <joint name="{name}" type="revolute">
    <parent link="{parent}"/>
    <child link="link{i + 1}"/>
    <origin xyz="0 0 0.1" rpy="0 0 0"/>
    <axis xyz="0 0 1"/>
    <limit lower="-3.1416" upper="3.1416" velocity="10.0" effort="10"/>
  </joint>''')
        parent = f"link{i + 1}"
    return '<robot name="bench_arm">\n  <link name="base"/>\n' + "\n".join(joints) + "\n</robot>\n"


# -- the serve side -----------------------------------------------------------------------------


def _serve_side(cfg: BenchBridgeConfig, rate: float, merge: MergeMode, output: str, horizon: int, depth: int,
                results, stop) -> None:  # fmt: skip
    """Spawned: run the bridge (serve's ``output`` mode; the policy at the calibrated ``depth``) and the ping echo
    until ``stop``; put tick records and counters on ``results``."""
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import JointState

    from robot_bridge.config import CameraTopic, ServeConfig
    from robot_bridge.node import PolicyBridge, make_executor

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    # As `serve` does, before rclpy starts its DDS threads. Each returns None when granted, else why
    # not; the results go into the JSON, since they decide what the miss count means.
    rt_problem = use_realtime(50)
    lock_problem = lock_memory()  # as `serve` does (control_lock_memory)
    torch.set_num_threads(1)
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=cfg.domain_id)
    serve_cfg = ServeConfig(
        checkpoint="(bench policy)", cameras=[CameraTopic(CAMERA, topics.camera(CAMERA).name)],
        state_names=list(JOINTS), action_names=list(JOINTS), action_space="joint", control_hz=rate,
        horizon=horizon, chunking=ChunkingConfig(execute_steps=cfg.execute_steps, merge=merge,
                                                 lead_steps=lead_steps(cfg, rate, output)),
        inference=cfg.inference, inference_cpu=1, control_cpu=0, diagnostics_hz=2.0, inference_nice=cfg.inference_nice,
        ros_executor=cfg.ros_executor, deadline_ms=cfg.deadline_ms, latency_log="", output=output,
        robot_description=str(Path(cfg.output_json).parent / "bench_arm.urdf") if output == "trajectory" else "",
    )  # fmt: skip
    serve_cfg.safety.stale_after_s = 0.5
    serve_cfg.safety.initial_command = {}
    # The bench arm is not the sim Panda: its joints follow sines around 0, outside the Panda's
    # joint4 range, so the Panda's state bounds would reject every state.
    serve_cfg.safety.state_bounds = {}
    ticks: list[tuple] = []  # (step, scheduled, published, from_policy, seam, command), then the state stamp in us
    part = cfg.low_latency and output == "ticks"  # the sizing run serves trajectories: no part
    loader = partial(build_bench_policy, cfg.inference_ms, horizon, rate, cfg.image_size, cfg.chunk_noise, depth, part)
    bridge = PolicyBridge(
        serve_cfg, loader, on_tick=lambda r: ticks.append((r.step, r.scheduled, r.published, r.from_policy, r.seam,
                                                           None if r.command is None else r.command.tolist(),
                                                           round(r.obs_stamp * 1e6))),
        context=context,
    )  # fmt: skip
    echo = rclpy.create_node("bench_echo", context=context)
    pong = echo.create_publisher(JointState, PONG_TOPIC, QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    echo.create_subscription(
        JointState, PING_TOPIC, pong.publish, QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
    )
    executor = make_executor(cfg.ros_executor, context)  # the echo shares it: the baseline pays the same dispatch
    executor.add_node(bridge)
    executor.add_node(echo)
    quiet_interpreter()  # as `serve` does
    while not stop.is_set():
        executor.spin_once(timeout_sec=0.05)
    results.put({
        "ticks": ticks, "counters": dict(bridge.diagnostics.counters),
        "inference_latency_ms": bridge.diagnostics.latencies_ms,
        "after_command_max_ms": bridge.diagnostics.after_command_max_ms,
        "obs_to_command_ms": bridge.diagnostics.obs_to_command_ms,
        "low_latency_ms": list(bridge.diagnostics.low_latency_ms),  # the part's latest 1,000 ticks (ms), if any
        "policy_info": bridge.scheduler.policy_info, "state": bridge.hold.state, "cause": bridge.hold.cause,
        "scheduling": scheduling_record(rt_problem, lock_problem),
    })  # fmt: skip
    bridge.close()
    echo.destroy_node()
    rclpy.try_shutdown(context=context)


# -- the robot side -----------------------------------------------------------------------------


class BenchRobot:
    """Publishes pings or joint states + images on a fixed schedule; records DDS receive times of the replies.

    Against ``output=trajectory`` it is a joint trajectory controller at the control rate
    (`robot_bridge.trajectory_follower`, the rules sim-robot follows): each tick moves the arm to the setpoint
    (perfect tracking) and is starved when the trajectory in force has ended; each trajectory of more than one
    point (a chunk; a hold has one) is late when it arrives after the time of its first point, and its margin
    (that time minus the arrival) is recorded.
    """

    def __init__(self, context, image_size: int):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import String
        from trajectory_msgs.msg import JointTrajectory

        self.JointState = JointState
        self.node = rclpy.create_node("bench_robot", context=context)
        best_effort = QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.state_pub = self.node.create_publisher(JointState, topics.JOINT_STATES.name, best_effort)
        self.image_pub = self.node.create_publisher(Image, topics.camera(CAMERA).name, best_effort)
        self.ping_pub = self.node.create_publisher(JointState, PING_TOPIC, best_effort)
        self.image = Image(height=image_size, width=image_size, encoding="rgb8", step=3 * image_size)
        self.image.data = np.random.default_rng(0).integers(0, 256, 3 * image_size**2, dtype=np.uint8).tobytes()
        self.position = [0.0] * len(JOINTS)  # perfect tracking: the state is the last command
        self.commands: dict[int, int] = {}  # state stamp ns -> receive ns of the first command stamped with it
        self.pongs: dict[int, int] = {}  # ping stamp ns -> pong receive ns
        self.chunks = 0
        self.bridge_state = ""
        self.follower = TrajectoryFollower(JOINTS)  # output=trajectory: the controller's setpoint
        self.follower_lock = threading.Lock()  # the schedule's thread ticks it, the executor's offers to it
        self.follow = False  # whether the ticks follow trajectories (output=trajectory)
        self.counting = False  # whether ticks, starvation and chunk margins are counted (the measured cycles)
        self.ticks = self.starved_ticks = 0
        self.chunk_margins_ms: list[float] = []  # per chunk: its first point's time minus its arrival
        self.chunk_first_points_ns: list[tuple[int, int]] = []  # per chunk: (its start stamp, its first point's time)
        # per chunk: its arrival minus its DDS source timestamp (taken when serve wrote it): a late chunk's
        # lateness is then placed in the transport (this) or before it (the rest of its margin)
        self.chunk_transits_ms: list[float] = []
        self.node.create_subscription(JointTrajectory, topics.JOINT_TRAJECTORY.name, self._on_command, reliable)
        self.node.create_subscription(JointTrajectory, topics.ARM_TRAJECTORY.name, self._on_trajectory, reliable)
        self.node.create_subscription(JointState, PONG_TOPIC, self._on_pong, reliable)
        self.node.create_subscription(DiagnosticArray, topics.DIAGNOSTICS.name, self._on_diagnostics, reliable)
        self.node.create_subscription(String, topics.CHUNK_INFO.name, self._on_chunk, reliable)

    @staticmethod
    def _stamp_ns(header) -> int:
        return header.stamp.sec * 1_000_000_000 + header.stamp.nanosec

    def _on_command(self, msg, info) -> None:
        # The first command stamped with a state is the one computed on arrival; the node's
        # watchdog repeats the hold with the same stamp once states stop.
        self.commands.setdefault(self._stamp_ns(msg.header), info["received_timestamp"])
        self.position = list(msg.points[0].positions)

    def _on_trajectory(self, msg, info) -> None:
        from robot_bridge.codec import trajectory_points

        arrival = info["received_timestamp"]
        start, times, positions = trajectory_points(msg, JOINTS)
        if self.counting and len(times) > 1:
            self.chunk_first_points_ns.append((start, int(times[0])))
            self.chunk_margins_ms.append((start + int(times[0]) - arrival) / 1e6)
            self.chunk_transits_ms.append((arrival - info["source_timestamp"]) / 1e6)
        with self.follower_lock:
            self.follower.offer(start, times, positions, arrival, np.asarray(self.position))

    def control_tick(self, now_ns: int) -> None:
        """output=trajectory: the controller's tick at ``now_ns``: the arm at the setpoint, starvation counted."""
        with self.follower_lock:
            if not self.follower.active:
                return
            self.position = self.follower.setpoint(np.array([now_ns]))[0].tolist()
            if self.counting:
                self.ticks += 1
                self.starved_ticks += self.follower.starved(now_ns)

    def start_counting(self) -> None:
        self.ticks = self.starved_ticks = 0
        self.chunk_margins_ms, self.chunk_transits_ms, self.chunk_first_points_ns = [], [], []
        self.counting = True

    def _on_pong(self, msg, info) -> None:
        self.pongs[self._stamp_ns(msg.header)] = info["received_timestamp"]

    def _on_diagnostics(self, msg) -> None:
        self.bridge_state = {kv.key: kv.value for kv in msg.status[0].values}.get("state", "")

    def _on_chunk(self, msg) -> None:
        self.chunks += 1

    def _message(self, stamp_ns: int):
        msg = self.JointState()
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
        msg.name = JOINTS
        msg.position = self.position
        return msg

    def run_schedule(self, period: float, count: int, kind: str, until=None) -> list[int]:
        """Publish ``count`` cycles (or until ``until()``) one period apart; returns the send stamps (ns)."""
        sent = []
        next_time = time.monotonic()
        for _ in range(count):
            next_time += period
            delay = next_time - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            stamp = time.time_ns()
            if self.follow:
                self.control_tick(stamp)  # the state it publishes is where this tick put the arm
            if kind == "ping":
                self.ping_pub.publish(self._message(stamp))
            else:
                msg = self._message(stamp)
                self.image.header.stamp = msg.header.stamp
                self.state_pub.publish(msg)  # the state first: it triggers the bridge's tick
                self.image_pub.publish(self.image)
            sent.append(stamp)
            if until is not None and until():
                break
        return sent


def _spin_while(executor, thread: threading.Thread) -> None:
    while thread.is_alive():
        executor.spin_once(timeout_sec=0.01)
    end = time.monotonic() + 0.3  # late replies
    while time.monotonic() < end:
        executor.spin_once(timeout_sec=0.01)


def _in_thread(executor, fn, *args, **kwargs):
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args, **kwargs)))
    thread.start()
    _spin_while(executor, thread)
    return out["value"]


# -- statistics ---------------------------------------------------------------------------------


def scheduling_record(rt_problem: str | None, lock_problem: str | None) -> dict[str, Any]:
    """What `use_realtime` and `lock_memory` returned (None = granted, else why not), as the JSON records it."""
    return {
        "realtime_scheduling": rt_problem is None, "realtime_problem": rt_problem,
        "memory_locked": lock_problem is None, "memory_lock_problem": lock_problem,
    }  # fmt: skip


def deadline_misses(sent_ns: list[int], received_ns: dict[int, int], deadline_ms: float) -> tuple[list[int], int]:
    """(indices of the cycles whose command came more than deadline_ms after the state was sent, lost commands).

    ``received_ns`` maps a state's send stamp to the receive time of its first command; a state
    missing from it never got one (lost). The deadline is absolute, the same at every rate.
    """
    late = [i for i, s in enumerate(sent_ns) if s in received_ns and (received_ns[s] - s) / 1e6 > deadline_ms]
    return late, sum(1 for s in sent_ns if s not in received_ns)


def _quantiles(values_ms, qs=(50, 99)) -> dict[str, float]:
    values = np.asarray(values_ms, dtype=np.float64)
    if values.size == 0:
        return {f"p{q}": float("nan") for q in qs} | {"max": float("nan")}
    return {f"p{q}": round(float(np.percentile(values, q)), 4) for q in qs} | {"max": round(float(values.max()), 4)}


def seam_jumps(ticks: list[tuple], period: float) -> dict[str, float]:
    """Largest velocity jump (units/s per step, any dim) at chunk seams vs elsewhere, over commands from the policy.

    A hold (or a tick where the queue ran dry) breaks the sequence: those jumps are starvation, counted apart.
    """
    seam_max = within_max = 0.0
    run: list[tuple] = []  # consecutive policy ticks (step, seam, command)
    for step, _, _, from_policy, seam, command, *_ in ticks:
        if not from_policy or (run and step != run[-1][0] + 1):
            run = []
            if not from_policy:
                continue
        run.append((step, seam, np.asarray(command)))
        if len(run) < 4:  # need three velocities, and the first command after a hold is excluded
            continue
        (_, _, c1), (_, s2, c2), (_, s3, c3) = run[-3:]
        v_prev, v_now = (c2 - c1) / period, (c3 - c2) / period
        jump = float(np.abs(v_now - v_prev).max())
        if s2 or s3:  # this jump involves the first command of a newly merged chunk
            seam_max = max(seam_max, jump)
        else:
            within_max = max(within_max, jump)
    return {"seam_max_velocity_jump": round(seam_max, 6), "within_max_velocity_jump": round(within_max, 6)}


def _run_one(cfg, executor, robot: BenchRobot, rate: float, merge: MergeMode, output: str, horizon: int, depth: int,
             cycles: int, ping_cycles: int, until_chunks: int = 0, give_up_s: float = 0.0) -> tuple[dict, dict | None]:  # fmt: skip
    """One serve process: optionally the raw ping-pong first (its bridge idle, fed no state), then the bridge for
    ``cycles`` ticks, or (``until_chunks``) until that many more chunks came or ``give_up_s`` passed."""
    period = 1.0 / rate
    ctx = multiprocessing.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Event()
    serve = ctx.Process(target=_serve_side, args=(cfg, rate, merge, output, horizon, depth, results, stop),
                        name="bench-serve")  # fmt: skip
    with normal_scheduling():
        serve.start()
    ping = None
    robot.bridge_state = ""
    robot.follow, robot.counting = output == "trajectory", False
    with robot.follower_lock:
        robot.follower.clear()
    if ping_cycles:
        robot.pongs.clear()
        deadline = time.monotonic() + cfg.start_timeout_s
        # Ping until the echo is discovered and the bridge has loaded its policy (idle, holding:
        # no states yet), then measure; the loading worker's start-up is not the baseline's.
        _in_thread(executor, robot.run_schedule, period, 10**9, "ping",
                   until=lambda: (robot.pongs and robot.bridge_state not in ("", "LOADING"))
                   or time.monotonic() > deadline)  # fmt: skip
        robot.pongs.clear()
        sent = _in_thread(executor, robot.run_schedule, period, ping_cycles, "ping")
        rtt = [(robot.pongs[s] - s) / 1e6 for s in sent if s in robot.pongs]
        if not rtt:
            stop.set()
            serve.join(30)
            raise RuntimeError(
                f"none of {len(sent)} pings came back from the serve process's echo within {cfg.start_timeout_s} s "
                f"of its start (bridge state {robot.bridge_state!r}): there is no baseline to subtract"
            )
        ping = {"rate_hz": rate, "pings": len(sent), "pongs": len(rtt), "round_trip_ms": _quantiles(rtt)}
    robot.chunks = 0
    # Warm-up: the robot streams until the bridge runs its first chunks (loading and calibration).
    deadline = time.monotonic() + cfg.start_timeout_s
    _in_thread(
        executor, robot.run_schedule, period, 10**9, "state",
        until=lambda: (robot.chunks >= 2 and robot.bridge_state == "RUNNING") or time.monotonic() > deadline,
    )  # fmt: skip
    if robot.chunks < 2:
        stop.set()
        serve.join(30)
        raise RuntimeError(
            f"the serve node produced no chunks within {cfg.start_timeout_s} s (state {robot.bridge_state!r})"
        )
    robot.commands.clear()
    robot.start_counting()
    counted_from, give_up = robot.chunks, time.monotonic() + give_up_s
    sent = _in_thread(executor, robot.run_schedule, period, cycles, "state",
                      until=(lambda: robot.chunks - counted_from >= until_chunks or time.monotonic() > give_up)
                      if until_chunks else None)  # fmt: skip
    chunks_counted = robot.chunks - counted_from
    robot.counting = False
    stop.set()
    serve_result = results.get(timeout=60)
    serve.join(30)
    row = {"output": output, "rate_hz": rate, "merge": merge, "cycles": len(sent),
           "inference_latency_ms": _quantiles(serve_result["inference_latency_ms"]),
           "inference_latencies_ms": [round(v, 3) for v in serve_result["inference_latency_ms"]],  # per merged chunk
           "after_command_max_ms": round(serve_result["after_command_max_ms"], 3),  # over the process, warm-up too
           "chunks_counted": chunks_counted,  # merged chunks announced during the measured ticks
           "obs_to_influenced_command_ms": _quantiles(serve_result["obs_to_command_ms"]),
           "low_latency_ms": _quantiles(serve_result["low_latency_ms"]),  # the part per tick (latest 1,000 ticks)
           "node_counters": serve_result["counters"], "policy_info": serve_result["policy_info"],
           "scheduling": serve_result["scheduling"]}  # fmt: skip
    if output == "trajectory":
        margins, transits = robot.chunk_margins_ms, robot.chunk_transits_ms
        # The lead's arithmetic, no clock in it: a chunk merged at the tick of the state stamped s starts at s + (1 + L)
        # periods (the tick of step n + 1 + L) with its first point one period later.
        period_ns, lead = round(1e9 / rate), lead_steps(cfg, rate, output)
        states = np.array(sorted(sent), dtype=np.int64)
        on_seam = sum(abs(first - period_ns) <= 1_000 and states.size > 0
                      and np.abs(states - (start - (1 + lead) * period_ns)).min() <= 1_000
                      for start, first in robot.chunk_first_points_ns)  # fmt: skip
        late = [{"margin_ms": round(m, 3), "transit_ms": round(t, 3)} for m, t in zip(margins, transits) if m < 0]
        return {**row, "ticks": robot.ticks, "starved_ticks": robot.starved_ticks,
                "chunks_received": len(margins), "late_chunks": len(late), "chunks_on_their_seam": int(on_seam),
                "chunk_margin_ms": {"min": round(min(margins), 4) if margins else float("nan"),
                                    **_quantiles(margins, qs=(1, 50))},
                "chunk_transit_ms": _quantiles(transits), "late_chunk_details": late}, ping  # fmt: skip
    return {**row, **_tick_mode_figures(cfg, sent, robot.commands, serve_result["ticks"], period)}, ping


def _tick_mode_figures(cfg: BenchBridgeConfig, sent: list[int], commands: dict[int, int], ticks: list[tuple],
                       period: float) -> dict:  # fmt: skip
    """The per-tick output's figures from the states sent (ns), the commands' receive times by state stamp and
    the node's tick records."""
    latency_ms = [(commands[s] - s) / 1e6 for s in sent if s in commands]
    late_at, lost = deadline_misses(sent, commands, cfg.deadline_ms)
    # Between the commands of consecutive measured cycles (a lost one merges two intervals).
    intervals = np.diff(np.asarray([commands[s] for s in sent if s in commands], dtype=np.int64)) / 1e6
    # The tick each measured state triggered: the first stamped with it (watchdog ticks repeat the stamp).
    sent_us = {round(s / 1e3) for s in sent}
    first_ticks: dict[int, tuple] = {}
    for t in ticks:
        if t[6] in sent_us:
            first_ticks.setdefault(t[6], t)
    measured = list(first_ticks.values())
    return {
        "commands_received": len(latency_ms), "deadline_ms": cfg.deadline_ms, "deadline_misses": len(late_at) + lost,
        "lost_commands": lost, "late_commands": len(late_at),
        "late_cycles": late_at[:50],  # indices into the measured cycles, to tell start-up from steady state
        "node_deadline_misses": sum(1 for t in measured if t[2] - t[1] > cfg.deadline_ms / 1e3),
        "starved_ticks": sum(1 for t in measured if not t[3]),  # ticks without a queued policy action (held instead)
        "state_to_command_ms": _quantiles(latency_ms),
        # Inside the node: the joint state callback starting -> command handed to ROS.
        "node_tick_latency_ms": _quantiles([(t[2] - t[1]) * 1e3 for t in measured]),
        "jitter_ms": _quantiles(np.abs(intervals - period * 1e3)),
        "seams": seam_jumps(measured, period),
    }  # fmt: skip


def _sizing_run(cfg: BenchBridgeConfig, executor, robot: BenchRobot, depth: int, provisional: int,
                alone_max_ms: float) -> dict:  # fmt: skip
    """Serve at the highest rate (trajectory output, merge latest, a horizon of twice ``provisional``, the one the
    passes alone on the inference core gave, whose slowest took ``alone_max_ms``) until ``cfg.sizing_chunks`` more
    chunks came after the warm-up: inference then competes with the robot, the node and the load as in the measured
    runs (in the two runs of 2026-12-05 it was 16-36% slower there at the median than alone). Those chunks'
    latencies size the horizon of the measured runs; the warm-up's (the worker's first passes) do not."""
    rate = max(cfg.rates_hz)
    print(f"bench bridge: sizing run, {rate:g} Hz, output=trajectory, merge=latest, until {cfg.sizing_chunks} chunks",
          flush=True)  # fmt: skip
    # Four times the slowest pass alone per chunk before giving up: a stalled run must not hold the benchmark.
    give_up_s = cfg.start_timeout_s + cfg.sizing_chunks * 4 * alone_max_ms / 1e3
    run, _ = _run_one(cfg, executor, robot, rate, "latest", "trajectory", 2 * provisional, depth, 10**9, 0,
                      until_chunks=cfg.sizing_chunks, give_up_s=give_up_s)  # fmt: skip
    merged = run["inference_latencies_ms"]
    latencies = merged[-run["chunks_counted"] :] if run["chunks_counted"] else []  # after the warm-up
    if not latencies:
        raise RuntimeError(f"the sizing run merged no chunk after its warm-up in {give_up_s:.0f} s: there is no "
                           f"in-run inference latency to size the horizon on; give it with --horizon=N")  # fmt: skip
    if len(latencies) < cfg.sizing_chunks:
        print(f"bench bridge: WARNING: the sizing run gave up after {len(latencies)} of {cfg.sizing_chunks} chunks "
              f"({give_up_s:.0f} s); the horizon is sized on those", flush=True)  # fmt: skip
    horizon = size_horizon(cfg, latencies)
    print(f"bench bridge: inference in the sizing run p50/max {np.percentile(latencies, 50):.0f}/{max(latencies):.0f} ms"
          f" over {len(latencies)} chunks -> horizon {horizon}", flush=True)  # fmt: skip
    return {"horizon": horizon, "provisional_horizon": provisional, "sizing_run_horizon": 2 * provisional,
            "inference_latencies_ms": latencies, "warm_up_latencies_ms": merged[: len(merged) - len(latencies)],
            "cycles": run["cycles"], "starved_ticks": run["starved_ticks"]}  # fmt: skip


def bench_bridge(cfg: BenchBridgeConfig) -> dict[str, Any]:
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    cfg.apply_quick()
    if not 50 <= cfg.inference_ms <= 500:
        raise ValueError(f"inference_ms must be in [50, 500], got {cfg.inference_ms}")
    if cfg.horizon and cfg.sizing_chunks:
        raise ValueError(f"--horizon={cfg.horizon} skips the sizing run that --sizing_chunks={cfg.sizing_chunks} "
                         f"sizes the horizon with: drop one")  # fmt: skip
    if not 0 <= cfg.trajectory_lead_s <= 5:
        raise ValueError(f"trajectory_lead_s must be in [0, 5] seconds, got {cfg.trajectory_lead_s}")
    if cfg.horizon and "trajectory" not in cfg.outputs and cfg.trajectory_lead_s != BenchBridgeConfig.trajectory_lead_s:
        raise ValueError(f"--trajectory_lead_s={cfg.trajectory_lead_s} does nothing with --outputs={cfg.outputs} and "
                         f"a given --horizon (no trajectory is served); drop it or add trajectory to --outputs")  # fmt: skip
    if cfg.sizing_chunks < 0:
        raise ValueError(f"sizing_chunks must be at least 1 (0 = the default), got {cfg.sizing_chunks}")
    if not cfg.horizon:
        cfg.sizing_chunks = cfg.sizing_chunks or (5 if cfg.quick else 20)
    if cfg.low_latency and (cfg.outputs != ["ticks"] or cfg.merges != ["latest"]):
        raise ValueError(f"--low_latency=true runs the part at every tick on the newest chunk, which trajectory output "
                         f"and the other merges do not: set --outputs=[ticks] --merges=[latest] (got {cfg.outputs}, "
                         f"{cfg.merges})")  # fmt: skip
    unknown = sorted(set(cfg.outputs) - {"ticks", "trajectory"})
    if unknown or not cfg.outputs:
        raise ValueError(f"outputs are serve's output modes, ticks and trajectory; got {cfg.outputs}")
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # inherited by the spawned serve processes
    os.environ["ROS_DOMAIN_ID"] = str(cfg.domain_id)
    out = Path(cfg.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / "bench_arm.urdf").write_text(bench_arm_urdf())  # trajectory output's robot description
    print(
        f"bench bridge: calibrating the bench policy to {cfg.inference_ms:g} ms on the idle inference core", flush=True
    )
    depth = _on_inference_core(cfg)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})  # the robot shares the inference core, where it wins over the niced worker
    # A robot driver runs its I/O at real-time priority too. The serve processes spawned below
    # start without it (their imports would hold this core) and ask for it themselves, as `serve` does.
    robot_rt_problem = use_realtime(50)
    if robot_rt_problem:  # said now, not only after minutes of measuring
        print(f"bench bridge: WARNING: real-time scheduling refused ({robot_rt_problem}); "
              f"expect deadline misses that are not the node's", flush=True)  # fmt: skip
    runs: list[dict] = []
    pings: dict[float, dict] = {}
    sizing = None
    with TrainingLoad(cfg.load) as load:
        loaded_ms = _on_inference_core(cfg, depth, passes=20)  # under the load when on, without the robot and serve
        horizon = cfg.horizon or size_horizon(cfg, loaded_ms)
        print(
            f"bench bridge: inference {'under load ' if cfg.load else ''}p50/max "
            f"{np.percentile(loaded_ms, 50):.0f}/{max(loaded_ms):.0f} ms alone on its core"
            + ("" if cfg.horizon else f" -> horizon {horizon} for the sizing run"),
            flush=True,
        )
        context = rclpy.Context()
        rclpy.init(context=context, domain_id=cfg.domain_id)
        executor = SingleThreadedExecutor(context=context)
        robot = BenchRobot(context, cfg.image_size)
        executor.add_node(robot.node)
        quiet_interpreter()
        try:
            if not cfg.horizon:
                sizing = _sizing_run(cfg, executor, robot, depth, horizon, max(loaded_ms))
                horizon = sizing["horizon"]
            for rate in cfg.rates_hz:
                per_merge = math.ceil(cfg.cycles / len(cfg.merges))
                for output in cfg.outputs:
                    for merge in cfg.merges:
                        print(f"bench bridge: {rate:g} Hz, output={output}, merge={merge}, {per_merge} cycles",
                              flush=True)  # fmt: skip
                        # The first run of each rate also measures the raw ping-pong baseline.
                        first = rate not in pings
                        run, ping = _run_one(cfg, executor, robot, rate, merge, output, horizon, depth, per_merge,
                                             cfg.ping_cycles if first else 0)  # fmt: skip
                        runs.append(run)
                        if ping is not None:
                            pings[rate] = ping
        finally:
            executor.shutdown()
            robot.node.destroy_node()
            rclpy.try_shutdown(context=context)
    result = _summarize(cfg, horizon, runs, pings, robot_rt_problem)
    result["inference"] = {"calibrated_ms": cfg.inference_ms, "depth": depth, "loaded": cfg.load,
                           "measured_ms": _quantiles(loaded_ms), "load_steps_per_s": load.steps_per_s}  # fmt: skip
    result["sizing"] = sizing
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out)
    return result


def _summarize(
    cfg: BenchBridgeConfig, horizon: int, runs: list[dict], pings: dict, robot_rt_problem: str | None = None
) -> dict[str, Any]:
    per_rate = {}
    for rate in cfg.rates_hz:
        rows = [r for r in runs if r["rate_hz"] == rate and r["output"] == "ticks"]
        traj = [r for r in runs if r["rate_hz"] == rate and r["output"] == "trajectory"]
        raw = pings[rate]["round_trip_ms"]
        per_rate[str(rate)] = {
            "raw_round_trip_ms": raw,
            "raw_pongs": [pings[rate]["pongs"], pings[rate]["pings"]],  # answered, sent
        }
        if rows:
            bridge_p99 = max(r["state_to_command_ms"]["p99"] for r in rows)
            bridge_p50 = max(r["state_to_command_ms"]["p50"] for r in rows)
            per_rate[str(rate)] |= {
                "tick_mode_late": sum(r["deadline_misses"] for r in rows),
                "tick_mode_cycles": sum(r["cycles"] for r in rows),
                "added_latency_p50_ms": round(bridge_p50 - raw["p50"], 4),
                "added_latency_p99_ms": round(bridge_p99 - raw["p99"], 4),
                "jitter_p50_ms": max(r["jitter_ms"]["p50"] for r in rows),
                "jitter_p99_ms": max(r["jitter_ms"]["p99"] for r in rows),
                "seams": {r["merge"]: r["seams"] for r in rows},
            }
        if traj:
            per_rate[str(rate)] |= {
                "ticks": sum(r["ticks"] for r in traj), "starved_ticks": sum(r["starved_ticks"] for r in traj),
                "chunks_received": sum(r["chunks_received"] for r in traj),
                "late_chunks": sum(r["late_chunks"] for r in traj),
                "chunk_margin_min_ms": min(r["chunk_margin_ms"]["min"] for r in traj),
            }  # fmt: skip
        both = rows + traj
        per_rate[str(rate)] |= {  # the control loop's own stalls, either output (`overrun_ticks`)
            "overrun_ticks": sum(r["node_counters"]["overrun_ticks"] for r in both),
            "after_command_max_ms": max(r["after_command_max_ms"] for r in both),
        }  # fmt: skip
    problems = {r["scheduling"][k] for r in runs for k in ("realtime_problem", "memory_lock_problem")} - {None}
    rates = per_rate.values()

    def total(key: str) -> int:
        return sum(v.get(key, 0) for v in rates)

    def worst(key: str) -> float:
        values = [v[key] for v in rates if key in v]
        return max(values) if values else float("nan")

    return {
        "config": asdict(cfg),
        "horizon": horizon,
        "deadline_ms": cfg.deadline_ms,
        # Granted only if every serve process got it; the robot process's own real-time priority apart.
        "scheduling": {
            "realtime_scheduling": all(r["scheduling"]["realtime_scheduling"] for r in runs),
            "memory_locked": all(r["scheduling"]["memory_locked"] for r in runs),
            "robot_realtime_scheduling": robot_rt_problem is None,
            "problems": sorted(problems | ({robot_rt_problem} - {None})),
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "runs": runs,
        "pings": {str(k): v for k, v in pings.items()},
        "per_rate": per_rate,
        "starved_ticks": total("starved_ticks"), "late_chunks": total("late_chunks"),
        "tick_mode_late": total("tick_mode_late"), "ticks": total("ticks"),
        "added_latency_p99_ms": worst("added_latency_p99_ms"), "jitter_p99_ms": worst("jitter_p99_ms"),
    }  # fmt: skip


def format_summary(result: dict[str, Any]) -> str:
    inference = result.get("inference", {})
    measured = inference.get("measured_ms", {})
    lines = [
        f"bridge benchmark: inference {result['config']['inference_ms']:g} ms calibrated on the idle core"
        + (f", p50/max {measured['p50']:.0f}/{measured['max']:.0f} ms {'under load' if inference['loaded'] else 'idle'}"
           if measured else "")
        + f"; horizon {result['horizon']}; a tick-mode command more than {result['deadline_ms']:g} ms late is late"
    ]  # fmt: skip
    if inference.get("load_steps_per_s") is not None:
        lines.append(f"  training load on the inference core: {inference['load_steps_per_s']:g} steps/s")
    sizing = result.get("sizing")
    if sizing:
        lat = sizing["inference_latencies_ms"]
        lines.append(f"  horizon sized on the sizing run's inference ({len(lat)} chunks, p50/max "
                     f"{np.percentile(lat, 50):.0f}/{max(lat):.0f} ms); alone on the core it would have been "
                     f"{sizing['provisional_horizon']}")  # fmt: skip
    for run in result["runs"]:
        head = f"  {run['rate_hz']:>5g} Hz {run['output']:<10} {run['merge']:<8} cycles={run['cycles']} "
        inf, o2c = run["inference_latency_ms"], run["obs_to_influenced_command_ms"]
        tail = (f" inference p50/max={inf['p50']:.0f}/{inf['max']:.0f} ms obs->command p50/p99={o2c['p50']:.1f}/"
                f"{o2c['p99']:.1f} ms overruns={run['node_counters']['overrun_ticks']} "
                f"(after-command max {run['after_command_max_ms']:.1f} ms)")  # fmt: skip
        if run["output"] == "trajectory":
            margin, transit = run["chunk_margin_ms"], run["chunk_transit_ms"]
            lines.append(
                head + f"ticks={run['ticks']} starved={run['starved_ticks']} chunks={run['chunks_received']} "
                f"late={run['late_chunks']} margin min/p50={margin['min']:.1f}/{margin['p50']:.1f} ms "
                f"transit p50/max={transit['p50']:.1f}/{transit['max']:.1f} ms" + tail
            )
            continue
        s2c, seams = run["state_to_command_ms"], run["seams"]
        lines.append(
            head + f"late={run['deadline_misses']} (node {run['node_deadline_misses']}) starved={run['starved_ticks']} "
            f"state->command p50/p99={s2c['p50']:.3f}/{s2c['p99']:.3f} ms "
            f"jitter p50/p99={run['jitter_ms']['p50']:.3f}/{run['jitter_ms']['p99']:.3f} ms"
            f" seam/within velocity jump={seams['seam_max_velocity_jump']:.4f}/{seams['within_max_velocity_jump']:.4f}"
            + tail
        )  # fmt: skip
    for rate, row in result["per_rate"].items():
        raw = row["raw_round_trip_ms"]
        added = (f", tick mode added latency p50/p99={row['added_latency_p50_ms']:.3f}/{row['added_latency_p99_ms']:.3f} "
                 f"ms, jitter p99={row['jitter_p99_ms']:.3f} ms" if "added_latency_p99_ms" in row else "")  # fmt: skip
        lines.append(f"  {float(rate):>5g} Hz raw ping-pong ({row['raw_pongs'][0]}/{row['raw_pongs'][1]} answered) "
                     f"p50/p99={raw['p50']:.3f}/{raw['p99']:.3f} ms" + added)  # fmt: skip
    lines.append(f"results: {result['config']['output_json']}")
    lines.extend(scheduling_warnings(result))
    lines.append(final_line(result))
    return "\n".join(lines)


def scheduling_warnings(result: dict[str, Any]) -> list[str]:
    """A WARNING line for real-time scheduling and for memory locking when a serve process was refused it."""
    sched, runs = result["scheduling"], result["runs"]
    lines = []
    if not sched["realtime_scheduling"]:
        why = next(r["scheduling"]["realtime_problem"] for r in runs if not r["scheduling"]["realtime_scheduling"])
        lines.append(
            f"WARNING: real-time scheduling was refused ({why}): the control loop ran with normal scheduling, so "
            f"the deadline misses measure this machine's load, not the node; run as root or grant an rtprio limit"
        )
    if not sched["memory_locked"]:
        why = next(r["scheduling"]["memory_lock_problem"] for r in runs if not r["scheduling"]["memory_locked"])
        lines.append(f"WARNING: memory locking was refused ({why}): page faults can delay ticks")
    return lines


def final_line(result: dict[str, Any]) -> str:
    return (f"starved_ticks={result['starved_ticks']} late_chunks={result['late_chunks']} "
            f"tick_mode_late={result['tick_mode_late']} ticks={result['ticks']}")  # fmt: skip
