"""`vla-rl bench latency-rl`: the final line's ratios, and every stage at toy sizes."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vla_rl.bench_latency_rl import summarize

ROOT = Path(__file__).resolve().parents[1]


def _cell(arm, delay, rate):
    return {"arm": arm, "delay": delay, "success_rate": rate}


def test_the_ratios_compare_the_largest_delay_with_naive_and_with_no_delay_rl():
    cells = [
        _cell("imitation", 0, 0.65), _cell("standard", 0, 0.80), _cell("naive", 0, 0.80), _cell("latency_aware", 0, 0.80),
        _cell("naive", 3, 0.60), _cell("latency_aware", 3, 0.70),
        _cell("naive", 6, 0.40), _cell("latency_aware", 6, 0.60), _cell("training_rtc", 6, 0.50),
    ]  # fmt: skip
    s = summarize(cells, 6)
    assert s["latency_aware_over_naive"] == pytest.approx(0.60 / 0.40)
    assert s["latency_aware_over_nodelay"] == pytest.approx(0.60 / 0.80)
    assert s["nodelay_gain"] == 15.0  # what RL without delay gained over its imitation start, in points
    never = summarize([*cells[:-3], _cell("naive", 6, 0.0), _cell("latency_aware", 6, 0.3)], 6)
    assert math.isinf(never["latency_aware_over_naive"])  # over zero: printed as inf, it means nothing


def test_the_no_delay_run_may_have_a_larger_budget_and_never_a_smaller_one(tmp_path):
    from vla_rl.bench_latency_rl import BenchLatencyRLConfig, bench_latency_rl

    same = BenchLatencyRLConfig(env_steps=36_000)
    assert (same.budget(0), same.budget(8)) == (36_000, 36_000)
    longer = BenchLatencyRLConfig(env_steps=36_000, standard_env_steps=150_000)
    assert (longer.budget(0), longer.budget(3), longer.budget(8)) == (150_000, 36_000, 36_000)
    with pytest.raises(ValueError, match="never fewer"):
        bench_latency_rl(BenchLatencyRLConfig(env_steps=36_000, standard_env_steps=20_000, output_dir=str(tmp_path)))
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.slow  # every arm at toy sizes, 30 s: -m slow
def test_quick_benchmark_runs_every_arm_and_prints_the_final_line(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "latency_rl.py"), "--quick=true", f"--output_dir={out}",
         "--standard_env_steps=600"],
        check=False, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.match(r"^latency_aware_over_naive=(\d+\.\d{3}|inf) latency_aware_over_nodelay=(\d+\.\d{3}|inf) "
                    r"nodelay_gain=[+-]\d+\.\d$", last)  # fmt: skip
    report = json.loads((out / "quick" / "latency_rl.json").read_text())
    cells = {(c["arm"], c["delay"]) for c in report["cells"]}
    arms = ("imitation", "naive", "latency_aware", "mid_head", "training_rtc")
    assert cells == {(a, d) for a in arms for d in (0, 3)} | {
        ("standard", 0), ("warmup_only", 3), ("low_latency_warmup", 3)}  # fmt: skip
    assert all(c["episodes"] == 4 for c in report["cells"])
    runs = report["runs"]
    assert set(runs) == {"standard_d0", "naive_d3", "latency_aware_d3", "mid_head_d3"}
    assert runs["latency_aware_d3"]["low_latency"] and runs["mid_head_d3"]["latency_aware"]
    assert not runs["naive_d3"]["latency_aware"] and not runs["naive_d3"]["low_latency"]
    # each budget was spent, then the run stopped: the no-delay run's own 600 steps took it a second iteration
    # (one is 4 worlds x 2 episodes, 480 steps here), quick's 150 stopped the runs under delay after one
    assert runs["standard_d0"]["env_steps"] >= 600 and runs["standard_d0"]["iterations"] == 2
    assert all(
        run["env_steps"] >= 150 and run["iterations"] == 1 for name, run in runs.items() if name != "standard_d0"
    )
    folder = out / "quick" / "runs"
    aware = json.loads((folder / "latency_aware_d3/checkpoints/last/pretrained_model/config.json").read_text())
    assert (aware["low_latency"], aware["low_latency_max_age"], aware["low_latency_cameras"]) == (
        True,
        3 + 4,
        ["front"],
    )
    head = json.loads((folder / "mid_head_d3/checkpoints/last/pretrained_model/config.json").read_text())
    assert (head["latency_aware"], head["latency_max_delay"], head["mid_cameras"]) == (True, 3, ["front"])
    assert set(report["ceiling"]) == {"no_delay", "naive", "low_latency"}
    assert all(probe["episodes"] == 4 for probe in report["ceiling"].values())
    # the warm-up only arms are the fast runs' starting points: fitted on the demonstrations, no RL
    low = next(c for c in report["cells"] if c["arm"] == "low_latency_warmup")
    assert Path(low["checkpoint"]) == (folder / "latency_aware_d3" / "latency_warmup").resolve()
    warm = next(c for c in report["cells"] if c["arm"] == "warmup_only")
    assert Path(warm["checkpoint"]) == (folder / "mid_head_d3" / "latency_warmup").resolve()
    warm_meta = json.loads((Path(warm["checkpoint"]) / "last" / "metadata.json").read_text())["latency_warmup"]
    assert warm_meta["steps"] == 10 and warm_meta["dataset"] == str(out / "quick" / "dataset")
    assert (out / "quick" / "latency_rl.png").stat().st_size > 0


def test_each_timelines_information_is_as_old_as_its_shell_leaves_it():
    """d = 8, 4 steps a chunk: without delay a chunk's rows 0-3 run; naive, nothing runs before step 8 and then the
    chunk of the request at iP (P = 8) runs its rows 8-15; the low-latency part reads its own step's world, as the
    shell hands it (tests/test_low_latency.py: the state it reads is the step's)."""
    import torch

    from vla_rl.bench_latency_rl import information_age

    steps = torch.arange(20)
    assert information_age("no_delay", steps, 8, 4).tolist() == [0, 1, 2, 3] * 5
    assert information_age("naive", steps, 8, 4).tolist() == [-1] * 8 + list(range(8, 16)) + [8, 9, 10, 11]
    assert information_age("low_latency", steps, 8, 4).tolist() == [0] * 20


def test_the_expert_is_worse_the_older_its_information():
    """On the jumping ball at d = 8 (60 episodes): fresh information every step beats 8-15 steps old by far."""
    from vla_rl.bench_latency_rl import BenchLatencyRLConfig, _expert_episodes

    cfg = BenchLatencyRLConfig(task="track_jump", delays=[0, 8], eval_episodes=60, eval_seed=9000)
    fresh, stale = _expert_episodes(cfg, "low_latency", 8), _expert_episodes(cfg, "naive", 8)
    assert len(fresh) == len(stale) == 60 and sum(fresh) >= sum(stale) + 15


def test_skipped_arms_are_neither_trained_nor_evaluated(tmp_path, monkeypatch):
    """``--skip_arms=[mid_head,training_rtc]``: no training-time RTC policy, no mid-head PPO run, no cell of theirs
    (nor warmup_only, the mid head's starting point); every arm the final line reads is still run. An arm the final
    line reads cannot be skipped."""
    from vla_rl import bench_latency_rl, bench_stages

    trained, ppo_runs, evaluated = [], [], []
    monkeypatch.setattr(bench_stages, "record_demos", lambda cfg, dataset: None)
    monkeypatch.setattr(bench_stages, "train_imitation", lambda cfg, dataset, out, delay=None: trained.append(out.name))

    def fake_ppo(cfg, out, name, d, latency_aware, low_latency=False):
        ppo_runs.append(name)
        (out / "runs" / name).mkdir(parents=True)
        (out / "runs" / name / "initial_checkpoint.txt").write_text(str(out / "runs" / name / "latency_warmup"))
        return out / "runs" / name, {}

    rates = {"imitation": 0.5, "standard": 0.8, "naive": 0.4, "latency_aware": 0.6, "low_latency_warmup": 0.5}
    monkeypatch.setattr(bench_stages, "ppo_run", fake_ppo)
    monkeypatch.setattr(bench_stages, "latency_rl_cell", lambda cfg, out, arm, d, checkpoint: evaluated.append(
        (arm, d)) or {"success_rate": rates[arm], "success_ci95": [0, 1], "episodes": 1})  # fmt: skip
    monkeypatch.setattr(bench_latency_rl, "expert_ceiling", lambda cfg, path: {})
    monkeypatch.setattr(bench_latency_rl, "plot", lambda cells, path, task: None)
    cfg = bench_latency_rl.BenchLatencyRLConfig(delays=[0, 8], output_dir=str(tmp_path),
                                                skip_arms=["mid_head", "training_rtc"])  # fmt: skip
    report = bench_latency_rl.bench_latency_rl(cfg)
    assert trained == ["imitation"] and ppo_runs == ["standard_d0", "naive_d8", "latency_aware_d8"]
    assert set(evaluated) == {("imitation", 0), ("imitation", 8), ("standard", 0), ("naive", 0), ("naive", 8),
                              ("latency_aware", 0), ("latency_aware", 8), ("low_latency_warmup", 8)}  # fmt: skip
    assert report["summary"]["latency_aware_over_naive"] == pytest.approx(0.6 / 0.4)
    with pytest.raises(ValueError, match=r"--skip_arms=\['naive'\]: only .* may be left out"):
        bench_latency_rl.bench_latency_rl(bench_latency_rl.BenchLatencyRLConfig(skip_arms=["naive"]))
