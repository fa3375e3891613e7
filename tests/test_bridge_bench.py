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

from robot_bridge.bench import JOINTS, build_bench_policy, seam_jumps
from vla_rl.types import OBS_COMMITTED_ACTIONS, OBS_STATE, image_key

ROOT = Path(__file__).resolve().parents[1]
FINAL_LINE = re.compile(r"^deadline_misses=(\d+) added_latency_p99_ms=(-?\d+\.\d{3}) jitter_p99_ms=(\d+\.\d{3})$")


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


def test_bench_policy_is_calibrated_real_work():
    torch.set_num_threads(1)  # as in the inference worker
    policy = build_bench_policy(inference_ms=50, horizon=12, control_hz=100.0, image_size=64, chunk_noise=0.001)
    assert policy.depth > 4  # 50 ms needs more than the base blocks
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
    args = [
        sys.executable, "-m", "vla_rl.cli", "bench", "bridge", "--cycles=80", "--ping_cycles=30",
        "--rates_hz=[100]", "--merges=[rtc]", "--inference_ms=50", "--domain_id=43", f"--output_json={out}",
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
    assert run["commands_received"] + run["lost_commands"] == 80
    assert np.isfinite(run["state_to_command_ms"]["p50"]) and run["state_to_command_ms"]["p50"] > 0
    assert run["inference_latency_ms"]["p50"] > 10  # a real forward pass, not nothing
    assert set(run["seams"]) == {"seam_max_velocity_jump", "within_max_velocity_jump"}
    assert result["pings"]["100.0"]["pongs"] > 0
    assert set(result["per_rate"]["100.0"]) >= {"added_latency_p99_ms", "jitter_p99_ms", "raw_round_trip_ms", "seams"}
