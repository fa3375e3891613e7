"""`vla-rl bench delay-beyond`: the clamp's cost and the paired test on robot records written by hand, its refusals,
and (slow) the whole benchmark at toy sizes over ROS 2."""

import json

import pytest

from vla_rl.bench_delay_beyond import BenchDelayBeyondConfig, arm_result, final_line, summarize


def robot_run(folder, successes: list[bool], lags: list[int], clamped: int, chunks: int) -> dict:
    folder.mkdir(parents=True)
    log = [{"lag_steps": lag, "merged": True} for lag in lags] + [{"lag_steps": 99, "merged": False}]
    (folder / "latencies.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return {"episodes": [{"episode": e, "success": s} for e, s in enumerate(successes)],
            "serve_summary": {"delay_clamped": str(clamped), "chunks": str(chunks)}}  # fmt: skip


def test_the_clamp_costs_the_matched_arms_success_minus_the_trained_arms_on_paired_episodes(tmp_path):
    """10 episodes: the trained arm succeeds in 3 (0-2), the matched arm in 7 (0-6). Cost 40 points; the 4 discordant
    pairs all go the matched arm's way: p = 2 * P(Bin(4, 1/2) <= 0) = 0.125. The trained arm's serve clamped 12 of
    16 chunks: 0.75; an unmerged chunk's lag is not a delay met."""
    trained = robot_run(tmp_path / "t", [e < 3 for e in range(10)], [9, 9, 10, 9], clamped=12, chunks=16)
    matched = robot_run(tmp_path / "m", [e < 7 for e in range(10)], [9, 9, 9], clamped=0, chunks=16)
    arms = {"trained": arm_result(tmp_path / "t", trained, 6), "matched": arm_result(tmp_path / "m", matched, 9)}
    assert arms["trained"]["lag_histogram"] == {"9": 3, "10": 1} and arms["matched"]["lag_histogram"] == {"9": 3}
    assert arms["trained"]["success_ci95"][0] == pytest.approx(0.1078, abs=1e-4)  # Wilson, 3 of 10
    s = summarize(trained["episodes"], matched["episodes"], arms)
    assert s["clamp_cost_points"] == pytest.approx(40.0) and s["mcnemar_p"] == pytest.approx(0.125)
    assert (s["only_trained_succeeded"], s["only_matched_succeeded"], s["clamped_fraction"]) == (0, 4, 0.75)
    assert final_line(s) == (
        "clamp_cost_points=40.0 trained_success=0.300 matched_success=0.700 clamped_fraction=0.750 episodes=10"
    )
    # A serve summary without its counters (serve's JSON not captured) is refused, not read as no clamp.
    with pytest.raises(RuntimeError, match="has no chunk counts"):
        arm_result(tmp_path / "t", {**trained, "serve_summary": {"exit_code": 0}}, 6)


def test_the_robot_delay_is_1_5x_the_trained_one_and_a_chunk_that_cannot_hold_it_is_refused():
    cfg = BenchDelayBeyondConfig(delay=5)
    assert cfg.beyond == 8 and cfg.latency_s() == pytest.approx(7.25 / 20)  # ceil(7.5); 0.75 of a period below
    with pytest.raises(ValueError, match=r"a delay of 12 \(1.5 x --delay=8\) plus 4 executed steps: pass --horizon=16"):
        BenchDelayBeyondConfig(delay=8, horizon=15).validate()


@pytest.mark.slow
def test_quick_run_serves_both_policies_to_the_sim_robot_and_the_trained_one_is_clamped(tmp_path):
    """Toy sizes (D = 2, the robot at 3 steps, 4 episodes per arm): both arms ran on the robot with the added
    latency slept (112.5 ms: most chunks 3 steps late; where the tick's phase falls, some 2), the policy trained for
    2 steps was told 2 for every longer delay it met (serve's counter), and
    the final line reads the report."""
    from vla_rl.bench_delay_beyond import bench_delay_beyond, format_summary

    report = bench_delay_beyond(BenchDelayBeyondConfig(quick=True, output_dir=str(tmp_path), domain_id=72))
    t, m = report["arms"]["trained"], report["arms"]["matched"]
    assert (t["trained_for"], m["trained_for"], report["beyond"]) == (2, 3, 3) and report["summary"]["episodes"] == 4
    longer = sum(n for lag, n in t["lag_histogram"].items() if int(lag) > 2)
    assert longer > 0 and t["delay_clamped"] == longer  # every merged chunk later than 2 steps was clamped
    assert max(int(lag) for lag in m["lag_histogram"]) >= 3  # the matched arm met the robot's longer delays too
    assert json.loads((tmp_path / "quick" / "delay_beyond.json").read_text())["summary"] == report["summary"]
    assert format_summary(report).splitlines()[-1] == final_line(report["summary"])
