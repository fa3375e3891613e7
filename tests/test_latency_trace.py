"""`--delay.kind=trace`: a robot's latency log replayed in simulation request by request, in the robot's order:
request k of the evaluation's episode e gets the latency the robot measured for its request k of episode e.
Values below are worked out by hand from the latencies written in each test (0.05 s control steps, rounded
up). Also the two other halves of a pairing: the same initial states (the sim robot's episode seeds against
the evaluation's plan) and the same noise per request."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from shells import make_shell
from test_delay import CountingEnv

from vla_core.runtime import DelayConfig, DelayModel, LatencyLog, LatencyTrace, request_noise
from vla_core.types import ActionChunk

DT = 0.05


def write_trace(path, rows, control_dt=DT):
    """rows: (episode, request, latency_s), written as `vla-rl serve` writes them (extra fields included)."""
    log = LatencyLog(path, control_dt)
    for episode, request, latency in rows:
        log.write(latency, episode=episode, request=request, request_id=7, obs_step=0, lag_steps=1, merged=True)
    log.close()
    return str(path)


def trace_model(path, past="refuse"):
    return DelayModel(DelayConfig(kind="trace", latencies_file=path, past_trace=past, estimate="measured"), DT)


def test_the_latency_log_serve_writes_reads_back_as_a_trace_and_as_a_histogram(tmp_path):
    path = write_trace(tmp_path / "log.jsonl", [(0, 0, 0.04), (0, 1, 0.12), (1, 0, 0.051), (0, 2, 0.1), (1, 1, 0.0)])
    trace = LatencyTrace(path, DT)
    # 0.04 -> 1, 0.12 -> 3, 0.1 -> 2 (an exact multiple is not rounded up), 0.051 -> 2, 0.0 -> 0; -1: not logged.
    assert trace.steps.tolist() == [[1, 3, 2], [2, 0, -1]]
    assert trace.logged.tolist() == [3, 2] and trace.episodes == 2 and trace.max_steps == 3
    first = json.loads(Path(path).read_text().splitlines()[0])
    assert first == {"latency_s": 0.04, "control_dt": DT, "episode": 0, "request": 0, "request_id": 7, "obs_step": 0,
                     "lag_steps": 1, "merged": True}  # fmt: skip
    # The histogram kind reads the same file, its extra fields ignored: it draws among all five latencies.
    histogram = DelayModel(DelayConfig(kind="histogram", latencies_file=path), DT)
    assert histogram.max_steps == 3 and set(histogram.sample(300).tolist()) == {0, 1, 2, 3}


def test_each_world_replays_its_own_episodes_requests_in_order(tmp_path):
    """Two worlds of 6-step episodes, 2 steps per chunk. World 0 runs the plan's episode 1, world 1 episode 0
    (crossed, so a lookup by world would fail). By hand, world 1 (episode 0: 1, 3, 2 steps): request 0 at step 0
    lands at 1, request 1 at step 2 lands at 5, request 2 at step 5 would land at 7, after the episode's end (6).
    World 0 (episode 1: 2, 1, 3): requests at steps 0, 2 and 4. Each made 3 requests. The episodes after
    the autoreset are numbered by no reset: their requests get 0."""
    path = write_trace(tmp_path / "log.jsonl", [(0, 0, 0.05), (0, 1, 0.15), (0, 2, 0.1), (0, 3, 0.2),
                                               (1, 0, 0.1), (1, 1, 0.05), (1, 2, 0.15)])  # fmt: skip
    env = CountingEnv(num_envs=2, length=6)
    shell = make_shell(env, 8, 2, trace_model(path), window=1)
    _, need = shell.reset(seed=0, episodes=[1, 0])
    assert shell.episode.tolist() == [1, 0] and shell.request_index.tolist() == [0, 0]
    delays: list[list[int]] = [[], []]
    requests_steps: list[list[int]] = [[], []]
    ended = None
    while ended is None:
        for w in torch.nonzero(need).flatten().tolist():
            requests_steps[w].append(int(shell.obs_step[w]))
        actions = torch.zeros(2, 8, 1)
        _, _, _, trunc, info, need = shell.step(ActionChunk(actions, shell.obs_step))
        for w in range(2):
            if info["delay_steps"][w] >= 0:
                delays[w].append(int(info["delay_steps"][w]))
        if trunc.any():
            ended = info
    assert delays == [[2, 1, 3], [1, 3, 2]]
    assert requests_steps == [[0, 2, 4], [0, 2, 5]]
    assert ended["requests"].tolist() == [3, 3]
    # The autoreset's episodes are nobody's: numbered -1, delayed 0, their requests counted from 0 again.
    assert shell.episode.tolist() == [-1, -1] and shell.request_index.tolist() == [0, 0]
    _, _, _, _, info, _ = shell.step(ActionChunk(torch.zeros(2, 8, 1), shell.obs_step))
    assert info["delay_steps"].tolist() == [0, 0]


def test_a_trace_that_runs_out_is_refused_in_one_line_naming_the_fix(tmp_path):
    path = write_trace(tmp_path / "log.jsonl", [(0, 0, 0.05), (0, 1, 0.15), (1, 0, 0.1), (1, 2, 0.1)])
    model = trace_model(path)
    opened = torch.tensor([True, True])

    def lookup(episodes, requests):
        return model.request_delays(opened, torch.tensor(episodes), torch.tensor(requests)).tolist()

    assert lookup([0, 1], [1, 0]) == [3, 2]
    with pytest.raises(ValueError) as refused:  # fewer episodes than the evaluation runs
        model.check_episodes(3)
    assert str(refused.value) == (
        f"the latency trace {path} holds the robot's episodes 0-1 but 3 are to be replayed: record the robot for "
        "3 episodes, or evaluate --num_episodes=2"
    )
    with pytest.raises(ValueError, match="record the robot for 6 episodes"):  # a world's episode past the trace
        lookup([0, 5], [0, 0])
    with pytest.raises(ValueError) as refused:  # request 2 of episode 0: the robot logged 2 of that episode
        lookup([0, 1], [2, 0])
    assert str(refused.value) == (
        f"request 2 of episode 0 is past the latency trace {path}, which logged 2 requests of that episode (it ran "
        "longer in simulation than on the robot): pass --delay.past_trace=last to give such requests the "
        "episode's last latency"
    )
    with pytest.raises(ValueError, match="request 1 of episode 1 is missing from the latency trace"):  # never logged
        lookup([0, 1], [0, 1])
    # With past_trace=last a request past the robot's end replays that episode's last latency (0.15 s: 3 steps).
    assert trace_model(path, past="last").request_delays(
        opened, torch.tensor([0, 0]), torch.tensor([2, 9])
    ).tolist() == [3, 3]
    # Not a world that a reset did not number (training, fine-tuning).
    with pytest.raises(
        ValueError, match="only `vla-rl eval` numbers; draw from the same latencies with --delay.kind=histogram"
    ):
        model.request_delays(opened, None, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="only `vla-rl eval` numbers"):
        model.sample(4)


def test_bad_traces_and_stray_fields_are_refused(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"latency_s": 0.1, "control_dt": DT}) + "\n")
    with pytest.raises(ValueError, match="record 1 has no episode and request numbers.*--topics.episode"):
        trace_model(str(plain))
    twice = write_trace(tmp_path / "twice.jsonl", [(0, 0, 0.05), (0, 0, 0.1)])
    with pytest.raises(ValueError, match="logs request 0 of episode 0 twice"):
        trace_model(twice)
    other_rate = write_trace(tmp_path / "rate.jsonl", [(0, 0, 0.05)], control_dt=0.01)
    with pytest.raises(ValueError, match="control period of 0.01 s"):
        trace_model(other_rate)
    with pytest.raises(
        ValueError, match="delay.past_trace does not apply to --delay.kind=histogram; set --delay.kind=trace"
    ):
        DelayModel(DelayConfig(kind="histogram", latencies_file=twice, past_trace="last"), DT)


def test_a_robots_episode_starts_where_the_evaluations_episode_of_the_same_number_starts():
    """The sim robot's episode e (eval_worlds=3, seed 40) and `vla-rl eval`'s episode e (3 worlds, round e // 3
    reset with seed 40 + e // 3, world e % 3, by the plan's numbering) load the same world state."""
    from sim.config import EnvConfig
    from sim.mujoco_env import MujocoBatchedEnv
    from vla_rl.eval_record import EpisodePlan
    from vla_rl.sim_robot import SimRobotConfig, episode_seed

    plan = EpisodePlan.seeded(5, 3, 40)
    assert [plan.episode_numbers(r) for r in range(2)] == [[0, 1, 2], [3, 4, -1]]
    assert [r.seed for r in plan.rounds] == [40, 41]
    robot_cfg = SimRobotConfig(seed=40, eval_worlds=3)
    with MujocoBatchedEnv(EnvConfig(task="track_reverse", num_envs=3, cameras=[])) as batch, \
            MujocoBatchedEnv(EnvConfig(task="track_reverse", num_envs=1, cameras=[])) as robot:  # fmt: skip
        for r, round_ in enumerate(plan.rounds):
            batch.reset(seed=round_.seed)
            for world, e in enumerate(plan.episode_numbers(r)):
                if e < 0:
                    continue
                robot.reset(seed=episode_seed(robot_cfg, e))
                ours, theirs = robot.get_state()[0], batch.get_state([world])[0]
                assert np.array_equal(ours["physics"], theirs["physics"]), f"episode {e}"
                assert np.array_equal(ours["events"]["velocity"], theirs["events"]["velocity"])
        # Different episodes start differently (the check above could not pass by all states being equal).
        robot.reset(seed=episode_seed(robot_cfg, 1))
        assert not np.array_equal(robot.get_state()[0]["physics"], batch.get_state([0])[0]["physics"])
    # Without eval_worlds the robot's episodes follow one stream, as before.
    assert episode_seed(SimRobotConfig(seed=40), 0) == 40 and episode_seed(SimRobotConfig(seed=40), 3) is None


def test_the_noise_of_a_request_depends_on_its_key_alone():
    a = request_noise(3, 1, 2, 4, 2)
    assert a.shape == (1, 4, 2) and a.dtype == torch.float32
    torch.manual_seed(0)
    torch.randn(100)  # another process's draws before it change nothing
    assert torch.equal(request_noise(3, 1, 2, 4, 2), a)
    others = [request_noise(*key, 4, 2) for key in ((4, 1, 2), (3, 2, 2), (3, 1, 3), (3, 2, 1))]
    assert all(not torch.equal(o, a) for o in others)  # each part of the key matters, and its order
    with pytest.raises(ValueError, match="keyed by seed, episode and request >= 0"):
        request_noise(3, -1, 0, 4, 2)


def test_each_asked_world_samples_the_noise_of_its_own_episode_and_request():
    """eval's noise per request: world 0 runs the plan's episode 4, world 1 an uncounted one. World 0's first
    request samples the noise keyed (9, 4, 0), its second (9, 4, 1); world 1's is drawn afresh."""
    from types import SimpleNamespace

    from vla_core.runtime import DelayConfig
    from vla_rl.eval import _request_noise

    policy = SimpleNamespace(config=SimpleNamespace(horizon=4, action_dim=1))
    shell = make_shell(CountingEnv(num_envs=2), 4, 2, DelayModel(DelayConfig(kind="fixed", steps=1)))
    _, need = shell.reset(seed=0, episodes=[4, -1])
    noise = _request_noise(policy, shell, need, 9)
    assert noise.shape == (2, 4, 1) and torch.equal(noise[0], request_noise(9, 4, 0, 4, 1)[0])
    assert not torch.equal(noise[1], request_noise(9, 0, 0, 4, 1)[0]) and not torch.equal(noise[1], noise[0])
    _, _, _, _, _, need = shell.step(ActionChunk(torch.zeros(2, 4, 1), shell.obs_step))
    assert need.tolist() == [True, True] and shell.request_index.tolist() == [1, 1]
    assert torch.equal(_request_noise(policy, shell, need, 9)[0], request_noise(9, 4, 1, 4, 1)[0])
    # A policy that declares its noise shape (a LeRobot flow VLA's padded chunk, 6 x 3 here) gets noise of it.
    padded = SimpleNamespace(config=policy.config, noise_shape=(6, 3))
    noise = _request_noise(padded, shell, need, 9)
    assert noise.shape == (2, 6, 3) and torch.equal(noise[0], request_noise(9, 4, 1, 6, 3)[0])


def test_an_evaluation_replays_the_trace_request_by_request(tiny_checkpoint, tmp_path):
    """Two 8-step episodes on two worlds, 2 steps per chunk. The trace gives every request of episode 0 0.1 s
    (2 steps) and of episode 1 0.15 s (3 steps). By hand: episode 0 requests at steps 0, 2, 4 and 6; episode 1
    at 0, 3 and 6. A trace of fewer episodes than the evaluation runs is refused before any step."""
    from sim.config import EnvConfig
    from vla_core.runtime import ChunkingConfig
    from vla_rl.eval import EvalConfig, evaluate

    path = write_trace(tmp_path / "log.jsonl", [(e, k, 0.1 if e == 0 else 0.15) for e in (0, 1) for k in range(5)])

    def run(episodes, out):
        return evaluate(EvalConfig(
            checkpoint=str(tiny_checkpoint[0]), env=EnvConfig(num_envs=2, max_episode_steps=8), num_episodes=episodes,
            video_episodes=0, chunking=ChunkingConfig(execute_steps=2), noise_seed=5, output_dir=str(tmp_path / out),
            delay=DelayConfig(kind="trace", latencies_file=path, estimate="measured"),
        ))  # fmt: skip

    result = run(2, "eval")
    assert not any(e["success"] for e in result["per_episode"])  # so both run their 8 steps
    assert [(e["world"], e["requests"]) for e in result["per_episode"]] == [(0, 4), (1, 3)]
    assert result["delay_histogram"] == {"2": 4, "3": 3}
    assert result["config"]["noise_seed"] == 5 and result["delay"]["kind"] == "trace"
    with pytest.raises(ValueError, match="holds the robot's episodes 0-1 but 3 are to be replayed"):
        run(3, "short")
    assert not (tmp_path / "short" / "episodes.jsonl").exists()
