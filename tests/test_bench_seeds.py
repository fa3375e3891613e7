"""Several training seeds in the latency benchmarks (`bench delay --seeds`, `bench latency-rl --seeds`): each seed
its own run in its own folder (the calibration's, when calibrated), a finished seed read back, the cells pooled by
summing counts, and the headline recomputed from the pooled cells."""

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from vla_rl import stages
from vla_rl.bench_delay import BenchDelayConfig, bench_delay, format_summary
from vla_rl.bench_latency_rl import summarize as latency_rl_summary
from vla_rl.bench_stages import calibrated_folder, pool_cells

# Seed 1's successes of 100 per cell, by (policy, merge, delay), as the faked evaluation returns them.
SEED1 = {("plain", "latest", 0): 60, ("plain", "latest", 8): 20, ("augmented", "latest", 0): 58,
         ("augmented", "latest", 8): 40}  # fmt: skip
SEED0 = {("plain", "latest", 0): 50, ("plain", "latest", 8): 30, ("augmented", "latest", 0): 56,
         ("augmented", "latest", 8): 50}  # fmt: skip


def cell(key, successes, episodes=100):
    policy, merge, delay = key
    return {"policy": policy, "merge": merge, "delay": delay, "episodes": episodes, "successes": successes,
            "success_rate": successes / episodes, "success_ci95": [0.0, 1.0]}  # fmt: skip


@pytest.fixture
def seed1_stages(monkeypatch):
    calls = []

    def evaluate(cfg):  # out/eval/<policy>/<merge>/d<d>
        parts = Path(cfg.output_dir).parts
        calls.append(("evaluate", parts[-5]))
        k = SEED1[parts[-3], parts[-2], int(parts[-1][1:])]
        return {"episodes": 100, "successes": k, "success_rate": k / 100, "success_ci95": [0.0, 1.0],
                "mean_episode_length": 40.0}  # fmt: skip

    monkeypatch.setattr(stages, "record", lambda cfg: calls.append(("record", cfg.seed)))
    monkeypatch.setattr(stages, "train", lambda cfg: calls.append(("train", cfg.seed)))
    monkeypatch.setattr(stages, "evaluate", evaluate)
    monkeypatch.setattr("vla_rl.bench_delay.plot", lambda cells, path, task: None)
    return calls


def test_bench_delay_pools_a_finished_seed_with_a_new_one(tmp_path, seed1_stages):
    cfg = BenchDelayConfig(seeds=[0, 1], delays=[0, 8], merges=["latest"], output_dir=str(tmp_path))
    seed0 = replace(cfg, seed=0, seeds=[], output_dir=str(tmp_path / "seed0"), num_threads=1)
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "delay.json").write_text(json.dumps({
        "config": asdict(seed0), "cells": [cell(k, n) for k, n in SEED0.items()],
        "summary": {"augmented_over_plain": 50 / 30, "augmented": {"at_zero_delay": 0.56},
                    "plain": {"at_zero_delay": 0.5}},
    }))  # fmt: skip
    pooled = bench_delay(cfg)
    # Seed 0 was read back; seed 1 ran its stages in its own folder.
    assert ("record", 0) not in seed1_stages and ("record", 1) in seed1_stages
    assert {c[1] for c in seed1_stages if c[0] == "evaluate"} == {"seed1"}
    # Pooled by hand: plain at d=8 (30 + 20) / 200 = 0.25, augmented (50 + 40) / 200 = 0.45: 0.45 / 0.25 = 1.8;
    # at zero delay plain (50 + 60) / 200 = 0.55, augmented (56 + 58) / 200 = 0.57.
    assert pooled["summary"]["augmented_over_plain"] == pytest.approx(1.8)
    assert pooled["summary"]["augmented"]["at_zero_delay"] == pytest.approx(0.57)
    assert json.loads((tmp_path / "pooled.json").read_text())["summary"] == pooled["summary"]
    lines = format_summary(pooled).splitlines()
    assert lines[0] == "seed 0: augmented_over_plain=1.667 augmented_at_zero_delay=0.560 plain_at_zero_delay=0.500"
    assert lines[1] == "seed 1: augmented_over_plain=2.000 augmented_at_zero_delay=0.580 plain_at_zero_delay=0.600"
    assert lines[-1] == "augmented_over_plain=1.800 augmented_at_zero_delay=0.570 plain_at_zero_delay=0.550 seeds=0,1"


def test_pooled_latency_rl_cells_give_the_headline_of_the_summed_counts():
    def arm(name, delay, k):
        return {"arm": name, "delay": delay, "delay_ms": 50 * delay, "episodes": 100, "successes": k}

    seed0 = [arm("imitation", 0, 60), arm("standard", 0, 80), arm("naive", 6, 20), arm("latency_aware", 6, 40)]
    seed1 = [arm("imitation", 0, 50), arm("standard", 0, 70), arm("naive", 6, 30), arm("latency_aware", 6, 60)]
    cells = pool_cells([seed0, seed1], ("arm", "delay", "delay_ms"))
    s = latency_rl_summary(cells, 6)
    # aware (40 + 60) / 200 = 0.5 over naive (20 + 30) / 200 = 0.25 and over standard (80 + 70) / 200 = 0.75;
    # standard's 0.75 over imitation's (60 + 50) / 200 = 0.55: 20 points.
    assert s["latency_aware_over_naive"] == pytest.approx(2.0)
    assert s["latency_aware_over_nodelay"] == pytest.approx(0.5 / 0.75)
    assert s["nodelay_gain"] == pytest.approx(20.0)
    with pytest.raises(ValueError, match="do not share the cells"):
        pool_cells([seed0, seed1[:3]], ("arm", "delay", "delay_ms"))


def test_calibrated_seeds_run_in_the_folders_the_calibration_fixed(tmp_path):
    calibration = tmp_path / "calibration.json"
    folders = {str(s): {"delay": {"output_dir": f"/runs/track_reverse/seed{s}/delay"}} for s in (0, 1)}
    calibration.write_text(json.dumps({"chosen": {"task": "track_reverse", "delay": 6, "seeds": [0, 1]},
                                       "configs": {"track_reverse": folders}}))  # fmt: skip
    folder = calibrated_folder(str(calibration), "delay")
    assert folder(1) == Path("/runs/track_reverse/seed1/delay")
    with pytest.raises(ValueError, match="2, which is not a calibrated seed"):
        folder(2)
    calibration.write_text(json.dumps({"chosen": None}))
    with pytest.raises(ValueError, match="chose no task and delay"):
        calibrated_folder(str(calibration), "delay")
    with pytest.raises(FileNotFoundError, match="run `vla-rl bench delay-calibration` first"):
        calibrated_folder(str(tmp_path / "none.json"), "delay")
