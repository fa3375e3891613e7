"""`vla-rl bench steering --quick`: every stage at toy sizes, end to end (the plumbing, not the claim); the final
line's figures recomputed here from the cells the JSON holds."""

import json
import re
from dataclasses import asdict

import pytest
from extras import require

require("torchrl", "steer")

FINAL = re.compile(
    r"^gated_gain_ood=([+-]\d+\.\d) gated_loss_id=([+-]\d+\.\d) dsrl_gain_ood=([+-]\d+\.\d) "
    r"headroom_ood=([+-]\d+\.\d) cells=(\d+)/(\d+)$"
)


def test_bench_steering_quick_runs_every_stage_and_reports_each_cell(tmp_path):
    from vla_rl.bench_steering import ARMS, BenchSteeringConfig, bench_steering, final_line

    report = bench_steering(BenchSteeringConfig(quick=True, num_threads=1, output_dir=str(tmp_path)))
    out = tmp_path / "quick"
    assert json.loads((out / "steering.json").read_text()) == report and (out / "steering.png").stat().st_size > 0
    assert list(report["cells"]) == ["in_distribution", "position", "lighting"]
    for arms in report["cells"].values():
        assert list(arms) == list(ARMS) and all(a["episodes"] == 2 for a in arms.values())

    def rate(cell, arm):
        return report["cells"][cell][arm]["success_rate"]

    gated = (
        100
        * (
            (rate("position", "gated") - rate("position", "base"))
            + (rate("lighting", "gated") - rate("lighting", "base"))
        )
        / 2
    )
    match = FINAL.match(final_line(report))
    assert match and float(match.group(1)) == pytest.approx(gated, abs=0.05)
    assert float(match.group(2)) == pytest.approx(
        100 * (rate("in_distribution", "base") - rate("in_distribution", "gated")), abs=0.05
    )
    # The sigma probe's bound, recomputed from its rates: the largest scale keeping 95% of the base's success at 1.
    rates = {float(k): v for k, v in report["sigma_probe"]["success"].items()}
    assert sorted(rates) == [1.0, 1.25, 1.5, 1.75, 2.0]
    assert report["sigma_probe"]["bound"] == max(k for k, v in rates.items() if v >= 0.95 * rates[1.0])
    assert report["timing"]["base_ms"] > 0 and report["timing"]["gated_over_base"] > 0
    assert set(report["timing"]) == {"base_ms", "always_ms", "gated_ms", "dsrl_ms", "always_over_base",
                                     "gated_over_base", "dsrl_over_base"}  # fmt: skip
    # the headroom gate ran first, on the base alone: 2 states x 2 draws per setting (quick keeps every variation)
    assert list(report["headroom"]) == ["in_distribution", "position", "lighting"] and report["kept"] == [
        "position", "lighting"]  # fmt: skip
    for name, h in report["headroom"].items():
        episodes = json.loads((out / "headroom" / name / "eval.json").read_text())["per_episode"]
        wins = [sum(e["success"] for e in episodes if e["initial_state"] == k) for k in range(2)]
        assert (h["states"], h["draws"]) == (2, 2) and h["best_of_draws"] == sum(w > 0 for w in wins) / 2
    assert (match.group(5), match.group(6)) == ("2", "2")
    mean = sum(report["headroom"][v]["headroom_points"] for v in ("position", "lighting")) / 2
    assert float(match.group(4)) == pytest.approx(mean, abs=0.05)
    # the base: demonstrations of the varied expert, chunks clamped to the robot's action limits
    from vla_core.robot import SIM_PANDA

    recorded = json.loads((out / "dataset" / "meta" / "vla_rl_record.json").read_text())["config"]["variety"]
    assert recorded == {"detour": 0.03, "detour_steps": 15, "pace_low": 0.7, "noise": 0.002}
    base = json.loads((out / "base" / "checkpoints" / "last" / "pretrained_model" / "config.json").read_text())
    assert base["action_bounds"] == [list(SIM_PANDA.action_low), list(SIM_PANDA.action_high)]
    # A second call reads every finished stage and cell back instead of running it again (no file rewritten).
    written = {p: p.stat().st_mtime_ns for p in (out / "eval").rglob("eval.json")}
    again = bench_steering(BenchSteeringConfig(quick=True, num_threads=1, output_dir=str(tmp_path)))
    assert again["cells"] == report["cells"] and {p: p.stat().st_mtime_ns for p in written} == written
    with pytest.raises(ValueError, match="holds a steering benchmark run with eval_seed=5000, not 5001"):
        bench_steering(BenchSteeringConfig(quick=True, eval_seed=5001, output_dir=str(tmp_path)))
    # A steering from before best-of-N (version 2) is trained again from the same rollouts, and only the steered
    # arms are evaluated again.
    from safetensors.torch import load_file, save_file

    config, weights = out / "steer" / "steering" / "config.json", out / "steer" / "steering" / "model.safetensors"
    old = {k: v for k, v in json.loads(config.read_text()).items() if k not in ("executed", "best_of")}
    config.write_text(json.dumps({**old, "version": 2}))  # as version 2 wrote it: no critic
    save_file({k: v for k, v in load_file(str(weights)).items() if not k.startswith("critic.")}, str(weights))
    rollouts = {p: p.stat().st_mtime_ns for p in (out / "steer" / "rollouts").rglob("*.parquet")}
    bench_steering(BenchSteeringConfig(quick=True, num_threads=1, output_dir=str(tmp_path)))
    assert json.loads(config.read_text())["version"] == 3
    assert {p: p.stat().st_mtime_ns for p in rollouts} == rollouts
    redone = {p for p in written if p.stat().st_mtime_ns != written[p]}
    assert redone == {p for p in written if p.parent.name in ("gated", "always")} and redone


def test_the_final_figures_are_the_cells_differences_in_points():
    """Hand-made cells: in distribution base 0.80, gated 0.78 (a loss of 2.0 points); position base 0.40, gated
    0.55, DSRL 0.50; lighting base 0.60, gated 0.65, DSRL 0.50: gated +10.0 on average, DSRL 0.0."""
    from vla_rl.bench_steering import BenchSteeringConfig, _report, final_line

    rates = {"": {"base": 0.80, "always": 0.70, "gated": 0.78, "dsrl": 0.79},
             "position": {"base": 0.40, "always": 0.50, "gated": 0.55, "dsrl": 0.50},
             "lighting": {"base": 0.60, "always": 0.62, "gated": 0.65, "dsrl": 0.50}}  # fmt: skip
    table = {(c, a): {"episodes": 100, "successes": round(100 * r), "success_rate": r, "success_ci95": [0, 1]}
             for c, arms in rates.items() for a, r in arms.items()}  # fmt: skip
    report = _report(asdict(BenchSteeringConfig()), table, {}, 60.0, None, ["position", "lighting"])
    assert final_line(report) == "gated_gain_ood=+10.0 gated_loss_id=+2.0 dsrl_gain_ood=+0.0"
    assert report["always_gain_ood"] == 6.0 and report["base_floor_met"]
    assert report["dsrl_loss_id"] == 1.0  # 0.80 - 0.79 in distribution
    assert report["gain_per_cell"]["gated"] == {"position": 15.0, "lighting": 5.0}


def seed_report(rates: dict[str, dict[str, int]], headroom: dict[str, tuple[float, bool]]) -> dict:
    """A finished seed's report with 100 episodes a cell: ``rates`` successes by cell and arm, ``headroom`` each
    setting's (points, kept)."""
    from vla_rl.bench_steering import BenchSteeringConfig

    kept = [v for v, (_, k) in headroom.items() if k]
    cells = {c: {a: {"episodes": 100, "successes": n, "success_rate": n / 100} for a, n in arms.items()}
             for c, arms in rates.items()}  # fmt: skip
    return {"config": {**asdict(BenchSteeringConfig()), "variations": list(headroom)[1:]}, "cells": cells,
            "headroom": {v: {"mean": 0.5, "headroom_points": p, "kept": k} for v, (p, k) in headroom.items()},
            "kept": kept, "steering_ran": True, "minutes": 10.0,
            "headroom_ood": sum(headroom[v][0] for v in kept) / len(kept)}  # fmt: skip


def test_seeds_pool_the_cells_kept_on_every_seed_and_average_the_headroom():
    """Seed 0 keeps camera and size (headroom 20, 30), seed 1 keeps camera only (16): the arms pool over camera
    alone, and so does headroom_ood, camera's mean over the seeds, +18.0. Camera: base 40 + 50 of 200, gated
    60 + 56 (+13.0 points), DSRL 40 + 50 (+0.0); in distribution base 98 + 100, gated 97 + 99 (a loss of 1.0
    point)."""
    from vla_rl.bench_steering import final_line, pool_steering

    id0 = {"base": 98, "always": 98, "gated": 97, "dsrl": 98}
    id1 = {"base": 100, "always": 100, "gated": 99, "dsrl": 100}
    seed0 = seed_report({"in_distribution": id0, "camera": {"base": 40, "always": 45, "gated": 60, "dsrl": 40},
                         "size": {"base": 10, "always": 10, "gated": 90, "dsrl": 10}},
                        {"in_distribution": (0.0, False), "camera": (20.0, True), "size": (30.0, True)})  # fmt: skip
    seed1 = seed_report({"in_distribution": id1, "camera": {"base": 50, "always": 50, "gated": 56, "dsrl": 50}},
                        {"in_distribution": (0.0, False), "camera": (16.0, True), "size": (4.0, False)})  # fmt: skip
    pooled = pool_steering({0: seed0, 1: seed1})
    assert pooled["kept"] == ["camera"] and pooled["headroom"]["size"]["kept_on"] == [0]
    assert (
        pooled["cells"]["camera"]["gated"]["successes"] == 116 and pooled["cells"]["camera"]["gated"]["episodes"] == 200
    )
    assert (
        final_line(pooled) == "gated_gain_ood=+13.0 gated_loss_id=+1.0 dsrl_gain_ood=+0.0 headroom_ood=+18.0 cells=1/2"
    )
    assert pooled["config"]["seeds"] == [0, 1] and set(pooled["seeds"]) == {"0", "1"}
    stopped = pool_steering({0: {**seed0, "steering_ran": False}, 1: seed1})
    assert final_line(stopped) == "headroom_ood=+18.0 cells=1/2"


def test_a_run_stopped_at_the_headroom_gate_prints_only_the_gate():
    """Two of three variations kept, with 20 and 30 points of headroom: headroom_ood is their mean, 25.0."""
    from vla_rl.bench_steering import final_line

    headroom = {"in_distribution": {"headroom_points": 1.0}, "position": {"headroom_points": 20.0},
                "size": {"headroom_points": 30.0}, "colour": {"headroom_points": 2.0}}  # fmt: skip
    stopped = {"headroom": headroom, "kept": ["position", "size"], "headroom_ood": 25.0, "steering_ran": False}
    assert final_line(stopped) == "headroom_ood=+25.0 cells=2/3"


def test_the_clamp_and_gate_settings_are_refused_before_anything_runs(tmp_path):
    from vla_rl.bench_steering import BenchSteeringConfig, bench_steering

    assert BenchSteeringConfig(clamp="data").action_bounds == []
    for bad, match in (
        ({"clamp": "limits"}, "--clamp must be robot"),
        ({"headroom_draws": 1}, "--headroom_draws >= 2"),
    ):
        with pytest.raises(ValueError, match=match):
            bench_steering(BenchSteeringConfig(output_dir=str(tmp_path / "run"), **bad))
    assert not (tmp_path / "run").exists()  # nothing recorded or written
