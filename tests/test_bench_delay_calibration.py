"""`vla-rl bench delay-calibration`: the fixed rule, the order and stopping of its stages, resumption,
and the arms' refusal of anything the calibration did not choose.

The orchestration tests replace the four stage functions (recording, imitation, evaluation, PPO) by
ones that record each call and return success counts written in the test, so each expected choice
and stage list below is worked out by hand from those counts and the protocol's rule. The real stages
run in the slow end-to-end test at toy sizes.
"""

import hashlib
import json
import re
import shutil
from fractions import Fraction
from pathlib import Path

import pytest

from vla_rl import bench_stages
from vla_rl.bench_delay import bench_delay
from vla_rl.bench_delay_calibration import (
    BenchDelayCalibrationConfig,
    bench_delay_calibration,
    benchmark_configs,
    format_summary,
    imitation_qualifies,
    rl_qualifies,
)
from vla_rl.bench_latency_rl import bench_latency_rl
from vla_rl.bench_stages import check_calibration
from vla_rl.stages import DelayConfig

FINAL_LINE = re.compile(r"^task=(\S+) delay=(\S+) plain_loss_points=(\S+) naive_over_standard=(\S+)$")


def test_the_rule_is_exact_at_its_boundaries():
    # 0.6 - 0.4 is 0.2 exactly in counts (240 and 160 of 400), though not in binary floating point.
    assert 0.6 - 0.4 < 0.2
    assert imitation_qualifies(Fraction(240, 400), Fraction(160, 400))
    assert not imitation_qualifies(Fraction(240, 400), Fraction(161, 400))
    # 0.6 x 0.75 = 0.45 (0.4499... in floats): naive at 180 of 400 passes, at 181 it does not.
    assert not 0.45 <= 0.6 * 0.75
    assert rl_qualifies(Fraction(180, 400), Fraction(300, 400))
    assert not rl_qualifies(Fraction(181, 400), Fraction(300, 400))


# Successes of 200 episodes per (task, arm, delay): (seed 0, seed 1). Pooled plain(0) on track_reverse
# = 230/400 = 0.575; the losses at d = 2, 4, 6, 8, 10 are 0.0525, 0.2 (exactly: 150/400), 0.275, 0.3,
# 0.35, so 4 is the first delay that passes. Pooled standard(0) = 300/400, so naive must reach
# <= 180/400: at d = 4 it is 200/400 (fails), at d = 6 180/400 (passes, exactly): D = 6, and no naive
# run at 8 or 10, no stage of push_impulse.
COUNTS = {
    ("track_reverse", "plain", 0): (120, 110), ("track_reverse", "plain", 2): (110, 99),
    ("track_reverse", "plain", 4): (80, 70), ("track_reverse", "plain", 6): (60, 60),
    ("track_reverse", "plain", 8): (50, 60), ("track_reverse", "plain", 10): (50, 40),
    ("track_reverse", "standard", 0): (160, 140), ("track_reverse", "naive", 4): (100, 100),
    ("track_reverse", "naive", 6): (95, 85), ("track_reverse", "naive", 8): (0, 0),
    ("push_impulse", "standard", 0): (150, 150),
}  # fmt: skip


class Calls(list):
    """The stages called, in order; ``places``: (checkpoint or run, folder) of each evaluation and PPO run."""


@pytest.fixture
def fake_stages(monkeypatch, tmp_path):
    """The stages replaced by recorders; the protocol file copied, so a test may edit it."""
    import vla_rl.bench_stages as stages

    protocol = tmp_path / "protocol.md"
    shutil.copy(stages.PROTOCOL, protocol)
    monkeypatch.setattr(stages, "PROTOCOL", protocol)
    calls, places = Calls(), []

    def relative(path) -> str:  # a folder below the calibration's output_dir, as the arms will find it
        parts = Path(path).parts
        return "/".join(parts[parts.index("cal") + 1 :])

    def held_out(cfg, checkpoint, episodes, seed, output_dir, num_envs, delay_steps=0, merge="latest"):
        parts = Path(output_dir).parts
        arm, d = parts[parts.index("eval") + 1], int(parts[-1][1:])
        s = COUNTS[cfg.task, arm, d][cfg.seed]
        calls.append(("eval", cfg.task, cfg.seed, arm, d, episodes, seed, merge))
        places.append((relative(checkpoint), relative(output_dir)))
        return {"episodes": episodes, "successes": s, "success_rate": s / episodes, "success_ci95": [0.0, 1.0],
                "mean_episode_length": 10.0}  # fmt: skip

    monkeypatch.setattr(stages, "held_out", held_out)
    monkeypatch.setattr(
        stages, "record_demos", lambda cfg, ds: calls.append(("record", cfg.task, cfg.seed, ds.parent.name))
    )
    monkeypatch.setattr(stages, "train_imitation", lambda cfg, ds, out, delay=None: calls.append(
        ("train", cfg.task, cfg.seed, out.name, delay == DelayConfig())))  # fmt: skip

    def ppo_run(cfg, out, name, d, latency_aware):
        if (cfg.seed, name) in kill_at:
            kill_at.remove((cfg.seed, name))
            raise KeyboardInterrupt  # the run killed inside this PPO stage
        calls.append(("ppo", cfg.task, cfg.seed, name, d, latency_aware, cfg.env_steps))
        places.append((relative(out / "runs" / name), relative(out)))
        return out / "runs" / name, {}

    kill_at = []
    monkeypatch.setattr(stages, "ppo_run", ppo_run)
    calls.places, calls.kill_at = places, kill_at
    return calls


def test_the_baselines_choose_the_smallest_delay_that_hurts_both_and_nothing_more_runs(fake_stages, tmp_path):
    cfg = BenchDelayCalibrationConfig(output_dir=str(tmp_path / "cal"))
    report = bench_delay_calibration(cfg)
    assert report["chosen"] == {
        "task": "track_reverse",
        "delay": 6,
        "seeds": [0, 1],
        "episodes": 200,
        "eval_seed": 9000,
    }
    evals = [c for c in fake_stages if c[0] == "eval"]
    assert all(c[5:] == (200, 9000, "latest") for c in evals)  # 200 episodes from seed 9000, latest merging
    assert [c[2:5] for c in evals] == (
        [(s, "plain", d) for s in (0, 1) for d in (0, 2, 4, 6, 8, 10)]
        + [(0, "standard", 0), (1, "standard", 0), (0, "naive", 4), (1, "naive", 4), (0, "naive", 6), (1, "naive", 6)]
    )  # fmt: skip
    ppo = [c[2:] for c in fake_stages if c[0] == "ppo"]
    assert ppo == [(0, "standard_d0", 0, False, 36000), (1, "standard_d0", 0, False, 36000),
                   (0, "naive_d4", 4, False, 36000), (1, "naive_d4", 4, False, 36000),
                   (0, "naive_d6", 6, False, 36000), (1, "naive_d6", 6, False, 36000)]  # fmt: skip
    assert {c[1] for c in fake_stages} == {"track_reverse"}
    # Each benchmark's own recording and a policy with no delay augmentation.
    assert [c for c in fake_stages if c[0] in ("record", "train") and c[2] == 0] == [
        ("record", "track_reverse", 0, "delay"), ("train", "track_reverse", 0, "plain", True),
        ("record", "track_reverse", 0, "latency_rl"), ("train", "track_reverse", 0, "imitation", True),
    ]  # fmt: skip
    decision = report["tasks"]["track_reverse"]
    assert decision["imitation_qualifying"] == [4, 6, 8, 10]
    assert decision["naive_over_standard"] == {"4": pytest.approx(200 / 300), "6": pytest.approx(180 / 300)}
    # Each cell read from, and each PPO run written to, the folders the arms' runs resume.
    seed0 = [place for place, call in zip(fake_stages.places, [c for c in fake_stages if c[0] in ("eval", "ppo")])
             if call[2] == 0]  # fmt: skip
    delay, latency = "track_reverse/seed0/delay", "track_reverse/seed0/latency_rl"
    assert seed0 == (
        [(f"{delay}/plain", f"{delay}/eval/plain/latest/d{d}") for d in (0, 2, 4, 6, 8, 10)]
        + [(f"{latency}/runs/standard_d0", latency), (f"{latency}/runs/standard_d0", f"{latency}/eval/standard/d0")]
        + [(f"{latency}/runs/naive_d{d}", where) for d in (4, 6)
           for where in (latency, f"{latency}/eval/naive/d{d}")]
    )  # fmt: skip
    lines = format_summary(report).splitlines()
    assert FINAL_LINE.match(lines[-1]).groups() == ("track_reverse", "6", "27.5", "0.600")
    plain_2 = next(line for line in lines if line.split()[:3] == ["track_reverse", "plain", "2"])
    assert plain_2.split()[3:6] == ["0.550", "0.495", "0.522"]  # 110/200, 99/200, 209/400
    arms = [line.strip() for line in lines if line.startswith("  vla-rl bench")]
    assert len(arms) == 4 and arms[0].startswith("vla-rl bench delay --task=track_reverse --seed=0 --delays='[0,6]'")
    assert (
        "--episodes=200 --eval_seed=9000" in arms[0]
        and f"--calibration={tmp_path / 'cal' / 'calibration.json'}" in arms[0]
    )

    fake_stages.clear()  # a second run: every cell and run kept, nothing evaluated or trained again
    again = bench_delay_calibration(cfg)
    assert again["chosen"] == report["chosen"] and [c[0] for c in fake_stages if c[0] in ("eval", "ppo")] == []


def _first_two_tasks_fail(monkeypatch) -> None:
    monkeypatch.setitem(COUNTS, ("track_reverse", "plain", 0), (60, 59))  # 119/400 < 0.3: no RL stage on it
    for d in (0, 2, 4, 6, 8, 10):  # push_impulse loses 19/400 = 0.0475 at every delay
        monkeypatch.setitem(COUNTS, ("push_impulse", "plain", d), (150, 150) if d == 0 else (140, 141))


def test_a_task_with_no_room_passes_to_the_next_and_no_choice_refuses_the_arms(fake_stages, tmp_path, monkeypatch):
    _first_two_tasks_fail(monkeypatch)
    for d in (0, 2, 4, 6, 8, 10):  # track_jump: plain(0) 100/400 < 0.3, too little room too
        monkeypatch.setitem(COUNTS, ("track_jump", "plain", d), (50, 50))
    report = bench_delay_calibration(BenchDelayCalibrationConfig(output_dir=str(tmp_path / "cal")))
    assert report["chosen"] is None
    assert "too little room" in report["tasks"]["track_reverse"]["outcome"]
    assert "no candidate delay" in report["tasks"]["push_impulse"]["outcome"]
    assert "too little room" in report["tasks"]["track_jump"]["outcome"]
    # No RL stage on any: track_reverse and track_jump have too little room, and on push_impulse no delay
    # passes the imitation rule, so its no-delay RL could not change the choice (the 2026-12-05 amendment).
    assert [c for c in fake_stages if c[0] == "ppo"] == []
    assert "standard_zero" not in report["tasks"]["push_impulse"]
    assert FINAL_LINE.match(format_summary(report).splitlines()[-1]).groups() == ("none",) * 4
    arm = benchmark_configs("track_reverse", 0, tmp_path / "cal", quick=False)[0]
    with pytest.raises(ValueError, match="chose no task and delay"):
        check_calibration(str(tmp_path / "cal" / "calibration.json"), "delay", arm)


def test_the_third_task_is_calibrated_when_the_first_two_do_not_qualify(fake_stages, tmp_path, monkeypatch):
    """track_jump (the second 2026-12-05 amendment): pooled plain(0) 200/400; the losses at d = 2, 4 are
    20/400 and 80/400 = 0.2 exactly, so 4 is the first that passes; standard(0) 300/400, naive(4) 160/400
    <= 0.45: D = 4, in track_jump's own folders."""
    _first_two_tasks_fail(monkeypatch)
    for d, counts in {0: (100, 100), 2: (90, 90), 4: (60, 60), 6: (50, 50), 8: (40, 40), 10: (30, 30)}.items():
        monkeypatch.setitem(COUNTS, ("track_jump", "plain", d), counts)
    monkeypatch.setitem(COUNTS, ("track_jump", "standard", 0), (150, 150))
    monkeypatch.setitem(COUNTS, ("track_jump", "naive", 4), (80, 80))
    report = bench_delay_calibration(BenchDelayCalibrationConfig(output_dir=str(tmp_path / "cal")))
    assert report["chosen"] == {"task": "track_jump", "delay": 4, "seeds": [0, 1], "episodes": 200, "eval_seed": 9000}
    assert report["tasks"]["track_jump"]["imitation_qualifying"] == [4, 6, 8, 10]
    ppo = [c[1:5] for c in fake_stages if c[0] == "ppo"]
    assert ppo == [("track_jump", 0, "standard_d0", 0), ("track_jump", 1, "standard_d0", 0),
                   ("track_jump", 0, "naive_d4", 4), ("track_jump", 1, "naive_d4", 4)]  # fmt: skip
    assert {place for place, _ in fake_stages.places if "naive" in place} == {
        "track_jump/seed0/latency_rl/runs/naive_d4", "track_jump/seed1/latency_rl/runs/naive_d4"}  # fmt: skip
    assert FINAL_LINE.match(format_summary(report).splitlines()[-1]).groups() == ("track_jump", "4", "20.0", "0.533")


def test_plain_at_exactly_three_tenths_goes_on_to_the_rl_stage(fake_stages, tmp_path, monkeypatch):
    monkeypatch.setitem(COUNTS, ("track_reverse", "plain", 0), (60, 60))  # 120/400 = 0.3: room enough
    monkeypatch.setitem(COUNTS, ("track_reverse", "plain", 2), (20, 20))  # 0.3 - 40/400 = 0.2 exactly: passes
    monkeypatch.setitem(COUNTS, ("track_reverse", "naive", 2), (90, 90))  # 180/400 = 0.6 x 300/400: passes
    report = bench_delay_calibration(BenchDelayCalibrationConfig(output_dir=str(tmp_path / "cal")))
    decision = report["tasks"]["track_reverse"]
    assert decision["imitation_qualifying"] == [2]  # 4..10 lose at most 0.3 - 0.225 = 0.075
    assert decision["standard_zero"] == 0.75  # the no-delay RL stage ran: 300/400
    assert report["chosen"]["task"] == "track_reverse" and report["chosen"]["delay"] == 2


def test_a_killed_calibration_resumes_only_what_it_had_not_finished(fake_stages, tmp_path):
    cfg = BenchDelayCalibrationConfig(output_dir=str(tmp_path / "cal"))
    fake_stages.kill_at.append((1, "naive_d6"))
    with pytest.raises(KeyboardInterrupt):
        bench_delay_calibration(cfg)
    saved = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert not saved["finished"] and len(saved["cells"]) == 12 + 2 + 2 + 1  # plain, standard, naive d4, seed 0's d6
    arm = benchmark_configs("track_reverse", 0, tmp_path / "cal", quick=False)[0]
    with pytest.raises(ValueError, match="has not finished; rerun"):
        check_calibration(str(tmp_path / "cal" / "calibration.json"), "delay", arm)
    fake_stages.clear()
    report = bench_delay_calibration(cfg)
    assert [c[:5] for c in fake_stages if c[0] in ("eval", "ppo")] == [
        ("ppo", "track_reverse", 1, "naive_d6", 6), ("eval", "track_reverse", 1, "naive", 6)]  # fmt: skip
    assert report["finished"] and report["chosen"]["delay"] == 6


def test_a_quick_calibration_never_calibrates_an_arm(fake_stages, tmp_path, monkeypatch):
    monkeypatch.setitem(COUNTS, ("track_reverse", "naive", 2), (0, 0))  # the quick rule passes d = 2
    bench_delay_calibration(BenchDelayCalibrationConfig(output_dir=str(tmp_path / "cal"), quick=True))
    arm = benchmark_configs("track_reverse", 0, tmp_path / "cal" / "quick", quick=True)[0]
    with pytest.raises(ValueError, match="is a --quick calibration"):
        check_calibration(str(tmp_path / "cal" / "quick" / "calibration.json"), "delay", arm)


def arm_configs(out: Path, seed: int = 0):
    delay, latency = benchmark_configs("track_reverse", seed, out, quick=False)
    delay.delays, delay.merges, latency.delays = [0, 6], ["latest", "ensemble", "rtc"], [0, 6]
    return delay, latency


def test_the_arms_run_only_as_calibrated_and_under_the_same_protocol_text(fake_stages, tmp_path):
    out = tmp_path / "cal"
    bench_delay_calibration(BenchDelayCalibrationConfig(output_dir=str(out)))
    file = str(out / "calibration.json")
    delay, latency = arm_configs(out)
    recorded = check_calibration(file, "delay", delay)
    assert recorded["protocol_sha256"] == json.loads((out / "calibration.json").read_text())["protocol_sha256"]
    assert len(recorded["protocol_sha256"]) == 64 and check_calibration(file, "latency_rl", latency)["delay"] == 6
    for bench, name, value, needed in [
        ("delay", "delays", [0, 8], "run the arms with --delays='[0,6]'"),
        ("delay", "episodes", 100, "--episodes=200"),
        ("latency_rl", "eval_seed", 7000, "--eval_seed=9000"),
        ("latency_rl", "latency_warmup_steps", 500, "--latency_warmup_steps=1000"),
        ("latency_rl", "output_dir", str(tmp_path / "elsewhere"),
         f"--output_dir={out / 'track_reverse' / 'seed0' / 'latency_rl'}"),
    ]:  # fmt: skip
        arm = arm_configs(out)[bench == "latency_rl"]
        setattr(arm, name, value)
        with pytest.raises(ValueError, match=re.escape(needed)):
            check_calibration(file, bench, arm)
    with pytest.raises(ValueError, match="not a calibrated seed"):
        check_calibration(file, "delay", arm_configs(out, seed=2)[0])
    # bench delay refuses before any stage runs
    fake_stages.clear()
    wrong = arm_configs(out)[0]
    wrong.delays, wrong.calibration = [0, 4], file
    with pytest.raises(ValueError, match=re.escape("--delays='[0,6]'")):
        bench_delay(wrong)
    wrong = arm_configs(out)[1]
    wrong.env_steps, wrong.calibration = 50_000, file
    with pytest.raises(ValueError, match="--env_steps=36000"):
        bench_latency_rl(wrong)
    assert fake_stages == []
    quick = arm_configs(out)[0]
    quick.quick = True
    with pytest.raises(ValueError, match="does not take --quick"):
        check_calibration(file, "delay", quick)
    # An arm result of this folder under another protocol text (an edit made after it, then a new calibration)
    earlier = Path(delay.output_dir) / "delay.json"
    earlier.parent.mkdir(parents=True, exist_ok=True)
    earlier.write_text(json.dumps({"calibration": None}))  # a run without --calibration: no objection
    check_calibration(file, "delay", delay)
    earlier.write_text(json.dumps({"calibration": {"protocol_sha256": "0" * 64}}))
    with pytest.raises(ValueError, match="another text"):
        check_calibration(file, "delay", delay)
    # The protocol edited after the calibration: every arm refused, and the calibration will not resume.
    bench_stages.PROTOCOL.write_text(bench_stages.PROTOCOL.read_text() + "\nan edit\n")
    with pytest.raises(ValueError, match="changed after the calibration"):
        check_calibration(file, "delay", delay)
    with pytest.raises(ValueError, match="new --output_dir"):
        bench_delay_calibration(BenchDelayCalibrationConfig(output_dir=str(out)))


def test_an_appended_amendment_keeps_the_cells_and_an_edit_above_it_does_not(fake_stages, tmp_path):
    cfg = BenchDelayCalibrationConfig(output_dir=str(tmp_path / "cal"))
    fake_stages.kill_at.append((0, "standard_d0"))
    with pytest.raises(KeyboardInterrupt):
        bench_delay_calibration(cfg)
    first = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert len(first["cells"]) == 12 and first["protocol_history"] == [first["protocol_sha256"]]
    original = bench_stages.PROTOCOL.read_text()
    amended = original + "\n### 2099-01-01: an amendment\n\nAppended below every earlier word.\n"
    bench_stages.PROTOCOL.write_text(amended)
    fake_stages.clear()
    report = bench_delay_calibration(cfg)  # resumes: no plain cell evaluated again
    assert [c for c in fake_stages if c[0] == "eval" and c[3] == "plain"] == []
    assert report["chosen"]["delay"] == 6
    now = hashlib.sha256(amended.encode()).hexdigest()
    assert report["protocol_history"] == [first["protocol_sha256"], now] and report["protocol_sha256"] == now
    # The same amendment below a changed word of the text the cells were measured under: refused.
    bench_stages.PROTOCOL.write_text(amended.replace("Episodes per cell: 200", "Episodes per cell: 100"))
    (tmp_path / "cal" / "calibration.json").write_text(json.dumps(first))
    with pytest.raises(ValueError, match="other than by an amendment"):
        bench_delay_calibration(cfg)


@pytest.mark.slow  # every real stage at toy sizes: about four minutes on 2 cores
def test_quick_calibration_runs_each_real_stage_once(tmp_path):
    report = bench_delay_calibration(BenchDelayCalibrationConfig(output_dir=str(tmp_path), quick=True))
    assert report["chosen"]["task"] == "track_reverse" and report["chosen"]["delay"] == 2  # the quick rule passes all
    cells = report["cells"]
    assert sorted(cells) == sorted(
        [f"track_reverse/seed{s}/plain/d{d}" for s in (0, 1) for d in (0, 2, 4, 6, 8, 10)]
        + [f"track_reverse/seed{s}/{arm}/d{d}" for s in (0, 1) for arm, d in (("standard", 0), ("naive", 2))]
    )  # fmt: skip
    assert all(c["episodes"] == 4 and 0 <= c["successes"] <= 4 for c in cells.values())
    for s in (0, 1):
        latency = tmp_path / "quick" / "track_reverse" / f"seed{s}" / "latency_rl"
        assert (latency / "runs" / "naive_d2" / "checkpoints" / "last").exists()
        assert (tmp_path / "quick" / "track_reverse" / f"seed{s}" / "delay" / "plain" / "checkpoints").is_dir()
    assert FINAL_LINE.match(format_summary(report).splitlines()[-1])
