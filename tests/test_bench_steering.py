"""`vla-rl bench steering --quick`: every stage at toy sizes, end to end (the plumbing, not the claim); the final
line's figures recomputed here from the cells the JSON holds."""

import json
import re

import pytest
from extras import require

require("torchrl", "steer")

FINAL = re.compile(r"^gated_gain_ood=([+-]\d+\.\d) gated_loss_id=([+-]\d+\.\d) dsrl_gain_ood=([+-]\d+\.\d)$")


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
    assert report["timing"]["base_ms"] > 0 and report["timing"]["gated_over_base"] > 0
    # A second call reads every finished stage and cell back instead of running it again.
    again = bench_steering(BenchSteeringConfig(quick=True, num_threads=1, output_dir=str(tmp_path)))
    assert again["cells"] == report["cells"]
