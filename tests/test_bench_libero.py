"""`vla-rl bench libero`: the step-by-step comparison, by hand; the quick run end to end (slow)."""

import pytest
import torch

from vla_rl.bench_libero import compare, digest


def _run(hashes: list[list[str]], successes: list[list[bool]], lengths: list[int]) -> dict:
    return {"steps": [{"obs": h, "success": s} for h, s in zip(hashes, successes, strict=True)],
            "lengths": lengths, "successes": [any(s[w] for s in successes) for w in range(len(lengths))]}  # fmt: skip


def test_steps_are_compared_up_to_the_first_end_and_differences_counted():
    """Two worlds. World 0: both runs end at step 2, observations equal throughout: 3 equal steps (0, 1, 2).
    World 1: ours ends at 3, theirs at 2 (a success one step earlier), observation 2 differs: steps 0..2
    compared, 2 equal. 6 compared, 5 equal; world 1's episode differs, its first difference at step 2."""
    ours = _run([["a", "x"], ["b", "y"], ["c", "z"], ["d", "w"]],
                [[False, False], [False, False], [False, False], [False, False]], [2, 3])  # fmt: skip
    theirs = _run([["a", "x"], ["b", "y"], ["c", "Z"]], [[False, False], [False, False], [False, True]], [2, 2])
    result = compare(ours, theirs, 2)
    assert (result["compared_steps"], result["equal_steps"]) == (6, 5)
    assert (result["episodes"], result["same_episodes"]) == (2, 1)
    assert result["first_difference"] == [{"world": 1, "step": 2}]


def test_the_digest_reads_both_cameras_and_the_state_of_one_world():
    obs = {"observation.images.image": torch.zeros(2, 3, 4, 4), "observation.images.image2": torch.zeros(2, 3, 4, 4),
           "observation.state": torch.zeros(2, 8)}  # fmt: skip
    base = digest(obs, 0)
    assert digest(obs, 1) == base
    obs["observation.images.image2"][1, 0, 0, 0] = 1e-6
    assert digest(obs, 1) != base and digest(obs, 0) == base


@pytest.mark.slow
def test_the_quick_bench_compares_one_world_of_one_task(tmp_path):
    """One world of libero_spatial/0 in both evaluators, LeRobot's step limit: every step compared, and every
    one equal (as measured: 281 of 281)."""
    from vla_rl.bench_libero import BenchLiberoConfig, bench_libero

    report = bench_libero(BenchLiberoConfig(quick=True, output_dir=str(tmp_path)))
    (task,) = report["tasks"]
    assert task["compared_steps"] == min(task["ours"]["lengths"][0], task["lerobot"]["lengths"][0]) + 1
    assert report["state_agreement"] == 1.0 and report["outcome_agreement"] == 1.0
    assert task["ours"]["env_steps"] == task["lerobot"]["env_steps"] and report["throughput_ratio"] > 0
