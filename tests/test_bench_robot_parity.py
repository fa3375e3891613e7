"""`vla-rl bench robot-parity`: the pairing and its statistics on records written by hand, and (slow) the whole
benchmark at toy sizes: `vla-rl serve` and `vla-rl sim-robot` over ROS 2, then `vla-rl eval` under the trace."""

import json

import pytest

from vla_rl.bench_robot_parity import explain, final_line, pair_episodes, summarize


def robot_episode(e, success, length=30, state=(0.0, 1.0)):
    return {"episode": e, "success": success, "length": length, "initial_state": list(state)}


def sim_episode(e, success, length=30, requests=6, num_envs=2):
    return {"round": e // num_envs, "world": e % num_envs, "seed": 100 + e // num_envs, "success": success,
            "length": length, "requests": requests}  # fmt: skip


def logged(e, k, latency, lag, merged=True, obs_step=None):
    return {"latency_s": latency, "control_dt": 0.05, "episode": e, "request": k, "obs_step": 5 * k if obs_step is None
            else obs_step, "lag_steps": lag, "merged": merged}  # fmt: skip


def test_pairs_are_made_by_episode_and_say_what_their_timelines_did_differently():
    """Four episodes on 2 worlds. Episode 1: the robot merged request 1 (0.12 s: 3 steps replayed) 4 steps
    after it. Episode 2: its first request came at step 2 and the simulation made 2 requests past the robot's 1.
    Episode 3: its initial state differs. Outcomes: simulation 1/4, robot 2/4; discordant 0 and 1."""
    robot = [robot_episode(0, True), robot_episode(1, True), robot_episode(2, False, length=20),
             robot_episode(3, False, state=(0.0, 2.0))]  # fmt: skip
    sim = [
        sim_episode(2, False, requests=3),
        sim_episode(0, True),
        sim_episode(1, False, requests=3),
        sim_episode(3, False),
    ]
    trace = [logged(0, 0, 0.1, 2), logged(1, 0, 0.1, 2), logged(1, 1, 0.12, 4), logged(1, 2, 0.3, 1, merged=False),
             logged(2, 0, 0.1, 2, obs_step=2)]  # fmt: skip
    pairs = pair_episodes(robot, sim, trace, num_envs=2, sim_initial=[[0.0, 1.0]] * 4)
    assert [(p["episode"], p["eval_world"], p["eval_seed"]) for p in pairs] == [(0, 0, 100), (1, 1, 100), (2, 0, 101),
                                                                               (3, 1, 101)]  # fmt: skip
    assert [p["differs"] for p in pairs] == [False, True, False, False]
    one, two, three = pairs[1]["timing"], pairs[2]["timing"], pairs[3]
    # An unmerged chunk (its episode over) is not a timing difference, whatever its lag.
    assert one["lag_mismatches"] == [{"request": 1, "trace_steps": 3, "robot_lag_steps": 4}]
    assert two["robot_first_request_step"] == 2 and two["robot_requests"] == 1 and two["sim_requests_past_trace"] == 2
    assert not three["same_initial_state"] and pairs[0]["same_initial_state"]
    assert pairs[1]["why"] == ["1 of the robot's chunks arrived at another step than the trace replays"]
    assert explain({**pairs[2], "same_initial_state": False}) == [
        "the initial states differ", "the robot's first request came at step 2, the simulation's at 0",
        ("the simulated episode made 2 requests past the robot's log (it ran longer; they replayed the episode's "
         "last latency)"),
    ]  # fmt: skip

    summary = summarize(pairs)
    assert summary["only_sim_succeeded"] == 0 and summary["only_robot_succeeded"] == 1
    assert summary["mcnemar_p"] == 1.0  # one discordant pair: 2 * P(Bin(1, 1/2) <= 0) = 1
    assert summary["same_initial_states"] == 3 and summary["pairs_with_lag_mismatches"] == 1
    assert final_line(summary) == "sim_success=0.250 ros_success=0.500 gap_points=25.0 episodes=4 mcnemar_p=1.0000"


def test_mcnemar_counts_only_the_discordant_pairs():
    """10 pairs: 6 both succeeded, 4 only in simulation. p = 2 * P(Bin(4, 1/2) <= 0) = 2 / 16 = 0.125."""
    pairs = [{"sim_success": True, "robot_success": i < 6, "same_initial_state": True, "timing": {"lag_mismatches": []}}
             for i in range(10)]  # fmt: skip
    summary = summarize(pairs)
    assert summary["mcnemar_p"] == pytest.approx(0.125) and summary["gap_points"] == pytest.approx(-40.0)
    assert final_line(summary) == "sim_success=1.000 ros_success=0.600 gap_points=-40.0 episodes=10 mcnemar_p=0.1250"


def test_bad_settings_are_refused_in_one_line(tmp_path):
    from vla_rl.bench_robot_parity import BenchRobotParityConfig, bench_robot_parity

    with pytest.raises(
        ValueError, match=r"--checkpoint=DIR names the checkpoint to serve and evaluate \(or run --quick=true\)"
    ):
        bench_robot_parity(BenchRobotParityConfig(output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="--quick trains its own toy policy: drop --checkpoint"):
        bench_robot_parity(BenchRobotParityConfig(checkpoint="x", quick=True, output_dir=str(tmp_path)))


@pytest.mark.slow
def test_quick_run_pairs_a_served_robots_episodes_with_their_simulated_twins(tmp_path):
    """The whole benchmark at toy sizes (4 episodes on 2 worlds): the robot's episodes started from their twins'
    initial states, each episode's requests are logged in order from its step 0, the simulation replayed only
    delays the robot measured, and a second run reuses the finished stages."""
    from vla_rl.bench_robot_parity import BenchRobotParityConfig, bench_robot_parity, format_summary

    cfg = BenchRobotParityConfig(quick=True, output_dir=str(tmp_path), domain_id=71)
    report = bench_robot_parity(cfg)
    out = tmp_path / "quick"
    saved = json.loads((out / "robot_parity.json").read_text())
    assert saved["summary"] == report["summary"] and len(saved["pairs"]) == 4
    assert report["summary"]["same_initial_states"] == 4
    assert [(p["eval_seed"], p["eval_world"]) for p in report["pairs"]] == [(8000, 0), (8000, 1), (8001, 0), (8001, 1)]
    trace = [json.loads(line) for line in (out / "robot" / "latencies.jsonl").read_text().splitlines()]
    assert {r["episode"] for r in trace} == {0, 1, 2, 3}
    for e in range(4):  # each episode's requests numbered 0, 1, ... in order, its first at the episode's step 0
        requests = [r for r in trace if r["episode"] == e]
        assert [r["request"] for r in requests] == list(range(len(requests))) and requests[0]["obs_step"] == 0
    measured = {-(-round(r["latency_s"] * 1e6) // round(r["control_dt"] * 1e6)) for r in trace}  # ceil, in steps
    # 0: a world whose episode ended runs on, uncounted, until the round's last ends; its chunks replay nothing.
    assert {int(d) for d in report["sim"]["delay_histogram"]} <= measured | {0}
    assert report["latency_aware"] and min(r["latency_s"] for r in trace) >= 0.1  # the added 100 ms was slept
    last = format_summary(report).splitlines()[-1]
    s = report["summary"]
    assert last == (f"sim_success={s['sim_success']:.3f} ros_success={s['ros_success']:.3f} "
                    f"gap_points={s['gap_points']:.1f} episodes=4 mcnemar_p={s['mcnemar_p']:.4f}")  # fmt: skip
    robot_stage = (out / "robot" / "robot.json").stat().st_mtime
    assert (
        bench_robot_parity(BenchRobotParityConfig(quick=True, output_dir=str(tmp_path)))["summary"] == report["summary"]
    )
    assert (out / "robot" / "robot.json").stat().st_mtime == robot_stage  # reused, not run again
