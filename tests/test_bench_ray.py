"""`vla-rl bench ray`: the throughput window and CPU use worked out by hand from a timeline, the final line,
and (slow) the quick run on a real two-node cluster with a worker killed mid-run."""

import json
import re
import subprocess
import sys

import pytest
from extras import require

from vla_rl.bench_ray import format_summary, throughput

TIMELINE = {
    "nodes": 2, "lost_rollouts": [], "restarts": [{"worker": 0, "at": 12.0, "pid": 9}],
    "interrupted": [{"worker": 0, "launch": 0, "at": 11.0, "error": "x"}],
    "rollouts": [
        {"launch": 1, "worker": 1, "pid": 8, "version": 0, "used": True, "env_steps": 100, "started": 10.0, "ended": 11.5, "cpu_seconds": 1.0},
        {"launch": 0, "worker": 1, "pid": 8, "version": 0, "used": True, "env_steps": 120, "started": 11.5, "ended": 13.0, "cpu_seconds": 1.5},
        {"launch": 2, "worker": 0, "pid": 9, "version": 0, "used": False, "env_steps": 80, "started": 12.0, "ended": 15.0, "cpu_seconds": 2.0},
    ],
    "updates": [{"version": 0, "started": 13.0, "ended": 14.0}, {"version": 1, "started": 15.0, "ended": 18.0}],
}  # fmt: skip


def test_the_window_runs_from_the_first_rollout_to_the_last_update():
    """Window 18 - 10 = 8 s; 100 + 120 + 80 = 300 executed steps (the dropped rollout's too): 37.5 steps/s.
    CPU: worker 1 2.5 s / 8 = 0.3125 cores, worker 0 2 / 8 = 0.25, the learner 4 / 8 = 0.5."""
    t = throughput(TIMELINE, learner_cpu_seconds=4.0)
    assert (t["window_seconds"], t["executed_env_steps"], t["env_steps_per_s"]) == (8.0, 300, 37.5)
    assert t["cpu_cores"] == {"learner": 0.5, "worker 0 (pid 9)": 0.25, "worker 1 (pid 8)": 0.312}
    assert (t["worker_restarts"], t["interrupted_rollouts"], t["lost_rollouts"], t["dropped_stale_rollouts"]) == (
        1,
        1,
        0,
        1,
    )


def test_the_final_line():
    arm = throughput(TIMELINE, 4.0)
    report = {"config": {"quick": False}, "arms": {"sync": arm, "async": arm}, "async_over_sync": 1.25, "nodes": 2,
              "worker_restarts": 1, "lost_rollouts": 0}  # fmt: skip
    assert format_summary(report).splitlines()[-1] == "async_over_sync=1.250 nodes=2 worker_restarts=1 lost_rollouts=0"


@pytest.mark.slow
def test_the_quick_run_kills_a_worker_on_a_two_node_cluster_and_loses_nothing(tmp_path):
    require("ray", "ray")
    # Its own process, as a user runs it: Ray keeps per-process state (the authentication mode among it)
    # that a test process which already started other Ray instances would carry into this cluster.
    done = subprocess.run([sys.executable, "-m", "vla_rl.cli", "bench", "ray", "--quick=true", f"--output_dir={tmp_path}"],
                          check=False, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "quick" / "ray.json").read_text())
    assert report["nodes"] == 2 and report["cluster_nodes"] == 2 and report["lost_rollouts"] == 0
    arms = report["arms"]
    assert arms["async"]["killed"] is not None and arms["async"]["interrupted_rollouts"] >= 1
    assert report["worker_restarts"] >= 1  # the killed worker came back and was counted (0 was the counting bug's)
    assert all(a["executed_env_steps"] >= 1000 for a in arms.values())
    timeline = json.loads((tmp_path / "quick" / "sync" / "ray_timeline.json").read_text())
    for u in timeline["updates"]:  # synchronous: nothing collected while an update runs
        assert all(r["ended"] <= u["started"] or r["started"] >= u["ended"] for r in timeline["rollouts"])
    assert re.fullmatch(r"async_over_sync=\d+\.\d{3} nodes=2 worker_restarts=[1-9]\d* lost_rollouts=0",
                        done.stdout.strip().splitlines()[-1])  # fmt: skip
