"""`vla-rl bench robot-parity` (also ``benchmarks/robot_parity.py``): does the simulation's latency model
predict what a served robot does, episode by episode?

The protocol (its dated history is at the end of this docstring):

1. One checkpoint (``--checkpoint``; by intent the latency-aware one of the calibrated task, but any
   vla-rl checkpoint runs) on ``--task``, at the tabletop tasks' 20 Hz control.
2. The robot: `vla-rl serve` drives `vla-rl sim-robot` over ROS 2, two processes in a ROS domain of
   their own (``domain_id``), in real time, with ``added_latency_s`` slept in every inference (a slow
   model's latency, on top of the policy's own compute). The robot runs ``episodes`` episodes,
   ``episode_gap_s`` apart; its episode e starts from the initial state of the evaluation's episode e
   (``sim-robot --eval_worlds``, the seeds of step 3). Serve follows the robot's episodes
   (``--topics.episode``): each starts its latency protocol afresh, as simulation's does; it draws
   the sampler noise of request k of episode e from (``noise_seed``, e, k), and logs every measured
   latency with its episode and request index. Chunking: latest merge, ``execute_steps``, the measured
   delay estimate; no velocity or acceleration limit (the simulation has none).
3. The simulation: `vla-rl eval` of the same checkpoint, ``num_envs`` worlds, seed ``seed`` (episode
   e is world e % num_envs of round e // num_envs), under ``--delay.kind=trace`` replaying the robot's
   log (request k of episode e gets the latency the robot measured for its request k of episode e,
   rounded up to control steps; a request past the robot's last of that episode, its last latency:
   ``--delay.past_trace=last``), announced as the robot announces it (``--delay.estimate=measured``),
   with the same noise per request (``--noise_seed``).
4. Episodes paired by initial state (robot episode e with simulated episode e; that their initial
   states are equal is checked and recorded): success rates with 95% Wilson intervals, McNemar's
   exact test on the discordant pairs, and every pair in the JSON with what its two timelines did
   differently where the log shows it: requests whose chunk the robot merged at another step than the
   trace replays (real-time jitter), the robot's first request later than the episode's first step
   (the previous episode's inference still running), requests the simulation made past the robot's
   log (its episode ran longer), and the lengths.

The final line: ``sim_success=<x> ros_success=<y> gap_points=<100 (y - x)> episodes=<per side>
mcnemar_p=<p>``. The target is |gap| <= 8 points, at >= 100 episodes per side.

What the trace does not capture, and no pair records: the robot runs each step's action one control
period after the tick that prepared it (serve publishes it at the next joint state); a hold after a
stale input (a starved process) drops the robot's plan; when its queue runs dry the robot repeats its
last command where the simulation holds the arm where it is; and a batch of worlds is not computed
bit for bit as one world is.

Stages: ``<output_dir>/robot`` (the served run: its logs, ``robot.json`` once finished) and
``<output_dir>/sim`` (the evaluation); a killed run reuses a finished robot stage and resumes the
evaluation, and runs a robot stage cut short again from its start (it runs in real time). ``--quick``
trains a toy policy at toy sizes in ``<output_dir>/quick`` and runs every stage with 4 episodes on 2
worlds: it checks the plumbing, not the claim.

Protocol history:

- 2026-12-04: the first protocol, as above. No run yet.
- 2026-12-05, the first full run's setting, fixed before it ran: the checkpoint is the calibrated
  latency-aware one (`bench latency-rl` on ``track_jump`` at d = 8, seed 0's run, the first seed: chosen
  before either seed's robot result), ``--task=track_jump``, and ``--added_latency_s=0.3625`` (7.25 control
  periods slept, so chunks arrive about 8 steps late, the calibrated delay, as `bench delay-beyond` sizes
  its sleep), every other setting the default.
- 2026-12-05, run 1 of that setting, refused before its evaluation: the robot's lags were 15 steps (161 of
  165 requests; up to 17), which the policy's 16-step chunk does not fit, so its trace was refused as this
  protocol says. The cause was a fault, not the machine: serve slept the added latency after a
  latency-aware request's mid-inference observation instead of in its slow part, so the sleep came on top
  of the window the mid observation is taken in, and the announced delay grew to its fixed point
  d = added / ((1 - mid_fraction) dt) = 14.9 steps. Fixed (`robot_bridge.inference`, tested); run 2 is the
  same setting, its robot stage run again from scratch.
- 2026-12-05, run 2, refused before its evaluation as the protocol says: with the fault fixed the lags were
  as sized (8 steps for 561 of its 655 requests, 7 for 89) but 5 took 9, one more than the policy was
  fine-tuned for. Run 3 (fixed before it ran; no result of run 2's evaluation exists) sleeps
  ``--added_latency_s=0.3125`` (6.25 periods), so chunks arrive about 7 steps late with a step to spare
  below the policy's 8; every other setting as run 2.
- 2026-12-07, a run fixed before it starts (RL under delay: the low-latency policy served). The checkpoint is
  `bench latency-rl`'s low-latency arm of seed 0 (its amendment of 2026-12-07: ``--checkpoint=
  outputs/bench/latency_rl_arli/seed0/runs/latency_aware_d8``, the first seed, chosen before either seed's
  result), which `serve` runs with its part at every tick and `vla-rl eval` with its part at every step;
  ``--task=track_jump --episodes=200 --added_latency_s=0.3625`` (7.25 periods slept: chunks about 8 steps
  late, the delay it was fine-tuned at; its slow policy reads no delay, so a 9 is not refused),
  ``--output_dir=outputs/bench/robot_parity_low_latency``, every other setting the default, the machine
  otherwise idle. Target (the issue's): |gap| <= 5 points over the 200 pairs. What the pairs cannot show: on
  the robot the part reads a joint state one period fresher than in simulation (serve prepares a step's
  action at the tick before; README.md, serve).
- 2026-12-07, the result of that run, recorded after it: ``sim_success=0.800 ros_success=0.810 gap_points=1.0
  episodes=200 mcnemar_p=0.7905`` (lags 8 steps for 682 of 873 requests, 7 for 178, 9 for 13).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vla_core.files import write_text_atomic
from vla_rl.bench_stages import chunking, policy_settings, run_robot


@dataclass
class BenchRobotParityConfig:
    """One checkpoint served to a simulated robot over ROS 2 and evaluated in the batched simulation under the
    robot's own latency trace, episode by episode."""

    checkpoint: str = ""  # the checkpoint served and evaluated (a training output dir takes its last); needed
    task: str = "track"  # the task both sides run
    episodes: int = 100  # per side; robot episode e is paired with simulated episode e
    num_envs: int = 50  # worlds of the simulation; episode e runs in world e % num_envs of round e // num_envs
    seed: int = 8000  # the initial states (the evaluation's seed)
    noise_seed: int = 0  # request k of episode e samples from the noise of (noise_seed, e, k) on both sides
    added_latency_s: float = 0.15  # slept in every inference on the robot (a slow model's latency), seconds
    execute_steps: int = 0  # steps per chunk on both sides; 0 = the policy's n_action_steps
    max_episode_steps: int = 0  # 0 = the task's own limit
    episode_gap_s: float = 1.0  # the robot's pause between episodes; longer than any inference
    domain_id: int = 48  # ROS_DOMAIN_ID of the robot and the server (a private one)
    start_timeout_s: float = 300.0  # longest wait for the server's policy to load
    output_dir: str = "outputs/bench/robot_parity"  # robot/, sim/, robot_parity.json; a quick run: <output_dir>/quick
    quick: bool = False  # a toy policy trained here, 4 episodes on 2 worlds: the plumbing, not the claim

    def apply_quick(self) -> None:
        if self.quick:
            self.episodes, self.num_envs, self.max_episode_steps = 4, 2, 30
            self.added_latency_s, self.episode_gap_s = 0.1, 0.5


def bench_robot_parity(cfg: BenchRobotParityConfig) -> dict[str, Any]:
    """Run the protocol of the module docstring; returns (and writes as ``robot_parity.json``) every pair."""
    cfg.apply_quick()
    if cfg.episodes < 1 or cfg.num_envs < 1 or cfg.added_latency_s < 0 or cfg.episode_gap_s <= 0:
        raise ValueError("episodes and num_envs must be >= 1, added_latency_s >= 0 and episode_gap_s > 0")
    if cfg.quick and cfg.checkpoint:
        raise ValueError("--quick trains its own toy policy: drop --checkpoint (or --quick)")
    if not cfg.quick and not cfg.checkpoint:
        raise ValueError("--checkpoint=DIR names the checkpoint to serve and evaluate (or run --quick=true)")
    out = Path(cfg.output_dir) / "quick" if cfg.quick else Path(cfg.output_dir)
    from vla_rl.bench_stages import RunClock

    clock = RunClock(out / "run_clock.json")  # minutes over every process of a resumed run
    checkpoint = quick_checkpoint(cfg, out) if cfg.quick else Path(cfg.checkpoint)
    policy = policy_settings(checkpoint)
    robot, fresh = run_robot(cfg, checkpoint, policy, out / "robot")
    trace = [json.loads(line) for line in (out / "robot" / "latencies.jsonl").read_text().splitlines() if line]
    check_trace_fits(trace, policy, out / "robot")
    sim = run_sim(cfg, checkpoint, policy, out / "robot" / "latencies.jsonl", out / "sim", fresh)
    initial = initial_states(cfg, policy)
    pairs = pair_episodes(robot["episodes"], sim["per_episode"], trace, cfg.num_envs, initial)
    report = {
        "config": asdict(cfg), "checkpoint": str(checkpoint), "latency_aware": policy["latency_aware"],
        "summary": summarize(pairs), "pairs": pairs, "robot": {k: v for k, v in robot.items() if k != "episodes"},
        "sim": {k: sim[k] for k in ("episodes", "successes", "success_rate", "success_ci95", "delay_histogram")},
        "minutes": clock.stop(),
    }  # fmt: skip
    write_text_atomic(out / "robot_parity.json", json.dumps(report, indent=2))
    return report


def quick_checkpoint(cfg: BenchRobotParityConfig, out: Path) -> Path:
    """A toy latency-aware checkpoint in ``out / "checkpoint"``: 4 scripted episodes, 20 imitation steps (the
    learning benchmarks' stages), then a fast head that reads delays up to the chunk's last step; reused
    when there."""
    from vla_rl.bench_stages import record_demos, train_imitation
    from vla_rl.stages import load_policy, write_policy

    checkpoint = out / "checkpoint"
    if (checkpoint / "metadata.json").is_file():
        return checkpoint
    # A long chunk (48 steps: 2.4 s), so a loaded machine's slow inference still fits the toy policy.
    toy = SimpleNamespace(task=cfg.task, demos=4, num_envs=4, seed=0, train_steps=20, batch_size=16, horizon=48,
                          n_action_steps=4, num_threads=0)  # fmt: skip
    record_demos(toy, out / "dataset")
    train_imitation(toy, out / "dataset", out / "imitation")
    policy, _ = load_policy(out / "imitation")
    # Zero-initialized, the head leaves the toy policy's actions as they were; it makes serve and eval run
    # the latency-aware path (mid-inference observations, the committed actions).
    policy.add_latency_head(toy.horizon - 1, 0.5, list(policy.config.cameras))
    write_policy(checkpoint, policy, {"step": 0, "quick": True})
    return checkpoint


def check_trace_fits(trace: list[dict], policy: dict, folder: Path) -> None:
    """Refuse, before the evaluation, a robot trace with a delay the policy does not fit (its chunk, or what it
    was trained or fine-tuned for), which the simulation would refuse: the robot's inference was slower than
    the benchmark asked (a loaded machine starves the niced inference worker)."""
    steps = max((steps_of(r) for r in trace), default=0)
    try:
        policy["spec"].check_delay(steps)
    except ValueError as err:
        raise ValueError(
            f"the robot's inference took up to {steps} control steps, which this policy does not fit ({err}); lower "
            f"--added_latency_s, or remove {folder} and run where the inference is not starved"
        ) from None


def run_sim(cfg: BenchRobotParityConfig, checkpoint: Path, policy: dict, trace: Path, folder: Path,
            fresh: bool) -> dict:  # fmt: skip
    """`vla-rl eval` as step 3 of the protocol runs it, into ``folder``: reused when finished and the robot
    stage was, resumed when cut, run afresh after a new robot stage."""
    from vla_rl.stages import DelayConfig, EnvConfig, EvalConfig, evaluate

    if not fresh and (folder / "eval.json").is_file() and not (folder / "eval_progress.pt").exists():
        return json.loads((folder / "eval.json").read_text())
    resume = not fresh and (folder / "episodes.jsonl").is_file()
    return evaluate(EvalConfig(
        checkpoint=str(checkpoint), num_episodes=cfg.episodes, seed=cfg.seed, video_episodes=0,
        env=EnvConfig(task=cfg.task, num_envs=cfg.num_envs, max_episode_steps=cfg.max_episode_steps,
                      image_size=policy["image_size"], cameras=policy["cameras"]),
        chunking=chunking(cfg),
        delay=DelayConfig(kind="trace", latencies_file=str(trace), past_trace="last", estimate="measured"),
        noise_seed=cfg.noise_seed, output_dir=str(folder), resume=resume, overwrite=not resume,
    ))  # fmt: skip


def initial_states(cfg: BenchRobotParityConfig, policy: dict) -> list[list[float]]:
    """(episodes, S) each simulated episode's initial ``observation.state``, from the evaluation's resets (its
    seeds and world count) in a world batch without cameras: what the robot's episodes are checked against."""
    from sim.factory import make_env
    from vla_rl.stages import EnvConfig

    states: list[list[float]] = []
    env_cfg = EnvConfig(task=cfg.task, num_envs=cfg.num_envs, cameras=[], max_episode_steps=cfg.max_episode_steps)
    with make_env(env_cfg) as env:
        for r in range(math.ceil(cfg.episodes / cfg.num_envs)):
            states += env.reset(seed=cfg.seed + r)["observation.state"].tolist()
    return states[: cfg.episodes]


def pair_episodes(robot: list[dict], sim: list[dict], trace: list[dict], num_envs: int,
                  sim_initial: list[list[float]]) -> list[dict]:  # fmt: skip
    """One record per episode e: both outcomes and lengths, whether the initial states were equal, and what the
    robot's latency log shows its timeline did otherwise than the trace replays (see the module docstring)."""
    by_episode: dict[int, list[dict]] = {}
    for record in trace:
        by_episode.setdefault(int(record["episode"]), []).append(record)
    sim_by_number = {e["round"] * num_envs + e["world"]: e for e in sim}
    pairs = []
    for r in sorted(robot, key=lambda e: e["episode"]):
        e = r["episode"]
        s, requests = sim_by_number[e], sorted(by_episode.get(e, []), key=lambda q: q["request"])
        mismatched = [
            {"request": q["request"], "trace_steps": steps_of(q), "robot_lag_steps": q["lag_steps"]}
            for q in requests if q.get("merged") and q["lag_steps"] != steps_of(q)
        ]  # fmt: skip
        timing = {
            "lag_mismatches": mismatched,
            "robot_first_request_step": requests[0]["obs_step"] if requests else None,
            "robot_requests": len(requests), "sim_requests": s["requests"],
            "sim_requests_past_trace": max(0, s["requests"] - len(requests)),
        }  # fmt: skip
        pair = {
            "episode": e, "eval_seed": s["seed"], "eval_world": s["world"],
            "same_initial_state": r["initial_state"] == sim_initial[e],
            "sim_success": s["success"], "robot_success": r["success"],
            "sim_length": s["length"], "robot_length": r["length"], "differs": s["success"] != r["success"],
            "timing": timing,
        }  # fmt: skip
        if pair["differs"]:
            pair["why"] = explain(pair)
        pairs.append(pair)
    return pairs


def steps_of(request: dict) -> int:
    """The delay, in control steps, the trace replays for a logged request (`vla_core.runtime.latencies_to_steps`)."""
    import numpy as np

    from vla_core.runtime import latencies_to_steps

    return int(latencies_to_steps(np.array([request["latency_s"]]), request["control_dt"])[0])


def explain(pair: dict) -> list[str]:
    """Why a differing pair may differ: each difference of its timelines the robot's log shows."""
    t, why = pair["timing"], []
    if not pair["same_initial_state"]:
        why.append("the initial states differ")
    if t["lag_mismatches"]:
        why.append(f"{len(t['lag_mismatches'])} of the robot's chunks arrived at another step than the trace replays")
    if t["robot_first_request_step"]:
        why.append(f"the robot's first request came at step {t['robot_first_request_step']}, the simulation's at 0")
    if t["sim_requests_past_trace"]:
        why.append(f"the simulated episode made {t['sim_requests_past_trace']} requests past the robot's log "
                   "(it ran longer; they replayed the episode's last latency)")  # fmt: skip
    if not why:
        why.append("no timing difference in the log: what the trace does not capture (the module docstring)")
    return why


def summarize(pairs: list[dict]) -> dict[str, Any]:
    """Both success rates with 95% Wilson intervals, the gap in points, McNemar's exact test on the pairs."""
    from vla_rl.stages import mcnemar_exact, wilson_interval

    n = len(pairs)
    sim, robot = sum(p["sim_success"] for p in pairs), sum(p["robot_success"] for p in pairs)
    only_sim = sum(p["sim_success"] and not p["robot_success"] for p in pairs)
    only_robot = sum(p["robot_success"] and not p["sim_success"] for p in pairs)
    return {
        "episodes": n, "sim_success": sim / n, "ros_success": robot / n,
        "sim_ci95": list(wilson_interval(sim, n)), "ros_ci95": list(wilson_interval(robot, n)),
        "gap_points": 100 * (robot - sim) / n, "only_sim_succeeded": only_sim, "only_robot_succeeded": only_robot,
        "mcnemar_p": mcnemar_exact(only_sim, only_robot),
        "same_initial_states": sum(p["same_initial_state"] for p in pairs),
        "pairs_with_lag_mismatches": sum(bool(p["timing"]["lag_mismatches"]) for p in pairs),
    }  # fmt: skip


def final_line(summary: dict) -> str:
    s = summary
    return (f"sim_success={s['sim_success']:.3f} ros_success={s['ros_success']:.3f} gap_points={s['gap_points']:.1f} "
            f"episodes={s['episodes']} mcnemar_p={s['mcnemar_p']:.4f}")  # fmt: skip


def format_summary(report: dict[str, Any]) -> str:
    """Both rates, the discordant pairs and their causes, then the final line."""
    s = report["summary"]
    lines = [
        (f"simulation {s['sim_success']:.2f} [{s['sim_ci95'][0]:.2f}, {s['sim_ci95'][1]:.2f}]  "
         f"robot {s['ros_success']:.2f} [{s['ros_ci95'][0]:.2f}, {s['ros_ci95'][1]:.2f}]  over {s['episodes']} pairs"),
        (f"only the simulation succeeded: {s['only_sim_succeeded']}; only the robot: {s['only_robot_succeeded']}; "
         f"equal initial states: {s['same_initial_states']}/{s['episodes']}; pairs with chunks merged at another "
         f"step than replayed: {s['pairs_with_lag_mismatches']}"),
    ]  # fmt: skip
    lines += [f"episode {p['episode']}: {'; '.join(p['why'])}" for p in report["pairs"] if p["differs"]]
    if report["config"]["quick"]:
        lines.append("quick run: a toy policy at toy sizes; the numbers below say nothing about parity")
    lines.append(final_line(s))
    return "\n".join(lines)
