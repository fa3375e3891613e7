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
        _cell("standard", 0, 0.80), _cell("naive", 0, 0.80), _cell("latency_aware", 0, 0.80),
        _cell("naive", 3, 0.60), _cell("latency_aware", 3, 0.70),
        _cell("naive", 6, 0.40), _cell("latency_aware", 6, 0.60), _cell("training_rtc", 6, 0.50),
    ]  # fmt: skip
    s = summarize(cells, 6)
    assert s["latency_aware_over_naive"] == pytest.approx(0.60 / 0.40)
    assert s["latency_aware_over_nodelay"] == pytest.approx(0.60 / 0.80)
    never = summarize([*cells[:-3], _cell("naive", 6, 0.0), _cell("latency_aware", 6, 0.3)], 6)
    assert math.isinf(never["latency_aware_over_naive"])  # over zero: printed as inf, it means nothing


@pytest.mark.slow  # every arm at toy sizes, 30 s: -m slow
def test_quick_benchmark_runs_every_arm_and_prints_the_final_line(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "latency_rl.py"), "--quick=true", f"--output_dir={out}"],
        check=False, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.match(r"^latency_aware_over_naive=(\d+\.\d{3}|inf) latency_aware_over_nodelay=(\d+\.\d{3}|inf)$", last)
    report = json.loads((out / "quick" / "latency_rl.json").read_text())
    cells = {(c["arm"], c["delay"]) for c in report["cells"]}
    arms = ("imitation", "naive", "latency_aware", "training_rtc")
    assert cells == {(a, d) for a in arms for d in (0, 3)} | {("standard", 0), ("warmup_only", 3)}
    assert all(c["episodes"] == 4 for c in report["cells"])
    runs = report["runs"]
    assert set(runs) == {"standard_d0", "naive_d3", "latency_aware_d3"}
    assert runs["latency_aware_d3"]["latency_aware"] and not runs["naive_d3"]["latency_aware"]
    assert all(run["env_steps"] >= 150 for run in runs.values())  # the budget was spent, then the run stopped
    aware = json.loads((out / "quick" / "runs" / "latency_aware_d3" / "checkpoints" / "last" / "pretrained_model"
                        / "config.json").read_text())  # fmt: skip
    assert (aware["latency_aware"], aware["latency_max_delay"], aware["mid_cameras"]) == (True, 3, ["front"])
    # the warm-up only arm is the aware run's starting point: its head fitted on the demonstrations, no RL
    warm = next(c for c in report["cells"] if c["arm"] == "warmup_only")
    assert Path(warm["checkpoint"]) == (out / "quick" / "runs" / "latency_aware_d3" / "latency_warmup").resolve()
    warm_meta = json.loads((Path(warm["checkpoint"]) / "last" / "metadata.json").read_text())["latency_warmup"]
    assert warm_meta["steps"] == 10 and warm_meta["dataset"] == str(out / "quick" / "dataset")
    assert (out / "quick" / "latency_rl.png").stat().st_size > 0
