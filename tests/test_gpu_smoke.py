"""The GPU smoke script's checks stay runnable: on the CPU (the device they are handed), the delay
streams and the policies pass, and without CUDA the script refuses with exit code 2. On a machine with
a GPU the same checks run there (`python benchmarks/gpu_smoke.py`)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_smoke


def test_the_checks_pass_on_the_cpu():
    """Each check on the CPU; the policies' chunks also match the kept reference (computed once, not by this run:
    a change of what the small policies compute fails here, and on a GPU it fails the smoke script)."""
    assert gpu_smoke.check_delay_streams(torch.device("cpu")) == {"streams_differ": True, "restored": True}
    policies = gpu_smoke.check_policy_on_gpu(torch.device("cpu"))
    assert policies["max_gap_to_cpu"] == {"diffusion": 0.0, "flow": 0.0}  # the same device: the same chunk exactly
    assert all(gap < 1e-4 for gap in policies["max_gap_to_reference"].values()), policies
    # A worker declaring no GPU stays on the CPU; two worlds of at most 8 steps, chunks of 2 actions: at most
    # 4 decisions each, at least 1.
    ray_check = gpu_smoke.check_ray_worker_on_gpu(torch.device("cpu"))
    assert ray_check["worker_device"] == "cpu" and 2 <= ray_check["decisions"] <= 8
    vla = gpu_smoke.check_lerobot_vla_on_gpu(torch.device("cpu"))
    assert vla["max_gap_to_cpu"] == 0.0 and vla["trained_tensors"] > 0 and vla["peak_mib"] is None
    assert vla["max_gap_to_reference"] < 1e-4
    tokens = gpu_smoke.check_autoregressive_vla_on_gpu(torch.device("cpu"))  # same tokens cached or not, or it raises
    assert 1 <= tokens["tokens_per_chunk"] <= 8 * 2 + 1 and tokens["peak_mib"] is None


def test_the_latency_shell_check_runs_warp_worlds_to_their_ends_on_the_cpu():
    """MuJoCo Warp runs on the CPU too, so the shell check is exercised here, against what the protocol implies
    independently of the code: 4 worlds held still for 30-step episodes all end by truncation, after one decision
    per 4 executed steps, ceil(30 / 4) = 8 of them."""
    assert {k: v for k, v in gpu_smoke.check_shell_on_gpu(torch.device("cpu"), num_envs=4).items() if k != "seconds"} == {
        "episodes": 4, "steps": 8}  # fmt: skip


def test_without_cuda_the_script_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_smoke.main(["--out", str(tmp_path / "out.json")]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


def test_a_chunk_off_the_reference_fails_the_check(tmp_path, monkeypatch):
    """The reference is a real bar: a kept chunk moved by 0.01 in one entry makes the check fail, naming the gap."""
    import json

    kept = json.loads(Path(gpu_smoke.REFERENCE).read_text())
    kept["flow"][0][0][0] += 0.01
    moved = tmp_path / "reference.json"
    moved.write_text(json.dumps(kept))
    monkeypatch.setattr(gpu_smoke, "REFERENCE", str(moved))
    with pytest.raises(AssertionError, match="flow"):
        gpu_smoke.check_policy_on_gpu(torch.device("cpu"))
