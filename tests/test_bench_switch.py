"""`vla-rl bench switch`: how cells, pooling and the final line are read, and the --quick run end to end."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vla_rl.bench_switch import _cell, _pool, format_summary, summarize

ROOT = Path(__file__).resolve().parents[1]
FINAL_LINE = re.compile(
    r"^replan_success=(\d\.\d{3}) next_chunk_success=(\d\.\d{3}) replan_over_next_chunk=(\S+) "
    r"median_reaction_replan=(\S+) median_reaction_next_chunk=(\S+) episodes=(\d+)$"
)


def test_a_cell_counts_switches_and_reactions_and_pooling_sums_the_seeds():
    # (success, switch step or -1, reaction or -1): 3 of 5 won, 4 switched (2 won), 3 reacted in 8, 8 and 12 steps
    one = _cell([(True, -1, -1), (True, 10, 8), (False, 12, 8), (True, 9, 12), (False, 15, -1)])
    assert (one["successes"], one["episodes"], one["switched"], one["switched_successes"]) == (3, 5, 4, 2)
    assert one["reactions"] == [8, 8, 12] and one["median_reaction_steps"] == 8.0
    assert one["reaction_steps_quartiles"] == [8.0, 8.0, 10.0]
    other = _cell([(False, 11, 9), (True, -1, -1)])
    pooled = _pool([one, other])
    assert (pooled["successes"], pooled["episodes"], pooled["switched"], pooled["switched_successes"]) == (4, 7, 5, 2)
    assert pooled["reactions"] == [8, 8, 9, 12] and pooled["median_reaction_steps"] == 8.5
    assert pooled["success_rate"] == pytest.approx(4 / 7)


def test_the_final_line_gives_the_ratio_and_both_medians():
    arms = {"replan": _cell([(True, 5, 8), (True, 6, 8), (False, 7, 9), (True, -1, -1)]),
            "next_chunk": _cell([(True, 5, 12), (False, 6, 11), (False, 7, -1), (True, -1, -1)])}  # fmt: skip
    s = summarize(arms)
    assert (s["replan_success"], s["next_chunk_success"], s["replan_over_next_chunk"]) == (0.75, 0.5, 1.5)
    assert (s["median_reaction_replan"], s["median_reaction_next_chunk"]) == (8.0, 11.5)
    line = format_summary({"arms": arms, "bound": arms, "summary": s}).splitlines()[-1]
    assert line == ("replan_success=0.750 next_chunk_success=0.500 replan_over_next_chunk=1.500 "
                    "median_reaction_replan=8.0 median_reaction_next_chunk=11.5 episodes=4")  # fmt: skip


def test_bad_settings_are_refused_in_one_line():
    from vla_rl.bench_switch import BenchSwitchConfig

    with pytest.raises(ValueError, match="--delay must be in"):
        BenchSwitchConfig(delay=16).validate()
    with pytest.raises(ValueError, match="--train_lengths must be increasing"):
        BenchSwitchConfig(train_lengths=[8000, 4000]).validate()


def quick_run(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "instruction_switch.py"), "--quick=true", "--num_threads=1",
         f"--output_dir={out}"],
        check=False, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.slow  # records, trains, evaluates both arms and the bound end to end: about 2 minutes
def test_quick_run_fills_both_arms_and_the_bound_and_prints_the_final_line(tmp_path):
    out = tmp_path / "bench"
    proc = quick_run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert FINAL_LINE.match(proc.stdout.strip().splitlines()[-1]), proc.stdout[-500:]
    report = json.loads((out / "quick" / "switch.json").read_text())
    assert set(report["arms"]) == set(report["bound"]) == {"replan", "next_chunk"}
    assert all(c["episodes"] == 4 for c in [*report["arms"].values(), *report["bound"].values()])
    assert report["train_steps"] == 10 and report["pilots"][0]["train_steps"] == 10
    # both arms ran the chosen checkpoint at the protocol's delay, each under its rule
    for rule in ("replan", "next_chunk"):
        evaluation = json.loads((out / "quick" / "eval" / rule / "eval.json").read_text())
        assert evaluation["config"]["chunking"]["on_new_instruction"] == rule
        assert set(evaluation["delay_histogram"]) == {"8"} and "/imitation_10/" in evaluation["checkpoint"]
    # resumed: the finished stages and arms are read back (the arms' evaluations are not run again)
    stamp = (out / "quick" / "eval" / "replan" / "eval.json").stat().st_mtime_ns
    pilot = (out / "quick" / "pilot" / "steps10" / "eval.json").stat().st_mtime_ns
    again = quick_run(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == proc.stdout.strip().splitlines()[-1]
    assert (out / "quick" / "eval" / "replan" / "eval.json").stat().st_mtime_ns == stamp
    assert (out / "quick" / "pilot" / "steps10" / "eval.json").stat().st_mtime_ns == pilot
