"""One end-to-end timeline of request latencies through each shell of the latency protocol (the object
itself is unit-tested in `tests/test_latency_protocol.py`): simulation's `DelayedChunkEnv` and the
robot node's `robot_bridge.chunk_scheduler.ChunkScheduler` (driven by a clock the test controls, with
the real inference worker in thread mode). Each shell's timeline is checked against values worked out
by hand, and, step by step, the emitted actions, the announced delays, the delay augmentation and the
RTC guidance of the two are equal.

The policy is a probe: chunk index j of a request conditioned on step t is
``[t + j, sum of committed actions' first column, number of committed rows, announced delay]``, and
it records everything it was given. So the emitted actions themselves carry what each request saw.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from shells import make_shell

from robot_bridge.chunk_scheduler import ChunkScheduler
from robot_bridge.config import SIM_ACTION_NAMES, SIM_STATE_NAMES, CameraTopic, ServeConfig
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.inference import InferenceResult, WorkerStatus
from robot_bridge.inputs import BridgeInputs
from robot_bridge.log_limit import LogLimiter
from robot_bridge.policy_health import fit_protocol
from vla_core.runtime import ChunkingConfig, DelayConfig, request_noise
from vla_core.types import (
    OBS_COMMITTED_ACTIONS,
    OBS_COMMITTED_MASK,
    OBS_DELAY_STEPS,
    OBS_MID_STATE,
    OBS_MID_STEPS,
    ActionChunk,
)

DT = 0.05  # control period, seconds
H, S, D_MAX, WINDOW = 8, 3, 4, 2  # chunk length, steps per chunk, policy's max_delay_steps, estimate window
STEPS = 60
# Delay of each request in control steps (>= 1: a robot's answer is found at the earliest by the next tick).
TIMELINE = [2, 1, 3, 4, 1, 2, 4, 3, 1, 1, 2, 4, 2, 3, 1, 4, 2, 2, 3, 1, 4, 4, 1, 3]
HOLD = -1.0
LOW_LATENCY_ROWS = 3  # plan rows a low-latency probe reads


class ProbePolicy:
    """See the module docstring. ``seen`` lists (obs_step, delay, committed (D, A), mask (D,), guidance)."""

    supports_inpainting = True

    def __init__(self, latency_aware: bool = False, lead: int = 0, low_latency: bool = False):
        self.config = SimpleNamespace(  # trained for the timeline's delays plus the lead
            horizon=H, n_action_steps=S, image_size=None, state_dim=len(SIM_STATE_NAMES),
            action_dim=len(SIM_ACTION_NAMES), max_delay_steps=0 if latency_aware else D_MAX + lead,
            latency_aware=latency_aware, latency_max_delay=D_MAX, mid_fraction=0.5, mid_cameras=[],
            low_latency=low_latency, low_latency_rows=LOW_LATENCY_ROWS,
        )  # fmt: skip
        self.seen: list[tuple] = []
        self.steps: list[tuple] = []  # a low-latency probe's (state[0], base, plan age, since request, plan) per step
        self.mid: list[tuple[float, int]] = []  # a latency-aware probe's (mid state[0], mid steps) per request
        self.noise: list[torch.Tensor | None] = []  # the sampler noise each request was given (None: none)

    def low_latency_step(self, obs, base, context):
        """The low-latency part: records what it read and moves the base's last column by 100."""
        state = float(torch.as_tensor(obs["observation.state"])[0, 0])
        self.steps.append((state, base[0].tolist(), int(context.plan_age[0]), int(context.since_request[0]),
                           (context.plan[0] * context.queued[0, :, None]).tolist()))  # fmt: skip
        out = base.clone().float()
        out[:, 3] += 100
        return out

    def prepare_request(self, obs):  # the slow part of a latency-aware policy (`LatencyAwarePolicy`): nothing here
        return {"prepared": True}

    def predict_chunk(self, obs, obs_step=None, *, inpaint=None, prepared=None, noise=None) -> ActionChunk:
        committed = torch.as_tensor(obs[OBS_COMMITTED_ACTIONS])[0].float()
        mask = torch.as_tensor(obs[OBS_COMMITTED_MASK])[0].bool()
        delay = int(torch.as_tensor(obs[OBS_DELAY_STEPS])[0])
        t = int(obs_step[0])
        guidance = None if inpaint is None else tuple(g[0].float().clone() for g in inpaint)
        self.seen.append((t, delay, committed.clone(), mask.clone(), guidance))
        self.noise.append(None if noise is None else noise.clone())
        if self.config.latency_aware:
            self.mid.append(
                (float(torch.as_tensor(obs[OBS_MID_STATE])[0, 0]), int(torch.as_tensor(obs[OBS_MID_STEPS])[0]))
            )
        actions = torch.zeros(1, H, 4)
        actions[0, :, 0] = t + torch.arange(H, dtype=torch.float32)
        actions[0, :, 1] = committed[:, 0].sum()
        actions[0, :, 2] = float(mask.sum())
        actions[0, :, 3] = delay
        return ActionChunk(actions, obs_step)


class RecordingEnv:
    """One world of the sim arm's action size that never ends; records every action applied."""

    num_envs, action_dim, device = 1, len(SIM_ACTION_NAMES), torch.device("cpu")

    def __init__(self):
        self.applied: list[list[float]] = []

    def _obs(self):  # the state's first value is the step the observation is of
        state = torch.zeros(1, len(SIM_STATE_NAMES))
        state[0, 0] = len(self.applied)
        return {"observation.state": state, "task": ["probe"]}

    def reset(self, seed=None, *, worlds=None):
        return self._obs()

    def step(self, actions):
        self.applied.append(actions[0].tolist())
        no = torch.zeros(1, dtype=torch.bool)
        return self._obs(), torch.zeros(1), no, no.clone(), {"success": no.clone()}

    def hold_actions(self):
        return torch.full((1, self.action_dim), HOLD)


class TimelineDelays:
    """The delay source of the simulation shell, replaying TIMELINE request by request."""

    def __init__(self):
        self.config = DelayConfig(estimate="measured")
        self.max_steps = max(TIMELINE)
        self._next = iter(TIMELINE)

    def request_delays(self, opened, episodes, requests, device=None) -> torch.Tensor:
        return torch.tensor([next(self._next) for _ in range(len(opened))], device=device)


class Clock:
    now = 0.0


class TimelineWorker:
    """The scheduler's real inference worker, with answers released on the test's clock: request k's
    result comes back (and is stamped finished) at its submission time + (TIMELINE[k] - 0.5) * DT."""

    def __init__(self, worker, clock: Clock):
        self.worker, self.clock = worker, clock
        self.latencies = iter((d - 0.5) * DT for d in TIMELINE)
        self.held: list[InferenceResult] = []
        self.statuses: list[WorkerStatus] = []
        self.waiting = (0.0, False)  # (when the request in flight is answered, still waiting for its mid observation)

    @property
    def busy(self) -> bool:
        return bool(self.held) or self.waiting[1]

    def submit(self, request) -> None:
        sent, latency = self.clock.now, next(self.latencies)
        self.worker.submit(request)
        self.waiting = (sent + latency, request.needs_mid)
        if not request.needs_mid:
            self._collect(sent + latency)

    def send_mid(self, mid) -> None:
        """The worker computes the chunk once its mid observation is in: seen no earlier than the next tick."""
        self.worker.send_mid(mid)
        self._collect(max(self.waiting[0], self.clock.now + 0.5 * DT))

    def _collect(self, finished: float) -> None:
        self.waiting = (finished, False)
        while True:  # the real worker computes the chunk now; the clock decides when it is seen
            for message in self.worker.poll():
                if isinstance(message, InferenceResult):
                    message.finished = finished
                    self.held.append(message)
                    return
                self.statuses.append(message)
            threading.Event().wait(0.001)

    def poll(self):
        statuses, self.statuses = self.statuses + self.worker.poll(), []
        due = [r for r in self.held if r.finished <= self.clock.now]
        self.held = [r for r in self.held if r.finished > self.clock.now]
        return statuses + due

    def alive(self) -> bool:
        return self.worker.alive()

    def close(self) -> None:
        self.worker.close()


def run_sim(
    merge: str, latency_aware: bool = False, lead: int = 0, low_latency: bool = False
) -> tuple[list, ProbePolicy]:
    policy, env = ProbePolicy(latency_aware, lead, low_latency), RecordingEnv()
    mid = 0.5 if latency_aware else None
    shell = make_shell(env, H, S, TimelineDelays(), merge=merge, ensemble_coeff=0.5, window=WINDOW,
                       committed_rows=0 if latency_aware else D_MAX + lead, mid_fraction=mid, lead_steps=lead,
                       low_latency_rows=LOW_LATENCY_ROWS if low_latency else 0,
                       step_policy=policy.low_latency_step if low_latency else None)  # fmt: skip
    obs, need = shell.reset(seed=0)
    while len(env.applied) < STEPS:
        assert need.tolist() == [True]
        obs_step = shell.obs_step
        chunk = policy.predict_chunk(obs, obs_step, inpaint=shell.guidance)
        obs, *_, need = shell.step(chunk)
    emitted = [None if a[0] == HOLD and not low_latency else a for a in env.applied[:STEPS]]
    return emitted, policy


def run_bridge(merge: str, latency_log: str, latency_aware: bool = False, episode_ends: dict[int, int] | None = None,
               noise_seed: int = -1, lead: int = 0, low_latency: bool = False) -> tuple[list, ProbePolicy, list[dict]]:  # fmt: skip
    """The robot's shell on the test's clock. episode_ends: tick -> the robot's episode that ended just before
    it (announced on the episode topic, its final state stamped half a period before the tick)."""
    policy = ProbePolicy(latency_aware, lead, low_latency)
    config = ServeConfig(
        mid_inference=latency_aware, noise_seed=noise_seed,
        checkpoint="(probe)", inference="thread", inference_cpu=-1, control_hz=1 / DT, latency_log=latency_log,
        chunking=ChunkingConfig(execute_steps=S, merge=merge, ensemble_coeff=0.5, estimate_window=WINDOW,
                                lead_steps=lead),
        cameras=[CameraTopic("front", "/camera/front/image_raw")],
    )  # fmt: skip
    if episode_ends is not None:
        config.topics.episode = "/sim_robot/episode"
    logger = SimpleNamespace(info=lambda *_: None, error=lambda *_: None, warning=lambda *_: None)
    diagnostics = BridgeDiagnostics()
    limiter = LogLimiter(lambda level, line: None)
    inputs = BridgeInputs(config, diagnostics, limiter, logger.info)
    inputs.state = np.zeros(len(SIM_STATE_NAMES))
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    inputs.images["front"], inputs.frames["front"] = image, deque([(0.0, image)])
    inputs.state_arrival, inputs.state_time = 0.0, 0.0  # the state's message: arrived and stamped at 0 s
    chunks: list[dict] = []
    scheduler = ChunkScheduler(config, lambda: policy, inputs, diagnostics, limiter, logger, chunks.append)
    clock = Clock()
    scheduler.worker = TimelineWorker(scheduler.worker, clock)
    try:
        for _ in range(500):  # wait for the worker to load the policy
            scheduler.start_episode_if_due()  # as the node does before each tick's command
            scheduler.prepare_next_action(None, clock.now)
            if scheduler.protocol is not None:
                break
            threading.Event().wait(0.01)
        assert scheduler.protocol is not None, scheduler.health.worker_error
        emitted, start = [], 0  # start: the tick the robot's current episode began at
        # Tick k prepares the action of step k, published at tick k + 1; a low-latency part corrects it there, on
        # tick k + 1's inputs, as the node does before the command goes out (one tick more to publish the last).
        for tick in range(STEPS + low_latency):
            clock.now = tick * DT
            inputs.state[0] = tick  # the joint state the robot reads at this tick: the step it is of
            inputs.state_time = tick * DT
            inputs.frames["front"].append((tick * DT, image))  # the camera's frame of the same instant
            if tick in (episode_ends or {}):
                inputs.ended_episode = (episode_ends[tick], (tick - 0.5) * DT)
            if tick:
                start = tick if scheduler.start_episode_if_due() else start
                if low_latency:  # the robot's hold is the sim's hold action here
                    target = scheduler.low_latency_target(scheduler.next_target, np.full(len(SIM_ACTION_NAMES), HOLD))
                    emitted.append(None if target is None else target.tolist())
                if tick == STEPS:
                    break
                scheduler.prepare_next_action(None, clock.now)
            assert scheduler.next_step == tick - start
            if not low_latency:
                emitted.append(None if scheduler.next_target is None else scheduler.next_target.tolist())
    finally:
        scheduler.close()
    return emitted, policy, chunks


@pytest.mark.parametrize("merge,lead", [("latest", 0), ("ensemble", 0), ("rtc", 0), ("latest", 2), ("rtc", 1)])
def test_simulation_and_robot_do_the_same_on_one_timeline(merge, lead, tmp_path):
    sim_emitted, sim_policy = run_sim(merge, lead=lead)
    log = tmp_path / "latencies.jsonl"
    robot_emitted, robot_policy, chunks = run_bridge(merge, str(log), lead=lead)

    assert len(sim_policy.seen) >= 15  # the timeline really ran
    n = min(len(sim_policy.seen), len(robot_policy.seen))
    assert n >= len(sim_policy.seen) - 1  # the robot may have one request still in flight at the end
    for k, (sim, robot) in enumerate(zip(sim_policy.seen[:n], robot_policy.seen[:n], strict=True)):
        assert sim[:2] == robot[:2], f"request {k}: (obs_step, announced delay)"
        assert torch.equal(sim[2], robot[2]) and torch.equal(sim[3], robot[3]), f"request {k}: augmentation"
        if merge == "rtc":
            assert sim[4] is not None and robot[4] is not None
            assert torch.allclose(sim[4][0], robot[4][0]) and torch.allclose(sim[4][1], robot[4][1])
        else:
            assert sim[4] is None and robot[4] is None
    assert sim_emitted == robot_emitted

    # Worked by hand from TIMELINE, S = 3, WINDOW = 2: request 0 at step 0 arrives at step 2 (lag 2);
    # request 1 goes out at step 3 (due, and nothing in flight) announcing 2, arrives at 4 (lag 1);
    # request 2 at step 6 announces max(2, 1) = 2; arrives at 9 (lag 3); request 3 at step 9 announces 3.
    # A lead L adds L to each lag and announcement (the first announces L), and chunk 0 runs from step 2 + L.
    assert [(t, d) for t, d, *_ in sim_policy.seen[:4]] == [(0, lead), (3, 2 + lead), (6, 2 + lead), (9, 3 + lead)]
    assert sim_emitted[: 2 + lead] == [None] * (2 + lead) and sim_emitted[2 + lead][0] == 2.0 + lead

    # The robot wrote every latency it measured, with its control period: one line per answered request.
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == len(chunks) >= 15
    assert all(r["control_dt"] == pytest.approx(DT) for r in records)
    expected = [(d - 0.5) * DT for d in TIMELINE[: len(records)]]
    assert [r["latency_s"] for r in records] == pytest.approx(expected, abs=1e-6)
    assert [r["lag_steps"] for r in records] == TIMELINE[: len(records)]


def test_a_served_robots_latency_log_replays_in_evaluation(tiny_checkpoint, tmp_path):
    """The node's latency log (measured at the sim's 20 Hz) drives `vla-rl eval --delay.kind=histogram`:
    every chunk of the evaluation gets a delay the robot measured, rounded up to whole steps."""
    from sim.config import EnvConfig
    from vla_rl.eval import EvalConfig, evaluate

    log = tmp_path / "latencies.jsonl"
    run_bridge("latest", str(log))
    result = evaluate(EvalConfig(
        checkpoint=str(tiny_checkpoint[0]), env=EnvConfig(num_envs=4, max_episode_steps=40), num_episodes=4,
        video_episodes=0, chunking=ChunkingConfig(execute_steps=2), output_dir=str(tmp_path / "eval"),
        delay=DelayConfig(kind="histogram", latencies_file=str(log)),
    ))  # fmt: skip
    measured = {json.loads(line)["lag_steps"] for line in log.read_text().splitlines()}
    assert measured == {1, 2, 3, 4} and result["delay_max_steps"] == 4
    replayed = {int(d): n for d, n in result["delay_histogram"].items()}
    assert set(replayed) == measured and sum(replayed.values()) >= 40


def test_serve_refuses_a_policy_trained_for_shorter_delays_than_the_robot_has():
    info = {"horizon": H, "n_action_steps": S, "state_dim": len(SIM_STATE_NAMES), "action_dim": 4, "committed_rows": 4}
    with pytest.raises(ValueError) as refused:
        fit_protocol(ServeConfig(max_delay_steps=6), info)  # the load-time check
    assert str(refused.value) == (
        "this robot's delays reach max_delay_steps=6 control steps but the policy was trained for delays up to 4; "
        "serve faster or retrain with --delay.kind=uniform --delay.high=6"
    )
    assert fit_protocol(ServeConfig(max_delay_steps=4), info).width == 4
    # A policy that does not read the augmentation serves under any delay shorter than its chunk.
    assert fit_protocol(ServeConfig(max_delay_steps=6), {**info, "committed_rows": 0}).width == 6


def test_the_mid_inference_observation_is_the_same_in_simulation_and_on_the_robot(tmp_path):
    """A latency-aware probe on the same timeline: each request's mid observation is the state of the
    same step (its first value is the step index on both sides), m = floor(0.5 * announced delay)
    steps after the request, and the emitted actions agree step by step."""
    sim_emitted, sim_policy = run_sim("latest", latency_aware=True)
    robot_emitted, robot_policy, _ = run_bridge("latest", str(tmp_path / "latencies.jsonl"), latency_aware=True)
    n = min(len(sim_policy.seen), len(robot_policy.seen))
    assert n >= 12 and n >= len(sim_policy.seen) - 1
    for k in range(n):
        assert sim_policy.seen[k][:2] == robot_policy.seen[k][:2], f"request {k}: (obs_step, announced delay)"
        assert torch.equal(sim_policy.seen[k][2], robot_policy.seen[k][2]), f"request {k}: committed actions"
    assert sim_policy.mid[:n] == robot_policy.mid[:n]
    for (t, d, *_), (mid_state, m) in zip(sim_policy.seen[:n], sim_policy.mid[:n], strict=True):
        assert m == d // 2 and mid_state == t + m  # worked from the definition, not from either shell
    assert any(m > 0 for _, m in sim_policy.mid[:n])  # some requests really waited for their mid observation
    assert sim_emitted == robot_emitted


def test_serve_refuses_a_latency_aware_policy_without_its_mid_inference_source():
    info = {"horizon": H, "n_action_steps": S, "state_dim": len(SIM_STATE_NAMES), "action_dim": 4,
            "latency_aware": True, "latency_max_delay": 4}  # fmt: skip
    config = ServeConfig()
    with pytest.raises(
        ValueError,
        match="this checkpoint is latency-aware: it reads a mid-inference observation; set mid_inference: true",
    ):
        fit_protocol(config, info)
    config.mid_inference = True
    with pytest.raises(
        ValueError, match="chunking.merge=rtc is not how a latency-aware policy acts"
    ):  # the serve default blends
        fit_protocol(config, info)
    config.chunking = ChunkingConfig(merge="latest")
    assert fit_protocol(config, info).mid_fraction == 0.5
    with pytest.raises(ValueError, match="this latency-aware policy has no prepare_request"):  # the contract's split
        fit_protocol(config, {**info, "splits_inference": False})
    config.max_delay_steps = 6
    with pytest.raises(ValueError, match="fine-tuned for delays up to 4; serve faster"):
        fit_protocol(config, info)


def logged(path) -> list[tuple]:
    """(episode, request, obs_step, lag_steps, merged) of each line of a latency log."""
    return [(r["episode"], r["request"], r["obs_step"], r["lag_steps"], r["merged"])
            for r in map(json.loads, path.read_text().splitlines())]  # fmt: skip


def test_the_robot_numbers_its_requests_by_episode_and_starts_each_episode_afresh(tmp_path):
    """The robot's episode 0 ends just before tick 5. By hand from TIMELINE (S = 3): episode 0's requests at
    steps 0 and 3 landed 2 and 1 steps later; at tick 5 the protocol restarts at step 0 and requests at once
    (TIMELINE[2] = 3: lands at step 3), then at step 3 (4: lands at 7) and at 7 (1). Each request's noise is
    the one keyed by (seed, episode, request), as simulation draws it."""
    log = tmp_path / "latencies.jsonl"
    emitted, policy, _ = run_bridge("latest", str(log), episode_ends={5: 0}, noise_seed=11)
    assert logged(log)[:5] == [(0, 0, 0, 2, True), (0, 1, 3, 1, True), (1, 0, 0, 3, True), (1, 1, 3, 4, True),
                               (1, 2, 7, 1, True)]  # fmt: skip
    assert emitted[5:8] == [None, None, None]  # a new episode's queue starts empty: the robot holds until step 3
    assert emitted[8][0] == 3.0  # tick 8 runs index 3 of the chunk conditioned on the new episode's step 0
    for (episode, request), noise in zip([(0, 0), (0, 1), (1, 0), (1, 1)], policy.noise, strict=False):
        assert torch.equal(noise, request_noise(11, episode, request, H, 4)), (episode, request)


def test_a_request_in_flight_at_an_episodes_end_is_answered_logged_and_dropped(tmp_path):
    """Episode 0 ends just before tick 8, while its request 2 (step 6, 3 steps) is in flight: it comes back at
    tick 9 and is dropped, and only then does episode 1 request, at its step 1 (tick 9), landing 4 steps later.
    Between the end's announcement and the next episode's first joint state nothing is requested."""
    log = tmp_path / "latencies.jsonl"
    run_bridge("latest", str(log), episode_ends={8: 0})
    records = logged(log)
    assert records[:4] == [(0, 0, 0, 2, True), (0, 1, 3, 1, True), (0, 2, 6, 1 - 6, False), (1, 0, 1, 4, True)]


def test_a_new_episode_holds_where_the_robot_now_is_not_at_the_last_episodes_command():
    """Simulation holds a new episode's arm where it starts; the robot's hold is its last command, so at a new
    episode the node anchors it on the measured state again, as at start-up (the grip: initial_command's 0)."""
    from robot_bridge.hold import Hold

    config = ServeConfig()
    diagnostics, limiter = BridgeDiagnostics(), LogLimiter(lambda level, line: None)
    inputs = BridgeInputs(config, diagnostics, limiter, lambda line: None)
    ee = [SIM_STATE_NAMES.index(name) for name in ("ee_x", "ee_y", "ee_z")]
    inputs.state = np.zeros(len(SIM_STATE_NAMES))
    inputs.state[ee] = [0.4, 0.1, 0.2]
    hold = Hold(config, DT, inputs, None, diagnostics, limiter, SimpleNamespace(error=print, warning=print))
    assert hold.command(None).tolist() == [0.4, 0.1, 0.2, 0.0]  # the first command: the measured state
    hold.command(np.array([0.5, -0.1, 0.3, 1.0]))  # the last episode's last command
    inputs.state[ee] = [0.6, 0.0, 0.25]  # the next episode's arm
    assert hold.command(None).tolist() == [0.5, -0.1, 0.3, 1.0]
    hold.start_episode()
    assert hold.command(None).tolist() == [0.6, 0.0, 0.25, 0.0]


@pytest.mark.parametrize("setting", [{"inference": "remote"}, {"action_mode": "delta"}])
def test_serve_refuses_a_low_latency_part_where_it_would_not_run_per_tick(tiny_checkpoint, setting):
    """Serve runs a low-latency part per tick, in its own process, on absolute targets: a config where it could not
    (remote inference, delta actions) is refused at load with the fix, rather than run the slow chunks alone; the
    same checkpoint with ticks or trajectories and local inference fits, reading the part's plan rows."""
    from robot_bridge.inference import policy_info
    from vla_rl.checkpoint import load_policy

    policy, _ = load_policy(tiny_checkpoint[0])
    assert policy_info(policy)["low_latency_rows"] == 0
    policy.add_low_latency(rows=4, max_age=8, cameras=list(policy.config.cameras))
    info = policy_info(policy)
    config = ServeConfig(
        state_names=SIM_STATE_NAMES, action_names=SIM_ACTION_NAMES, chunking=ChunkingConfig(merge="latest")
    )
    assert fit_protocol(config, info).spec.low_latency_rows == 4
    object.__setattr__(config, "output", "trajectory")  # the correction goes out as the trajectory's next point
    assert fit_protocol(config, info).spec.low_latency_rows == 4
    for key, value in setting.items():
        object.__setattr__(config, key, value)  # past the config's own checks (a trajectory needs its topic)
    with pytest.raises(ValueError, match=r"has a low-latency part .* runs per tick .*initial_checkpoint"):
        fit_protocol(config, info)


def test_the_low_latency_part_acts_the_same_in_simulation_and_on_the_robot(tmp_path):
    """A probe with a low-latency part on the same timeline: at every step both shells give it the same base action
    (the queue's, or the hold when it ran dry), plan, plan age and steps since the request, and the corrected
    actions agree step by step. The state it reads is its step's in simulation and one step fresher on the robot:
    the node prepares step k's action at tick k and the part corrects it at tick k + 1, as it goes out, on that
    tick's joint state. Worked by hand from TIMELINE: nothing runs before chunk 0 arrives at step 2 (the part
    corrects the hold, plan age -1); chunk 0 (asked at step 0) runs its rows 2 and 3 (ages 2, 3); chunk 1 (asked
    at 3, 1 step late) takes over at 4 with its row 1 (age 1), then row 2 (age 2). A row of a chunk asked at t is
    t + its index, so the bases are 2, 3, 4, 5."""
    sim_emitted, sim_policy = run_sim("latest", low_latency=True)
    robot_emitted, robot_policy, _ = run_bridge("latest", str(tmp_path / "latencies.jsonl"), low_latency=True)
    assert len(sim_policy.steps) >= STEPS and len(robot_policy.steps) == STEPS
    assert [s[0] for s in sim_policy.steps[:STEPS]] == [float(t) for t in range(STEPS)]
    assert [s[0] for s in robot_policy.steps] == [float(t + 1) for t in range(STEPS)]
    assert [s[1:] for s in sim_policy.steps[:STEPS]] == [s[1:] for s in robot_policy.steps]
    assert sim_emitted == robot_emitted
    assert [s[2] for s in sim_policy.steps[:6]] == [-1, -1, 2, 3, 1, 2]
    assert [s[1][0] for s in sim_policy.steps[:6]] == [HOLD, HOLD, 2.0, 3.0, 4.0, 5.0]
    assert sim_emitted[0][3] == HOLD + 100 and sim_emitted[4][3] == sim_policy.steps[4][1][3] + 100
