"""`vla-rl bench render-soak`: the soak's loop end to end, its resume, and how a segment's end is counted."""

import json

import pytest

from vla_rl.bench_render_soak import BenchRenderSoakConfig, _absorb, bench_render_soak, format_summary


def test_a_segment_that_died_by_a_crash_signal_is_a_native_crash_and_its_frames_count():
    """Segment 0 ended by itself (exit 0) after 500 frames, segment 1 died by SIGSEGV (-11) after 200 saved,
    segment 2 by SIGKILL (-9, the out-of-memory killer: no crash of the renderer) after 100, a segment cut with the
    soak (None: found on resume) after 50: 850 frames, one native crash."""
    state = {"frames": 0, "native_crashes": 0, "worker_restarts": 0, "segments": []}
    _absorb(state, {"frames": 500, "worker_restarts": 1}, 0)
    _absorb(state, {"frames": 200, "worker_restarts": 0}, -11)
    _absorb(state, {"frames": 100}, -9)
    _absorb(state, {"frames": 50}, None)
    assert (state["frames"], state["native_crashes"], state["worker_restarts"]) == (850, 1, 1)
    assert [s["native_crash"] for s in state["segments"]] == [False, True, False, False]


def test_a_quick_soak_renders_its_frames_and_a_second_run_resumes_without_rendering_more(tmp_path):
    """The quick soak in render worker processes: at least its 1,000 frames, no crash; run again, it reads its
    totals back and runs no segment; other settings in the same folder are refused, naming the file."""
    cfg = BenchRenderSoakConfig(quick=True, output_dir=str(tmp_path))
    report = bench_render_soak(cfg)
    assert report["frames"] >= 1000 and report["native_crashes"] == 0 and report["render_isolation"] == "process"
    assert all(s["returncode"] == 0 for s in report["segments"])
    again = bench_render_soak(cfg)
    assert again["frames"] == report["frames"] and len(again["segments"]) == len(report["segments"])
    line = format_summary(again)
    assert (
        line.startswith(f"native_crashes=0 frames={report['frames']} minutes=") and "render_isolation=process" in line
    )
    saved = json.loads((tmp_path / "process" / "soak.json").read_text())
    assert saved["frames"] == report["frames"]
    with pytest.raises(ValueError, match=r"soak.json is a soak of other settings"):
        bench_render_soak(BenchRenderSoakConfig(quick=True, output_dir=str(tmp_path), seed=1))
