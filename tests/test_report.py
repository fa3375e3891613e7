"""`vla-rl report`: records per suite and task, the published figures beside them, McNemar's paired test."""

import json

import pytest

from vla_rl.eval_report import ReportConfig, report
from vla_rl.statistics import mcnemar_exact


def test_mcnemar_exact_by_hand():
    """b discordant one way, c the other, n = b + c: p = min(1, 2 * sum_{i <= min(b, c)} C(n, i) / 2^n).
    (5, 0): 2 / 32 = 0.0625. (7, 1): 2 * (1 + 8) / 256 = 0.0703125. (1, 1): 2 * 3 / 4 -> 1. (0, 0): 1."""
    assert mcnemar_exact(5, 0) == 0.0625 and mcnemar_exact(0, 5) == 0.0625
    assert mcnemar_exact(7, 1) == 0.0703125
    assert mcnemar_exact(1, 1) == 1.0 and mcnemar_exact(0, 0) == 1.0


def _record(path, successes: dict[tuple[str, int], bool], checkpoint="ckpt", delay=None):
    episodes = [{"round": i, "world": 0, "task": task, "initial_state": state, "success": ok, "length": 100 + i}
                for i, ((task, state), ok) in enumerate(successes.items())]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"checkpoint": checkpoint, "protocol": {"name": "openpi"}, "delay": delay or {},
                                "per_episode": episodes}))  # fmt: skip
    return str(path)


def test_two_records_side_by_side_and_paired(tmp_path):
    """Two tasks of libero_spatial, 5 initial states each. A succeeds on all of task 0 and on states 0, 1 of
    task 1; B on states 0, 1 of both. Per suite: A 7/10, B 4/10. Paired on task 0: A alone 3 times, B alone
    never: p = 2 / 8 = 0.25; task 1: no discordant pair, p = 1; overall (3, 0): 0.25. The published
    Spatial figures of the anchors' table stand beside them."""
    a = {("libero_spatial/0", s): True for s in range(5)} | {("libero_spatial/1", s): s < 2 for s in range(5)}
    b = {("libero_spatial/0", s): s < 2 for s in range(5)} | {("libero_spatial/1", s): s < 2 for s in range(5)}
    result = report(ReportConfig(records=[_record(tmp_path / "A" / "eval.json", a), _record(tmp_path / "B" / "eval.json", b)],
                                 output_dir=str(tmp_path / "out")))  # fmt: skip
    first, second = result["records"]
    assert (first["name"], first["suites"]["libero_spatial"]["successes"], first["overall"]["episodes"]) == ("A", 7, 10)
    assert second["suites"]["libero_spatial"]["successes"] == 4
    assert first["tasks"]["libero_spatial/1"]["mean_episode_length"] == 100 + (5 + 6 + 7 + 8 + 9) / 5
    tests = result["paired"]["tests"]
    assert (tests["libero_spatial/0"]["only_first"], tests["libero_spatial/0"]["only_second"]) == (3, 0)
    assert tests["libero_spatial/0"]["p_value"] == 0.25 and tests["libero_spatial/1"]["p_value"] == 1.0
    assert tests["overall"]["p_value"] == 0.25 and tests["overall"]["pairs"] == 10
    published = {p["model"]: p["success"] for p in result["published"]}
    assert published["pi0.5 (openpi)"] == {"libero_spatial": 98.8}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| A | openpi | 70.0% (7/10)" in md and "| libero_spatial/0 | 5 | 3 | 0 | 100.0% | 40.0% | 0.25 |" in md
    assert (tmp_path / "out" / "report.png").stat().st_size > 0


def test_records_of_other_episodes_are_not_paired_and_bad_records_are_named(tmp_path):
    a = {("libero_spatial/0", s): True for s in range(3)}
    b = {("libero_spatial/0", s): True for s in range(1, 4)}
    records = [_record(tmp_path / "A" / "eval.json", a), _record(tmp_path / "B" / "eval.json", b)]
    with pytest.raises(ValueError, match=r"ran different episodes \(1 only in the first, 1 only in the second\)"):
        report(ReportConfig(records=records, output_dir=str(tmp_path / "out")))
    assert "paired" not in report(ReportConfig(records=records, paired=False, output_dir=str(tmp_path / "out")))
    (tmp_path / "old.json").write_text(json.dumps({"per_episode": [{"success": True, "length": 3}]}))
    with pytest.raises(ValueError, match="without per-episode tasks"):
        report(ReportConfig(records=[str(tmp_path / "old.json")], output_dir=str(tmp_path / "out")))
    with pytest.raises(ValueError, match="not a readable evaluation record"):
        report(ReportConfig(records=[str(tmp_path / "missing.json")], output_dir=str(tmp_path / "out")))


def test_success_by_delay_and_learning_curves(tmp_path):
    """One checkpoint under no delay (3/4) and a fixed delay of 4 (1/4), another under none (2/4): a by-delay
    table of the three. A fine-tuning run's evaluations (0.25 of 8 at 0 env steps, 0.75 at 1000) become a
    curve, in the markdown and as a plot."""
    from vla_rl.eval_report import delay_label

    def outcomes(wins):
        return {("lift", s): s < wins for s in range(4)}

    records = [_record(tmp_path / "a0" / "eval.json", outcomes(3), "A", {"kind": "fixed", "steps": 0}),
               _record(tmp_path / "a4" / "eval.json", outcomes(1), "A", {"kind": "fixed", "steps": 4}),
               _record(tmp_path / "b0" / "eval.json", outcomes(2), "B")]  # fmt: skip
    run = tmp_path / "ppo"
    run.mkdir()
    (run / "finetune_summary.json").write_text(json.dumps({"algo": "ppo", "evals": [
        {"iteration": 0, "env_steps": 0, "success_rate": 0.25, "success_ci95": [0.07, 0.59], "episodes": 8},
        {"iteration": 5, "env_steps": 1000, "success_rate": 0.75, "success_ci95": [0.41, 0.93], "episodes": 8}]}))  # fmt: skip
    result = report(ReportConfig(records=records, learning_curves=[str(run)], paired=False,
                                 output_dir=str(tmp_path / "out")))  # fmt: skip
    assert [(r["checkpoint"], r["delay"], r["successes"]) for r in result["by_delay"]] == [
        ("A", "none", 3), ("A", "fixed 4", 1), ("B", "none", 2)
    ]  # fmt: skip
    assert [p["success_rate"] for p in result["learning_curves"][0]["points"]] == [0.25, 0.75]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| A | fixed 4 | 25.0% (1/4)" in md and "| 5 | 1000 | 75.0% (6/8)" in md
    assert (tmp_path / "out" / "learning_curves.png").stat().st_size > 0
    assert delay_label({"kind": "uniform", "low": 2, "high": 5}) == "uniform 2-5"
    with pytest.raises(ValueError, match="not a readable finetune_summary.json"):
        report(ReportConfig(learning_curves=[str(tmp_path / "nothing")], output_dir=str(tmp_path / "out2")))
