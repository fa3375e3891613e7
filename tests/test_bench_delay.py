"""`vla-rl bench delay`: how the headline is read from the cells, and the --quick run end to end."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vla_rl.bench_delay import summarize

ROOT = Path(__file__).resolve().parents[1]
FINAL_LINE = re.compile(
    r"^augmented_over_plain=(\S+) augmented_at_zero_delay=(\d\.\d{3}) plain_at_zero_delay=(\d\.\d{3})$"
)


def cells(rates: dict[tuple[str, str, int], float]) -> list[dict]:
    return [
        {"policy": p, "merge": m, "delay": d, "success_rate": r, "success_ci95": [max(0.0, r - 0.1), min(1.0, r + 0.1)]}
        for (p, m, d), r in rates.items()
    ]


def test_the_headline_compares_each_policys_best_merge_at_the_largest_delay():
    rates = {
        ("plain", "latest", 0): 0.9, ("plain", "ensemble", 0): 0.8, ("plain", "latest", 8): 0.3,
        ("plain", "ensemble", 8): 0.4, ("augmented", "latest", 0): 0.85, ("augmented", "ensemble", 0): 0.6,
        ("augmented", "latest", 8): 0.7, ("augmented", "ensemble", 8): 0.5,
    }  # fmt: skip
    s = summarize(cells(rates), largest=8, zero=0)
    # Best at d=8: plain ensemble (0.4), augmented latest (0.7): 0.7 / 0.4 = 1.75.
    assert (s["plain"]["best_merge"], s["augmented"]["best_merge"]) == ("ensemble", "latest")
    assert s["augmented_over_plain"] == pytest.approx(1.75)
    # Zero delay with those merges: plain ensemble 0.8, augmented latest 0.85.
    assert (s["plain"]["at_zero_delay"], s["augmented"]["at_zero_delay"]) == (0.8, 0.85)
    assert s["zero_delay_loss_within_interval"]  # 0.85 >= 0.8 - 0.1
    rates[("augmented", "latest", 0)] = 0.65  # below plain's interval [0.7, 0.9]
    assert not summarize(cells(rates), largest=8, zero=0)["zero_delay_loss_within_interval"]


def test_a_plain_policy_that_never_succeeds_makes_the_ratio_meaningless():
    rates = {("plain", "latest", 0): 0.5, ("plain", "latest", 4): 0.0, ("augmented", "latest", 0): 0.5,
             ("augmented", "latest", 4): 0.2}  # fmt: skip
    assert math.isinf(summarize(cells(rates), largest=4, zero=0)["augmented_over_plain"])


@pytest.mark.slow  # trains and fine-tunes end to end: about 30 s
def test_quick_run_trains_both_policies_and_fills_every_cell(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "delay_robustness.py"), "--quick=true", f"--output_dir={out}"],
        check=False, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert FINAL_LINE.match(last), last
    report = json.loads((out / "quick" / "delay.json").read_text())
    # 2 policies x 3 merges x delays {0, 4}, 4 episodes each.
    keys = {(c["policy"], c["merge"], c["delay"]) for c in report["cells"]}
    assert keys == {(p, m, d) for p in ("plain", "augmented") for m in ("latest", "ensemble", "rtc") for d in (0, 4)}
    assert all(c["episodes"] == 4 for c in report["cells"])
    assert (out / "quick" / "delay.png").stat().st_size > 0
    # The two policies differ only in the delay augmentation: the augmented one trained for delays up to 4.
    configs = {
        name: json.loads(
            next((out / "quick" / name).glob("checkpoints/step-*/pretrained_model/config.json")).read_text()
        )
        for name in ("plain", "augmented")
    }
    assert configs["plain"]["max_delay_steps"] == 0 and configs["augmented"]["max_delay_steps"] == 4
    assert {k: v for k, v in configs["plain"].items() if k != "max_delay_steps"} == {
        k: v for k, v in configs["augmented"].items() if k != "max_delay_steps"
    }
    # Each cell's evaluation ran at its delay: every chunk of a d=4 cell got 4 steps.
    evaluation = json.loads((out / "quick" / "eval" / "augmented" / "rtc" / "d4" / "eval.json").read_text())
    assert set(evaluation["delay_histogram"]) == {"4"}
