"""`vla-rl bench bridge` end to end at a tiny size: two processes, real numbers, the JSON and the final line.

Timing is not asserted (the machine is shared); the seam metric and the calibration are checked on their own.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from robot_bridge.bench import (
    JOINTS,
    BenchBridgeConfig,
    _summarize,
    build_bench_policy,
    deadline_misses,
    format_summary,
    scheduling_record,
    seam_jumps,
)
from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_STATE, image_key

ROOT = Path(__file__).resolve().parents[1]
FINAL_LINE = re.compile(
    r"^deadline_misses=(\d+) added_latency_p99_ms=(-?\d+\.\d{3}) jitter_p99_ms=(\d+\.\d{3}) "
    r"realtime_scheduling=(granted|refused) memory_locking=(granted|refused)$"
)


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


def _run(rate, realtime_problem=None, lock_problem=None, misses=0):
    """One run's row as `_run_one` writes it, with made-up timings."""
    q = {"p50": 1.0, "p99": 2.0, "max": 3.0}
    return {
        "rate_hz": rate, "merge": "rtc", "cycles": 100, "deadline_ms": 5.0, "deadline_misses": misses,
        "node_deadline_misses": 0, "starved_ticks": 0, "state_to_command_ms": q, "node_tick_latency_ms": q,
        "jitter_ms": q, "inference_latency_ms": q, "obs_to_influenced_command_ms": q,
        "seams": {"seam_max_velocity_jump": 0.1, "within_max_velocity_jump": 0.1},
        "scheduling": scheduling_record(realtime_problem, lock_problem),
    }  # fmt: skip


def test_summary_records_scheduling_and_warns_when_it_was_refused():
    cfg = BenchBridgeConfig(rates_hz=[50.0, 100.0], deadline_ms=5.0)
    pings = {r: {"pings": 30, "pongs": 29, "round_trip_ms": {"p50": 0.5, "p99": 1.0, "max": 1.5}} for r in cfg.rates_hz}
    granted = _summarize(cfg, 16, [_run(50.0, misses=2), _run(100.0, misses=3)], pings)
    assert granted["deadline_ms"] == 5.0 and granted["deadline_misses"] == 5
    assert granted["scheduling"] == {
        "realtime_scheduling": True, "memory_locked": True, "robot_realtime_scheduling": True, "problems": [],
    }  # fmt: skip
    text = format_summary(granted)
    assert "WARNING" not in text
    assert granted["per_rate"]["50.0"]["raw_pongs"] == [29, 30] and "(29/30 answered)" in text
    assert text.splitlines()[-1].endswith("realtime_scheduling=granted memory_locking=granted")

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
    match = FINAL_LINE.match(lines[-1])
    assert match and match.group(4, 5) == ("refused", "refused"), lines[-1]


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


def test_bench_bridge_tiny_run(tmp_path):
    out = tmp_path / "bridge.json"
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    # deadline_ms = 1 us: every command is late (DDS alone takes longer), so the count shows the
    # setting is what decides (half a period would be 5 ms at 100 Hz).
    args = [
        sys.executable, "-m", "vla_rl.cli", "bench", "bridge", "--cycles=80", "--ping_cycles=30",
        "--rates_hz=[100]", "--merges=[rtc]", "--inference_ms=50", "--domain_id=43", f"--output_json={out}",
        "--deadline_ms=0.001",
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = FINAL_LINE.match(lines[-1])
    assert match, lines[-1]
    result = json.loads(out.read_text())
    assert result["deadline_misses"] == int(match.group(1))
    run = result["runs"][0]
    assert run["cycles"] == 80 and run["merge"] == "rtc" and run["rate_hz"] == 100.0
    assert result["deadline_ms"] == run["deadline_ms"] == 0.001
    assert result["deadline_misses"] == run["deadline_misses"] == 80
    assert run["node_counters"]["missed_deadlines"] >= run["node_deadline_misses"] > 0
    # Scheduling as the calls return it for this user on this machine, asked in a process of its own.
    probe = (
        "import json; from robot_bridge.scheduling import use_realtime, lock_memory; "
        "print(json.dumps([use_realtime(50), lock_memory()]))"
    )
    rt_problem, lock_problem = json.loads(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    )
    assert run["scheduling"] == scheduling_record(rt_problem, lock_problem)
    assert result["scheduling"]["realtime_scheduling"] == (rt_problem is None)
    assert result["scheduling"]["memory_locked"] == (lock_problem is None)
    granted = {True: "granted", False: "refused"}
    assert match.group(4, 5) == (granted[rt_problem is None], granted[lock_problem is None])
    assert ("WARNING: real-time scheduling was refused" in proc.stdout) == (rt_problem is not None)
    assert run["commands_received"] + run["lost_commands"] == 80
    assert np.isfinite(run["state_to_command_ms"]["p50"]) and run["state_to_command_ms"]["p50"] > 0
    assert run["inference_latency_ms"]["p50"] > 10  # a real forward pass, not nothing
    assert set(run["seams"]) == {"seam_max_velocity_jump", "within_max_velocity_jump"}
    # On loopback every ping comes back unless the echo is starved: the inference worker once
    # started at the serve process's real-time priority and held its core while importing torch.
    assert result["pings"]["100.0"]["pongs"] >= 28 and result["per_rate"]["100.0"]["raw_pongs"][1] == 30
    assert set(result["per_rate"]["100.0"]) >= {"added_latency_p99_ms", "jitter_p99_ms", "raw_round_trip_ms", "seams"}
