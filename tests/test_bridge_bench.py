"""`vla-rl bench bridge` end to end at a tiny size: two processes, real numbers, the JSON and the final line.

Timing is not asserted (the machine is shared); the seam metric and the calibration are checked on their own.
"""

import json
import math
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from robot_bridge.bench import (
    JOINTS,
    BenchBridgeConfig,
    _summarize,
    bench_bridge,
    build_bench_policy,
    deadline_misses,
    format_summary,
    lead_steps,
    scheduling_record,
    seam_jumps,
    size_horizon,
)
from robot_bridge.trajectory_follower import TrajectoryFollower
from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_STATE, image_key

ROOT = Path(__file__).resolve().parents[1]
FINAL_LINE = re.compile(r"^starved_ticks=(\d+) late_chunks=(\d+) tick_mode_late=(\d+) ticks=(\d+)$")


def test_seam_jumps_separate_seams_from_the_rest():
    # Commands 0, 1, 2, 3 (v = 100/s at 100 Hz), then a seam at step 4 jumping to 10, then 11, 12.
    period = 0.01
    values = [0, 1, 2, 3, 10, 11, 12]
    ticks = [(k, 0.0, 0.0, True, k == 4, [v * 1.0]) for k, v in enumerate(values)]
    out = seam_jumps(ticks, period)
    # v: 100, 100, 100, 700, 100, 100 -> jumps 0, 0, 600 (into the seam), 600 (out of it), 0
    assert out == {"seam_max_velocity_jump": pytest.approx(600.0), "within_max_velocity_jump": pytest.approx(0.0)}
    # A tick without a policy action breaks the sequence: no jump spans it.
    ticks[3] = (3, 0.0, 0.0, False, False, [50.0])
    assert seam_jumps(ticks, period)["within_max_velocity_jump"] == 0.0


def test_a_miss_is_a_command_more_than_deadline_ms_late_at_any_rate():
    # States sent 20 ms apart (50 Hz, where half a period would be 10 ms); commands back after 3 ms,
    # 7 ms and 12 ms, and none for the last state.
    ms = 1_000_000
    sent = [0, 20 * ms, 40 * ms, 60 * ms]
    received = {0: 3 * ms, 20 * ms: 27 * ms, 40 * ms: 52 * ms}
    assert deadline_misses(sent, received, deadline_ms=5.0) == ([1, 2], 1)  # 7 and 12 ms are late, one lost
    assert deadline_misses(sent, received, deadline_ms=10.0) == ([2], 1)


def _run(rate, realtime_problem=None, lock_problem=None, misses=0, output="ticks", ticks=0, starved=0, late=0,
         overruns=0):  # fmt: skip
    """One run's row as `_run_one` writes it, with made-up timings."""
    q = {"p50": 1.0, "p99": 2.0, "max": 3.0}
    row = {"output": output, "rate_hz": rate, "merge": "rtc", "cycles": 100, "inference_latency_ms": q,
           "inference_latencies_ms": [1.0, 3.0], "after_command_max_ms": 1.0 + overruns * 10,
           "node_counters": {"overrun_ticks": overruns}, "obs_to_influenced_command_ms": q,
           "scheduling": scheduling_record(realtime_problem, lock_problem)}  # fmt: skip
    if output == "trajectory":
        return {**row, "ticks": ticks, "starved_ticks": starved, "chunks_received": 10, "late_chunks": late,
                "chunk_margin_ms": {"min": -1.0 if late else 5.0, "p1": 5.0, "p50": 50.0, "max": 90.0},
                "chunk_transit_ms": q}  # fmt: skip
    return {
        **row, "deadline_ms": 5.0, "deadline_misses": misses, "node_deadline_misses": 0, "starved_ticks": 0,
        "state_to_command_ms": q, "node_tick_latency_ms": q, "jitter_ms": q,
        "seams": {"seam_max_velocity_jump": 0.1, "within_max_velocity_jump": 0.1},
    }  # fmt: skip


def test_summary_sums_each_outputs_figures_and_warns_when_scheduling_was_refused():
    cfg = BenchBridgeConfig(rates_hz=[50.0, 100.0], deadline_ms=5.0)
    pings = {r: {"pings": 30, "pongs": 29, "round_trip_ms": {"p50": 0.5, "p99": 1.0, "max": 1.5}} for r in cfg.rates_hz}
    runs = [_run(50.0, misses=2), _run(100.0, misses=3), _run(50.0, output="trajectory", ticks=100, starved=1),
            _run(100.0, output="trajectory", ticks=100, starved=4, late=2, overruns=3)]  # fmt: skip
    granted = _summarize(cfg, 16, runs, pings)
    # Overruns of the control loop (work after a command longer than a period) per rate, with the longest.
    assert granted["per_rate"]["100.0"]["overrun_ticks"] == 3 and granted["per_rate"]["50.0"]["overrun_ticks"] == 0
    assert granted["per_rate"]["100.0"]["after_command_max_ms"] == 31.0
    assert (granted["tick_mode_late"], granted["starved_ticks"], granted["late_chunks"], granted["ticks"]) == (
        5,
        5,
        2,
        200,
    )
    # Tick mode's state -> command p99 (2.0) minus the ping's (1.0), its p50 (1.0) minus the ping's (0.5).
    assert granted["per_rate"]["50.0"]["added_latency_p99_ms"] == 1.0
    assert granted["per_rate"]["100.0"]["added_latency_p50_ms"] == 0.5
    assert granted["per_rate"]["100.0"]["chunk_margin_min_ms"] == -1.0
    assert granted["scheduling"] == {
        "realtime_scheduling": True, "memory_locked": True, "robot_realtime_scheduling": True, "problems": [],
    }  # fmt: skip
    text = format_summary(granted)
    assert "WARNING" not in text
    assert granted["per_rate"]["50.0"]["raw_pongs"] == [29, 30] and "(29/30 answered)" in text
    assert text.splitlines()[-1] == "starved_ticks=5 late_chunks=2 tick_mode_late=5 ticks=200"

    # One serve process of two refused each: the whole benchmark says refused, and why.
    no_rt = "no permission for SCHED_FIFO (needs CAP_SYS_NICE or an rtprio limit, e.g. in limits.conf)"
    no_lock = "mlockall failed (Cannot allocate memory); raise the memlock limit"
    runs = [_run(50.0), _run(100.0, realtime_problem=no_rt, lock_problem=no_lock)]
    refused = _summarize(cfg, 16, runs, pings, robot_rt_problem=no_rt)
    assert refused["scheduling"] == {
        "realtime_scheduling": False, "memory_locked": False, "robot_realtime_scheduling": False,
        "problems": sorted([no_rt, no_lock]),
    }  # fmt: skip
    json.dumps(refused)  # the JSON file holds it as is
    lines = format_summary(refused).splitlines()
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert len(warnings) == 2
    assert warnings[0].startswith(f"WARNING: real-time scheduling was refused ({no_rt})")
    assert warnings[1].startswith(f"WARNING: memory locking was refused ({no_lock})")
    assert FINAL_LINE.match(lines[-1]) and refused["ticks"] == 0, lines[-1]


def test_a_given_horizon_refuses_a_sizing_run_it_would_skip(tmp_path):
    with pytest.raises(ValueError, match=r"--horizon=100 skips the sizing run that --sizing_chunks=3 .*drop one"):
        bench_bridge(BenchBridgeConfig(horizon=100, sizing_chunks=3, output_json=str(tmp_path / "b.json")))
    with pytest.raises(ValueError, match="sizing_chunks must be at least 1"):
        bench_bridge(BenchBridgeConfig(sizing_chunks=-1, output_json=str(tmp_path / "b.json")))
    with pytest.raises(ValueError, match=r"--trajectory_lead_s=0.2 does nothing with --outputs=\['ticks'\]"):
        bench_bridge(BenchBridgeConfig(horizon=100, outputs=["ticks"], trajectory_lead_s=0.2,
                                       output_json=str(tmp_path / "b.json")))  # fmt: skip
    with pytest.raises(ValueError, match=r"--low_latency=true runs the part .*--outputs=\[ticks\] --merges=\[latest\]"):
        bench_bridge(BenchBridgeConfig(low_latency=True, output_json=str(tmp_path / "b.json")))
    with pytest.raises(ValueError, match=r"--merges=\[latest\] \(got \['ticks'\], \['latest', 'rtc'\]\)"):
        bench_bridge(BenchBridgeConfig(low_latency=True, outputs=["ticks"], merges=["latest", "rtc"],
                                       output_json=str(tmp_path / "b.json")))  # fmt: skip
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written


def test_the_horizon_covers_two_loaded_inference_delays_at_one_and_a_half_times_their_p99():
    """p99 of 100 latencies 10..1000 ms (step 10) is 990.1 ms: at 100 Hz 2 x 1.5 x 0.9901 s = 297.03 steps -> 298,
    plus 10 executed steps = 308, plus the trajectory lead of 0.5 s = 50 steps at 100 Hz: 358, also with per-tick
    output alone (the sizing run serves trajectories); a fast inference gets 1 + 50 + 10 = 61; with no lead, 16."""
    latencies = [10.0 * k for k in range(1, 101)]
    cfg = BenchBridgeConfig(rates_hz=[50.0, 100.0], execute_steps=10, trajectory_lead_s=0.5)
    assert size_horizon(cfg, latencies) == 358
    assert size_horizon(cfg, [1.0] * 20) == 61  # 2 x 1.5 x 0.001 x 100 = 0.3 -> 1
    ticks_only = BenchBridgeConfig(rates_hz=[50.0, 100.0], execute_steps=10, outputs=["ticks"])
    assert size_horizon(ticks_only, latencies) == 358
    no_lead = BenchBridgeConfig(rates_hz=[50.0, 100.0], execute_steps=10, trajectory_lead_s=0.0)
    assert size_horizon(no_lead, latencies) == 308 and size_horizon(no_lead, [1.0] * 20) == 16


def test_the_trajectory_lead_is_serves_lead_steps_rounded_up_and_only_for_trajectory_output():
    """0.5 s is 50 steps at 100 Hz and 25 at 50 Hz; 0.123 s at 100 Hz is 12.3 -> 13; tick output gets none."""
    cfg = BenchBridgeConfig(trajectory_lead_s=0.5)
    assert (lead_steps(cfg, 100.0, "trajectory"), lead_steps(cfg, 50.0, "trajectory")) == (50, 25)
    assert lead_steps(BenchBridgeConfig(trajectory_lead_s=0.123), 100.0, "trajectory") == 13
    assert lead_steps(cfg, 100.0, "ticks") == 0


def test_the_controller_follows_trajectories_counts_starvation_and_late_chunks():
    """The bench robot as a controller at 100 Hz, driven by hand-made messages: a 3-point chunk stamped at t = 1 s
    (points at 1.01, 1.02, 1.03 s) arriving at 1.005 s is 5 ms early; ticks at 1.015 s (halfway from 1.01 to
    1.02: the mean of the points), 1.03 s (its last point: starved) and a chunk arriving 2 ms after its first
    point is late."""
    from robot_bridge import codec
    from robot_bridge.bench import BenchRobot

    robot = BenchRobot.__new__(BenchRobot)  # the message handling only, without a ROS node
    robot.position, robot.follower, robot.follower_lock = [0.0] * 4, TrajectoryFollower(JOINTS), threading.Lock()
    robot.start_counting()
    s = 1_000_000_000
    chunk = codec.trajectory_points_msg(JOINTS, np.array([[0.1] * 4, [0.2] * 4, [0.3] * 4]), codec.time_msg(s), 0.01)
    robot._on_trajectory(chunk, {"received_timestamp": s + 5_000_000, "source_timestamp": s + 4_000_000})
    robot.control_tick(s + 15_000_000)
    assert robot.position == pytest.approx([0.15] * 4) and robot.starved_ticks == 0
    robot.control_tick(s + 30_000_000)
    assert robot.position == pytest.approx([0.3] * 4) and (robot.ticks, robot.starved_ticks) == (2, 1)
    hold = codec.trajectory_points_msg(JOINTS, np.array([[0.3] * 4]), codec.time_msg(s + 30_000_000), 0.01)
    robot._on_trajectory(hold, {"received_timestamp": s + 31_000_000, "source_timestamp": s + 30_500_000})  # a hold
    late = codec.trajectory_points_msg(JOINTS, np.array([[0.4] * 4, [0.5] * 4]), codec.time_msg(s + 40_000_000), 0.01)
    # Its first point was due at 50 ms; written at 41 ms, it spent 11 ms in transport.
    robot._on_trajectory(late, {"received_timestamp": s + 52_000_000, "source_timestamp": s + 41_000_000})
    assert robot.chunk_margins_ms == pytest.approx([5.0, -2.0])  # a hold (one point) has no margin
    assert robot.chunk_transits_ms == pytest.approx([1.0, 11.0])


def test_bench_policy_depth_is_calibrated_to_the_inference_time(monkeypatch):
    """With a chunk costing 2 ms + 1.5 ms per block (a virtual clock), 50 ms needs (50 - 2) / 1.5 = 32 blocks."""
    from robot_bridge import bench

    clock = {"now": 0.0}

    def predict_chunk(self, obs, obs_step=None):
        clock["now"] += 0.002 + 0.0015 * self.depth

    monkeypatch.setattr(bench.BenchPolicy, "predict_chunk", predict_chunk)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock["now"])
    assert build_bench_policy(50, horizon=12, control_hz=100.0, image_size=64, chunk_noise=0.001).depth == 32
    assert build_bench_policy(300, horizon=12, control_hz=100.0, image_size=64, chunk_noise=0.001).depth == 199
    assert build_bench_policy(1, horizon=12, control_hz=100.0, image_size=64, chunk_noise=0.001).depth == 4  # floor


def test_bench_policy_chunks_follow_one_reference_with_small_corrections():
    torch.set_num_threads(1)  # as in the inference worker
    policy = build_bench_policy(inference_ms=5, horizon=12, control_hz=100.0, image_size=64, chunk_noise=0.001)
    obs = {
        image_key("front"): torch.rand(1, 3, 64, 64), OBS_STATE: torch.zeros(1, len(JOINTS)),
        OBS_COMMITTED_ACTIONS: torch.zeros(1, 12, len(JOINTS)), "task": [""],
    }  # fmt: skip
    a = policy.predict_chunk(obs, torch.tensor([5])).actions
    b = policy.predict_chunk(obs, torch.tensor([6])).actions
    assert a.shape == (1, 12, 4)
    # The same reference one step later; the per-chunk correction (at most chunk_noise) differs.
    assert torch.allclose(a[0, 1:], b[0, :-1], atol=1e-3)
    assert (a[0, 1:] - b[0, :-1]).abs().max() > 0


def test_the_bench_low_latency_part_corrects_by_at_most_chunk_noise_from_the_freshest_image():
    """The low-latency bench policy's step: the base moved by a correction in (0, chunk_noise] per joint, which
    reads the image (another image, another correction) and the plan's age."""
    from vla_core.runtime.protocol import StepContext

    policy = build_bench_policy(inference_ms=5, horizon=12, control_hz=100.0, image_size=64, chunk_noise=0.001,
                                depth=4, low_latency=True)  # fmt: skip
    base = torch.full((1, len(JOINTS)), 0.3)
    context = StepContext(torch.zeros(1, 4, len(JOINTS)), torch.ones(1, 4, dtype=torch.bool), torch.tensor([3]),
                          torch.tensor([1]))  # fmt: skip
    obs = {image_key("front"): torch.rand(1, 3, 64, 64), OBS_STATE: torch.zeros(1, len(JOINTS))}
    delta = policy.low_latency_step(obs, base, context) - base
    assert 0 < delta.abs().max() <= 0.001
    other = {**obs, image_key("front"): torch.rand(1, 3, 64, 64)}
    assert not torch.equal(policy.low_latency_step(other, base, context) - base, delta)
    older = StepContext(context.plan, context.queued, torch.tensor([9]), context.since_request)
    assert not torch.equal(policy.low_latency_step(obs, base, older) - base, delta)


def test_bench_bridge_tiny_run(tmp_path):
    """Both outputs, 80 ticks each at 100 Hz under the training load. deadline_ms = 1 us: every tick-mode command
    is late (DDS alone takes longer), so the count shows the setting is what decides."""
    out = tmp_path / "bridge.json"
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    args = [
        sys.executable, "-m", "vla_rl.cli", "bench", "bridge", "--cycles=80", "--ping_cycles=30",
        "--rates_hz=[100]", "--merges=[rtc]", "--inference_ms=50", "--domain_id=43", f"--output_json={out}",
        "--deadline_ms=0.001", "--sizing_chunks=3",
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = FINAL_LINE.match(lines[-1])
    assert match, lines[-1]
    result = json.loads(out.read_text())
    assert [int(v) for v in match.groups()] == [result[k] for k in ("starved_ticks", "late_chunks", "tick_mode_late",
                                                                     "ticks")]  # fmt: skip
    ticks, trajectory = result["runs"]
    assert (ticks["output"], trajectory["output"]) == ("ticks", "trajectory")
    assert ticks["cycles"] == trajectory["cycles"] == 80 and ticks["merge"] == "rtc" and ticks["rate_hz"] == 100.0
    assert result["deadline_ms"] == ticks["deadline_ms"] == 0.001
    assert result["tick_mode_late"] == ticks["deadline_misses"] == 80
    assert ticks["node_counters"]["missed_deadlines"] >= ticks["node_deadline_misses"] > 0
    assert ticks["commands_received"] + ticks["lost_commands"] == 80
    # The controller ticked once per state sent once the first chunk was in, and chunks kept coming.
    assert result["ticks"] == trajectory["ticks"] == 80 and trajectory["chunks_received"] >= 1
    assert trajectory["node_counters"]["trajectories"] >= trajectory["chunks_received"]
    # Each chunk's transport time (DDS source to receive timestamp, one machine's clock) is a fraction of a second.
    assert 0 <= trajectory["chunk_transit_ms"]["p50"] <= trajectory["chunk_transit_ms"]["max"] < 1000
    assert len(trajectory["late_chunk_details"]) == trajectory["late_chunks"]
    assert result["inference"]["loaded"] and result["inference"]["load_steps_per_s"] > 0
    assert (out.parent / "bench_arm.urdf").exists()
    # The horizon comes from the sizing run's in-run latencies: two delays at 1.5x their p99 at 100 Hz, plus the
    # trajectory lead (0.5 s: 50 steps) and the 10 steps executed before the next request.
    # The warm-up's chunks (at least 2, with the worker's first passes) are not among those it is sized on.
    sizing = result["sizing"]
    assert len(sizing["inference_latencies_ms"]) >= 3 and len(sizing["warm_up_latencies_ms"]) >= 2
    p99_s = float(np.percentile(sizing["inference_latencies_ms"], 99)) / 1e3
    assert result["horizon"] == sizing["horizon"] == math.ceil(2 * 1.5 * p99_s * 100) + 50 + 10
    # The lead's arithmetic, exactly and without timing: every chunk starts (1 + 50) periods after the stamp of the
    # state whose tick merged it (the tick of step n + 1 + L), its first point one period later. (The margin this
    # leaves is a timing figure, the benchmark's to report.)
    assert trajectory["chunks_on_their_seam"] == trajectory["chunks_received"] >= 1
    assert sizing["sizing_run_horizon"] == 2 * sizing["provisional_horizon"]
    # Scheduling as the calls return it for this user on this machine, asked in a process of its own.
    probe = (
        "import json; from robot_bridge.scheduling import use_realtime, lock_memory; "
        "print(json.dumps([use_realtime(50), lock_memory()]))"
    )
    rt_problem, lock_problem = json.loads(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    )
    assert ticks["scheduling"] == scheduling_record(rt_problem, lock_problem)
    assert result["scheduling"]["realtime_scheduling"] == (rt_problem is None)
    assert result["scheduling"]["memory_locked"] == (lock_problem is None)
    assert ("WARNING: real-time scheduling was refused" in proc.stdout) == (rt_problem is not None)


def test_bench_bridge_tiny_run_with_a_low_latency_part(tmp_path):
    """Ticks output, 80 ticks at 100 Hz, the part run by serve at every tick: its per-tick times are in the JSON,
    and it fell back only on the odd tick whose joint state arrived before its camera frame (no paired
    observation: the rule sends the uncorrected action)."""
    out = tmp_path / "bridge.json"
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    args = [
        sys.executable, "-m", "vla_rl.cli", "bench", "bridge", "--cycles=80", "--ping_cycles=30",
        "--rates_hz=[100]", "--merges=[latest]", "--inference_ms=50", "--domain_id=44", f"--output_json={out}",
        "--outputs=[ticks]", "--horizon=40", "--low_latency=true", "--load=false",
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ticks,) = json.loads(out.read_text())["runs"]
    assert ticks["policy_info"]["low_latency_rows"] == 4
    assert ticks["node_counters"]["low_latency_fallbacks"] <= 8  # of 80 ticks; the part ran on the others
    assert 0 < ticks["low_latency_ms"]["p50"] <= ticks["low_latency_ms"]["max"] < 1000
