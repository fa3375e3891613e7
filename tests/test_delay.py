"""Exact timing of the inference-delay wrapper, pinned with hand-computed sequences.

Chunk k (the k-th chunk a world receives) is [10k, 10k+1, ..., 10k+H-1]: action j is meant for
step obs_step + j. The counting env records the action applied at every step; its hold action is -1;
its reward is the in-episode index of the step taken (0, 1, 2, ...).
"""

import json

import numpy as np
import pytest
import torch
from shells import CountingEnv, make_shell

from vla_core.runtime import DelayConfig, DelayModel, LatencySpec, latencies_to_steps
from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK, OBS_DELAY_STEPS, ActionChunk


def run(d, s, horizon, steps, merge="latest", coeff=0.0, length=1000):
    """Drive the wrapper with chunk k = [10k + j]; return the applied actions and the observations seen."""
    env = CountingEnv(length=length)
    wrapper = make_shell(
        env, horizon, s, DelayModel(DelayConfig(kind="fixed", steps=d)), merge=merge, ensemble_coeff=coeff
    )
    obs, need = wrapper.reset(seed=0)
    k, seen = 0, []
    while len(env.applied[0]) < steps:
        assert need.tolist() == [True]
        seen.append((wrapper.obs_step.item(), obs))
        actions = (10 * k + torch.arange(horizon, dtype=torch.float32)).reshape(1, horizon, 1)
        obs, _, _, _trunc, info, need = wrapper.step(ActionChunk(actions, wrapper.obs_step))
        assert info["delay_steps"].tolist() == [d]
        k += 1
    return env.applied[0][:steps], seen


def test_no_delay_is_plain_chunking():
    applied, seen = run(d=0, s=2, horizon=4, steps=8)
    assert applied == [0, 1, 10, 11, 20, 21, 30, 31]
    assert [t for t, _ in seen[:4]] == [0, 2, 4, 6]


def test_one_step_delay_keeps_executing_the_committed_action():
    # t=0: request, chunk0 arrives at t=1, so t=0 holds. t=1: chunk0 covers steps 1..3.
    # t=2: request; chunk1 (for steps 2..5) arrives at t=3, so step 2 still runs chunk0's 2.
    applied, seen = run(d=1, s=2, horizon=4, steps=8)
    assert applied == [-1, 1, 2, 11, 12, 21, 22, 31]
    t, obs = seen[1]
    assert t == 2
    assert obs[OBS_DELAY_STEPS].tolist() == [1]
    assert obs[OBS_COMMITTED_MASK].tolist() == [[True]]
    assert obs[OBS_COMMITTED_ACTIONS].tolist() == [[[2.0]]]


def test_delay_longer_than_execution_horizon():
    # d=3 > s=2: requests every max(s, d) = 3 steps; each chunk arrives with only step 3 left.
    applied, seen = run(d=3, s=2, horizon=4, steps=10)
    assert applied == [-1, -1, -1, 3, -1, -1, 13, -1, -1, 23]
    t, obs = seen[1]
    assert t == 3
    assert obs[OBS_DELAY_STEPS].tolist() == [3]
    assert obs[OBS_COMMITTED_MASK].tolist() == [[True, False, False]]  # only step 3 is committed
    assert obs[OBS_COMMITTED_ACTIONS][0, :, 0].tolist() == [3.0, 0.0, 0.0]
    # The first request has nothing committed.
    assert seen[0][1][OBS_COMMITTED_MASK].tolist() == [[False, False, False]]


def test_long_chunk_covers_the_delay():
    # H=6, d=2, s=3: chunk k covers steps 3k..3k+5 and arrives at 3k+2; step 3k+2 is its index 2.
    applied, _ = run(d=2, s=3, horizon=6, steps=9)
    assert applied == [-1, -1, 2, 3, 4, 12, 13, 14, 22]


def test_temporal_ensembling_under_delay():
    # s=1, d=1, H=3, plain mean: step 2 = mean(chunk0[2], chunk1[1]) = (2 + 11) / 2.
    applied, _ = run(d=1, s=1, horizon=3, steps=5, merge="ensemble", coeff=0.0)
    assert applied == [-1, 1, 6.5, 16.5, 26.5]


def test_episode_end_drops_the_in_flight_chunk():
    env = CountingEnv(length=5)
    wrapper = make_shell(env, 4, 2, DelayModel(DelayConfig(kind="fixed", steps=2)))
    wrapper.reset()
    k, truncs = 0, []
    while len(env.applied[0]) < 7:
        actions = (10 * k + torch.arange(4, dtype=torch.float32)).reshape(1, 4, 1)
        _obs, _, _, trunc, _, _need = wrapper.step(ActionChunk(actions, wrapper.obs_step))
        truncs.append((len(env.applied[0]), bool(trunc[0]), wrapper.obs_step.item()))
        k += 1
    # Steps 0-4: hold, hold, chunk0[2], chunk0[3], chunk1[2] (chunk1 asked at t=2, arrived t=4).
    # chunk2 (asked at t=4) is dropped when the episode ends; the new episode asks again at its t=0.
    assert env.applied[0][:7] == [-1, -1, 2, 3, 12, -1, -1]
    assert (5, True, 0) in truncs


def test_each_world_keeps_its_own_schedule():
    env = CountingEnv(num_envs=3)
    cfg = DelayConfig(kind="uniform", low=0, high=3, seed=1)
    wrapper = make_shell(env, 8, 2, DelayModel(cfg))
    obs, _ = wrapper.reset()
    seen_delays = []
    for _ in range(30):
        assert obs[OBS_COMMITTED_ACTIONS].shape == (3, 3, 1)
        chunk = ActionChunk(
            torch.arange(8, dtype=torch.float32).repeat(3, 1)[..., None] + wrapper.obs_step[:, None, None],
            wrapper.obs_step,
        )
        obs, _, _, _, info, _ = wrapper.step(chunk)
        seen_delays += [d for d in info["delay_steps"].tolist() if d >= 0]
    assert set(seen_delays) == {0, 1, 2, 3}
    for i in range(3):
        applied = env.applied[i]
        # Chunk rows are "step index" valued, so any real (non-hold) action equals its own step.
        assert all(a == t for t, a in enumerate(applied) if a != -1)
        assert sum(a != -1 for a in applied) > len(applied) // 2


def write_latencies(path, latencies, control_dt=0.05):
    path.write_text("".join(json.dumps({"latency_s": x, "control_dt": control_dt}) + "\n" for x in latencies))
    return str(path)


def test_latency_histogram_rounds_up_to_control_steps(tmp_path):
    assert latencies_to_steps(np.array([0.04, 0.05, 0.051, 0.12, 0.0]), 0.05).tolist() == [1, 1, 2, 3, 0]
    path = write_latencies(tmp_path / "latencies.jsonl", [0.04, 0.12])
    model = DelayModel(DelayConfig(kind="histogram", latencies_file=path, seed=0), control_dt=0.05)
    assert model.max_steps == 3
    assert set(model.sample(200).tolist()) == {1, 3}
    # Measured and used at 25 Hz: 0.04 s and 0.12 s are 1 and 3 steps of 0.04 s.
    path = write_latencies(tmp_path / "at_25hz.jsonl", [0.04, 0.12], control_dt=0.04)
    assert DelayModel(DelayConfig(kind="histogram", latencies_file=path), control_dt=0.04).max_steps == 3


def test_bad_delay_configs_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown delay kind 'gauss'"):
        DelayModel(DelayConfig(kind="gauss"))
    with pytest.raises(ValueError, match="low <= delay.high"):
        DelayModel(DelayConfig(kind="uniform", low=3, high=1))
    with pytest.raises(FileNotFoundError, match="latency file"):
        DelayModel(DelayConfig(kind="histogram", latencies_file=str(tmp_path / "missing.jsonl")), control_dt=0.05)
    cases = {
        "empty": ("", "holds no latencies"),
        "negative": ('{"latency_s": 0.1, "control_dt": 0.05}\n{"latency_s": -1, "control_dt": 0.05}\n', "negative"),
        "nan": ('{"latency_s": NaN, "control_dt": 0.05}\n', "not finite"),
        "period": (
            '{"latency_s": 0.1, "control_dt": 0.01}\n',
            "control period of 0.01 s but the delays are counted in steps of 0.05 s; .*--control_hz=20",
        ),
        "not_a_record": ("[0.1, 0.2]\n", "not a latency record"),
    }
    for name, (text, words) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=words):
            DelayModel(DelayConfig(kind="histogram", latencies_file=str(tmp_path / name)), control_dt=0.05)
    # A field of another kind would be silently ignored: refused, naming the kind it belongs to.
    with pytest.raises(ValueError, match="delay.high does not apply to --delay.kind=fixed; set --delay.kind=uniform"):
        DelayModel(DelayConfig(high=8))
    with pytest.raises(ValueError, match="delay.steps does not apply to --delay.kind=uniform; set --delay.kind=fixed"):
        DelayModel(DelayConfig(kind="uniform", steps=2, high=4))


def test_delays_a_policy_cannot_take_are_refused():
    with pytest.raises(ValueError, match="chunk holds 8"):
        LatencySpec(horizon=8).check_delay(8)
    with pytest.raises(ValueError, match="trained for delays up to 4; .* --delay.kind=uniform --delay.high=6"):
        LatencySpec(horizon=16, committed_rows=4).check_delay(6)
    with pytest.raises(ValueError, match="fine-tuned for delays up to 3; lower the delay or fine-tune it at 5"):
        LatencySpec(horizon=16, latency_aware=True, latency_max_delay=3).check_delay(5)
    # On a robot the fix is to serve faster.
    with pytest.raises(ValueError, match="this robot's delays reach max_delay_steps=6 .* up to 4; serve faster"):
        LatencySpec(horizon=16, committed_rows=4).check_delay(6, on_robot=True)
    # A policy that does not read the augmentation (0) runs under any delay shorter than its chunk.
    LatencySpec(horizon=8).check_delay(7)
    # The shell refuses them before any step, with the delay model's largest draw.
    with pytest.raises(ValueError, match="trained for delays up to 2"):
        make_shell(CountingEnv(), 8, 2, DelayModel(DelayConfig(kind="uniform", high=3)), committed_rows=2)


def test_mujoco_arm_holds_still_until_the_delayed_chunk_arrives():
    from sim.config import EnvConfig
    from sim.mujoco_env import MujocoBatchedEnv

    with MujocoBatchedEnv(EnvConfig(num_envs=2)) as env:
        wrapper = make_shell(env, horizon=8, execute_steps=8, delay=DelayModel(DelayConfig(kind="fixed", steps=3)))
        _, need = wrapper.reset(seed=0)
        start = env.ee_positions().copy()
        target = start + np.array([0.0, 0.0, 0.08])
        actions = torch.from_numpy(np.concatenate([target, np.zeros((2, 1))], axis=1)).float()
        chunk = ActionChunk(actions[:, None, :].expand(2, 8, 4).clone(), wrapper.obs_step)
        env_steps = []
        real_step = env.step

        def counting_step(a):
            env_steps.append(env.ee_positions().copy())
            return real_step(a)

        env.step = counting_step
        _obs, _, _, _, info, need = wrapper.step(chunk)
        assert info["steps"].tolist() == [8, 8] and need.tolist() == [True, True]
        # Steps 0-2 hold (the chunk arrives at step 3): the gripper stays within 3 mm of where it was.
        for ee in env_steps[1:4]:
            np.testing.assert_allclose(ee, start, atol=0.003)
        # From step 3 on it executes the chunk's last 5 actions and climbs toward the target.
        assert (env.ee_positions()[:, 2] > start[:, 2] + 0.05).all()


def test_per_world_schedules_across_episode_ends():
    """Random delays and episodes of 7 steps: every non-hold action still equals its own step index."""
    env = CountingEnv(num_envs=3, length=7)
    wrapper = make_shell(env, 6, 2, DelayModel(DelayConfig(kind="uniform", low=0, high=4, seed=3)))
    wrapper.reset()
    truncations = 0
    for _ in range(60):
        steps = wrapper.obs_step
        chunk = ActionChunk(torch.arange(6, dtype=torch.float32).repeat(3, 1)[..., None] + steps[:, None, None], steps)
        _obs, _, _, trunc, _info, _need = wrapper.step(chunk)
        truncations += int(trunc.sum())
    assert truncations >= 6
    for i in range(3):
        in_episode = [t % 7 for t in range(len(env.applied[i]))]
        assert all(a == t for t, a in zip(in_episode, env.applied[i]) if a != -1)
        assert sum(a != -1 for a in env.applied[i]) > len(env.applied[i]) // 3


def trace_rows(trace) -> list[list[tuple]]:
    """Per world, per step of a call: (source, row, reward, truncated)."""
    return [list(zip(*(getattr(trace, f)[w].tolist() for f in ("source", "row", "reward", "truncated"))))
            for w in range(trace.reward.shape[0])]  # fmt: skip


def test_the_step_trace_names_the_chunk_and_row_each_step_ran():
    """d=1, s=2: a world requests at steps 0, 2, 4, ...; world 1's episodes last 3 steps, world 0's 100.

    Each step's source is the step its chunk was conditioned on, and its row the index in that chunk; a
    step before the episode's first chunk holds (-1, -1). World 1's episode ends at its step 2 (truncated);
    its new episode holds at its step 0 while world 0 runs chunk 1's row 1 (requested at 2, arrived at 3).
    The ledger then closes world 1's first decision with its episode (steps 1, 2: rows 1, 2) and world 0's
    when chunk 1's first row runs: steps 1, 2, not the steps from its request (0, 1).
    """
    from vla_core.runtime.transition import ExecutionCredit

    env = CountingEnv(num_envs=2, length=[100, 3])
    wrapper = make_shell(env, 4, 2, DelayModel(DelayConfig(kind="fixed", steps=1)))
    wrapper.reset()
    credit = ExecutionCredit(2, gamma=0.5)
    chunk = lambda: ActionChunk(torch.zeros(2, 4, 1), wrapper.obs_step)  # the actions do not matter

    _, reward, _, trunc, info, need = wrapper.step(chunk())  # steps 0 and 1 for both
    assert need.tolist() == [True, True] and reward.tolist() == [1.0, 1.0]
    assert trace_rows(info["trace"]) == [[(-1, -1, 0.0, False), (0, 1, 1.0, False)]] * 2
    assert credit.add(info["trace"]) == []

    _, reward, _, trunc, info, need = wrapper.step(chunk())  # step 2: world 1's episode ends
    assert need.tolist() == [False, True] and trunc.tolist() == [False, True] and reward.tolist() == [2.0, 2.0]
    assert trace_rows(info["trace"]) == [[(0, 2, 2.0, False)], [(0, 2, 2.0, True)]]
    (ended,) = credit.add(info["trace"])
    assert (ended.world, ended.source, ended.first_row, ended.last_row, ended.steps) == (1, 0, 1, 2, 2)
    assert (ended.reward, ended.discount, ended.truncated, ended.terminated) == (1 + 0.5 * 2, 0.25, True, False)

    _, reward, _, trunc, info, need = wrapper.step(chunk())  # world 0 at step 3, world 1 at its step 0
    assert need.tolist() == [True, False] and reward.tolist() == [3.0, 0.0]  # per call: this step only
    assert trace_rows(info["trace"]) == [[(2, 1, 3.0, False)], [(-1, -1, 0.0, False)]]
    (switched,) = credit.add(info["trace"])
    assert (switched.world, switched.source, switched.first_row, switched.last_row) == (0, 0, 1, 2)
    assert (switched.reward, switched.discount, switched.truncated) == (1 + 0.5 * 2, 0.25, False)

    _, reward, _, trunc, info, need = wrapper.step(chunk())  # world 0 at step 4, world 1 at step 1
    assert need.tolist() == [False, True] and reward.tolist() == [4.0, 1.0]
    assert trace_rows(info["trace"]) == [[(2, 2, 4.0, False)], [(0, 1, 1.0, False)]]
    assert not info["trace"].terminated.any() and credit.add(info["trace"]) == []


def test_a_step_that_held_after_its_chunk_ran_out_stays_its_decisions():
    """d=3 > s=2, H=4: chunk k (asked at 3k) arrives at 3k + 3 with only row 3 left, then the queue runs dry
    and the last action is held for two steps: those steps are still the chunk's (row -1, source kept)."""
    env = CountingEnv()
    wrapper = make_shell(env, 4, 2, DelayModel(DelayConfig(kind="fixed", steps=3)))
    wrapper.reset()
    sources, rows = [], []
    for _ in range(3):
        info = wrapper.step(ActionChunk(torch.zeros(1, 4, 1), wrapper.obs_step))[4]
        sources += info["trace"].source[0].tolist()
        rows += info["trace"].row[0].tolist()
    assert sources == [-1, -1, -1, 0, 0, 0, 3, 3, 3]
    assert rows == [-1, -1, -1, 3, -1, -1, 3, -1, -1]


def test_the_trace_rides_along_and_every_reward_after_the_first_chunk_lands_in_one_window():
    """Applied actions and per-call sums are what they were without the trace; the per-step rewards add up to
    the per-call sums, and the ledger pays each reward of a step some chunk's row ran exactly once."""
    from vla_core.runtime.transition import ExecutionCredit

    env = CountingEnv(num_envs=3, length=[7, 5, 9])
    wrapper = make_shell(env, 6, 2, DelayModel(DelayConfig(kind="uniform", low=0, high=4, seed=3)))
    wrapper.reset()
    credit = ExecutionCredit(3)
    call_rewards, paid, credited = np.zeros(3), np.zeros(3), np.zeros(3)
    for _ in range(40):
        steps = wrapper.obs_step
        chunk = ActionChunk(torch.arange(6, dtype=torch.float32).repeat(3, 1)[..., None] + steps[:, None, None], steps)
        _obs, reward, _, _, info, _need = wrapper.step(chunk)
        call_rewards += reward.numpy()
        trace = info["trace"]
        np.testing.assert_array_equal(trace.reward.sum(1).numpy(), reward.numpy())
        paid += np.where(trace.source.numpy() >= 0, trace.reward.numpy(), 0.0).sum(1)
        for window in credit.add(trace):
            credited[window.world] += window.reward
    running = np.array([0.0 if w is None else w["reward"] for w in credit._open])
    np.testing.assert_array_equal(credited + running, paid)
    for i, length in enumerate([7, 5, 9]):
        in_episode = [s % length for s in range(len(env.applied[i]))]
        assert call_rewards[i] == sum(in_episode)


@pytest.mark.parametrize("how", ["reset", "set_state"])
def test_a_world_restarted_alone_forgets_its_chunks(how):
    """d = 1, two steps per chunk, chunk k = [10k + j]. Both worlds run chunk 0 ([-1 held, 1]) and request
    at step 2; then world 1 alone restarts (a reset to t = 0, or world 0's state loaded: t = 2). World 0
    goes on from its queue (2, then chunk 1's 11); world 1's queue and step count are gone, so it holds
    (-1) until chunk 1, conditioned on its step 0, arrives (11). Rewards are the env's t of each step taken."""
    env = CountingEnv(num_envs=2)
    wrapper = make_shell(env, 4, 2, DelayModel(DelayConfig(kind="fixed", steps=1)))
    wrapper.reset(seed=0)
    chunk = lambda k: ActionChunk((10 * k + torch.arange(4.0)).reshape(1, 4, 1).repeat(2, 1, 1), wrapper.obs_step)
    _, _, _, _, _, need = wrapper.step(chunk(0))
    assert need.tolist() == [True, True] and wrapper.obs_step.tolist() == [2, 2]
    if how == "reset":
        _, need = wrapper.reset(worlds=[1])
        t1 = 0
    else:
        _, need = wrapper.set_state(env.get_state([0]), worlds=[1])
        t1 = 2
    assert need.tolist() == [True, True] and wrapper.obs_step.tolist() == [2, 0] and env.t.tolist() == [2, t1]
    info = wrapper.step(chunk(1))[4]
    assert env.applied == [[-1, 1, 2, 11], [-1, 1, -1, 11]]
    # World 0 ran chunk 0's row 2, then chunk 1's (conditioned on step 2) row 1; world 1 held, then ran the row 1
    # of the chunk conditioned on its new step 0.
    assert trace_rows(info["trace"]) == [[(0, 2, 2.0, False), (2, 1, 3.0, False)],
                                         [(-1, -1, t1, False), (0, 1, t1 + 1, False)]]  # fmt: skip


def test_mid_inference_observation_waits_m_steps_into_the_window_and_the_chunk_still_starts_at_the_request():
    """d = 4, mid_fraction = 0.5 -> m = 2; execute_steps 8, horizon 12. The counting env's state is the
    step index, so each observation tells the step it was taken at.

    Episode start: the request at step 0 is answered at step 2 (two held steps); chunk 0 = [0..11] is
    for steps 0..11 and arrives at 4 (steps 2, 3 still hold). Next request at step 8, answered at 10
    with the committed actions chunk0[8..11]; chunk 1 = [10..21] is for steps 8..19 and arrives at 12."""
    from vla_core.types import OBS_MID_STATE, OBS_MID_STEPS

    env = CountingEnv()
    shell = make_shell(env, 12, 8, DelayModel(DelayConfig(kind="fixed", steps=4)), mid_fraction=0.5)
    obs, need = shell.reset(seed=0)
    assert need.tolist() == [False]  # not asked before the mid observation exists
    nothing = ActionChunk(torch.zeros(1, 12, 1), shell.obs_step)
    obs, _, _, _, info, need = shell.step(nothing)
    assert need.tolist() == [True] and info["steps"].tolist() == [2]
    assert (obs["observation.state"].item(), obs[OBS_MID_STATE].item(), obs[OBS_MID_STEPS].item()) == (0, 2, 2)
    assert shell.obs_step.tolist() == [0] and obs[OBS_COMMITTED_MASK].tolist() == [[False] * 4]

    chunk0 = torch.arange(12, dtype=torch.float32).reshape(1, 12, 1)
    obs, _, _, _, info, need = shell.step(ActionChunk(chunk0, shell.obs_step))
    assert need.tolist() == [True] and info["steps"].tolist() == [8] and info["delay_steps"].tolist() == [4]
    assert env.applied[0] == [-1, -1, -1, -1, 4, 5, 6, 7, 8, 9]
    assert (obs["observation.state"].item(), obs[OBS_MID_STATE].item(), obs[OBS_MID_STEPS].item()) == (8, 10, 2)
    assert shell.obs_step.tolist() == [8]
    assert obs[OBS_COMMITTED_MASK].tolist() == [[True] * 4]
    assert obs[OBS_COMMITTED_ACTIONS].flatten().tolist() == [8, 9, 10, 11]
    assert info["trace"].source.tolist() == [[-1, -1] + [0] * 6]  # steps 2, 3 hold; 4 .. 9 run chunk 0
    assert info["trace"].row.tolist() == [[-1, -1, 4, 5, 6, 7, 8, 9]]

    chunk1 = (10 + torch.arange(12, dtype=torch.float32)).reshape(1, 12, 1)
    shell.step(ActionChunk(chunk1, shell.obs_step))
    assert env.applied[0] == [-1, -1, -1, -1, 4, 5, 6, 7, 8, 9, 10, 11, 14, 15, 16, 17, 18, 19]


def test_an_episode_that_ends_before_the_mid_observation_drops_its_request():
    """Episodes of 9 steps: the request at step 8 (to be answered at 10) dies with its episode at 9.
    That call returns at the episode's end (chunk 0's rows 4 .. 8 ran), no policy asked; the next call
    runs the new episode's first 2 (held) steps and asks about its request at its step 0."""
    from vla_core.types import OBS_MID_STATE

    env = CountingEnv(length=9)
    shell = make_shell(env, 12, 8, DelayModel(DelayConfig(kind="fixed", steps=4)), mid_fraction=0.5)
    shell.reset(seed=0)
    shell.step(ActionChunk(torch.zeros(1, 12, 1), shell.obs_step))  # answered at step 2
    chunk0 = torch.arange(12, dtype=torch.float32).reshape(1, 12, 1)
    _, _, _, trunc, info, need = shell.step(ActionChunk(chunk0, shell.obs_step))
    assert need.tolist() == [False] and trunc.tolist() == [True]
    assert trace_rows(info["trace"]) == [[(-1, -1, 2.0, False), (-1, -1, 3.0, False)]
                                         + [(0, t, float(t), t == 8) for t in range(4, 9)]]  # fmt: skip
    assert env.applied[0] == [-1, -1, -1, -1, 4, 5, 6, 7, 8]
    obs, _, _, trunc, _, need = shell.step(ActionChunk(torch.zeros(1, 12, 1), shell.obs_step))
    assert need.tolist() == [True] and trunc.tolist() == [False]
    assert env.applied[0][9:] == [-1, -1]  # steps 0, 1 of the new episode hold
    assert (obs["observation.state"].item(), obs[OBS_MID_STATE].item()) == (0, 2)
    assert shell.obs_step.tolist() == [0] and obs[OBS_COMMITTED_MASK].tolist() == [[False] * 4]


def test_with_mid_observations_each_world_ends_its_own_episode():
    """Two worlds, episodes of 9 and 20 steps, d = 4, m = 2, both answered at step 2 with chunk 0. The
    next call returns at step 9, where world 0's episode ended (steps 2..8 ran: two holds, then chunk 0's
    rows 4 .. 8) and no policy is asked. The one after returns at step 10, where world 1 is asked about
    its request of step 8: it ran chunk 0's row 9, world 0's new episode held meanwhile."""
    env = CountingEnv(num_envs=2, length=[9, 20])
    shell = make_shell(env, 12, 8, DelayModel(DelayConfig(kind="fixed", steps=4)), mid_fraction=0.5)
    shell.reset(seed=0)
    shell.step(ActionChunk(torch.zeros(2, 12, 1), shell.obs_step))  # both answered at step 2
    chunk0 = torch.arange(12, dtype=torch.float32).reshape(1, 12, 1).expand(2, 12, 1)
    _, _, _, truncated, info, need = shell.step(ActionChunk(chunk0, shell.obs_step))
    assert truncated.tolist() == [True, False] and need.tolist() == [False, False]
    ran = [(-1, -1, 2.0, False), (-1, -1, 3.0, False)] + [(0, t, float(t), False) for t in range(4, 9)]
    assert trace_rows(info["trace"]) == [ran[:-1] + [(0, 8, 8.0, True)], ran]
    _, _, _, truncated, info, need = shell.step(ActionChunk(torch.zeros(2, 12, 1), shell.obs_step))
    assert need.tolist() == [False, True] and truncated.tolist() == [False, False]
    assert trace_rows(info["trace"]) == [[(-1, -1, 0.0, False)], [(0, 9, 9.0, False)]]
    assert env.applied[1] == [-1, -1, -1, -1, 4, 5, 6, 7, 8, 9]
    assert env.applied[0] == [-1, -1, -1, -1, 4, 5, 6, 7, 8, -1]  # the new episode holds, its policy not asked yet


def test_mid_inference_images_are_the_worlds_frames_m_steps_after_the_request():
    """The real moving-ball task with a camera: the policy sees the request's frame and, as the mid
    observation, the frame the env returned m = 3 steps later (the ball has moved in between)."""
    from sim.config import EnvConfig
    from sim.factory import make_env
    from vla_core.types import OBS_MID_STATE, image_key, mid_image_key

    class Recording:  # passes everything through to the real env; keeps each step's observation
        def __init__(self, env):
            self.env, self.seen = env, []

        def __getattr__(self, name):
            return getattr(self.env, name)

        def reset(self, *args, **kwargs):
            self.seen = [self.env.reset(*args, **kwargs)]
            return self.seen[0]

        def step(self, actions):
            out = self.env.step(actions)
            self.seen.append(out[0])
            return out

    with make_env(EnvConfig(task="track", num_envs=2)) as real:
        env = Recording(real)
        delay = DelayModel(DelayConfig(kind="fixed", steps=6))
        shell = make_shell(env, 16, 8, delay, mid_fraction=0.5, mid_cameras=["front"])
        shell.reset(seed=3)
        obs, _, _, _, _, need = shell.step(ActionChunk(torch.zeros(2, 16, 4), shell.obs_step))
        assert need.tolist() == [True, True] and len(env.seen) == 4  # the reset, then m = 3 held steps
        front = image_key("front")
        assert torch.equal(obs[front], env.seen[0][front]) and torch.equal(
            obs[mid_image_key("front")], env.seen[3][front]
        )
        assert torch.equal(obs[OBS_MID_STATE], env.seen[3]["observation.state"])
        assert not torch.equal(env.seen[0][front], env.seen[3][front])  # the world moved during the inference
