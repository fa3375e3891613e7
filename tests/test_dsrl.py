"""DSRL-NA (`vla_rl.rl.sac`, `vla-rl dsrl`): the rollout's decisions as transitions (pairing and the rows that ran,
worked out by hand), the agent learning a noise bandit through a base whose chunk is a known function of the noise,
and the command end to end on a tiny flow policy, its resume and its serving."""

from types import SimpleNamespace

import pytest
import torch
from extras import require
from tiny_policies import save_lift_flow_policy

from vla_core.types import ActionChunk
from vla_rl.rl.sac import NoiseAgent, NoiseDecision, SACConfig, transitions

require("torchrl", "steer")


class _Rollout(SimpleNamespace):
    def __len__(self):
        return len(self.world)


def rollout(world, episode, done, executed, diverged=None, truncated=None) -> _Rollout:
    """Decision i: state [i], image of value i / 7, noise [i, i], chunk rows (3 of them, 1 dim) 10 i + row."""
    m = len(world)
    return _Rollout(
        world=torch.tensor(world), episode=torch.tensor(episode), done=torch.tensor(done),
        diverged=torch.tensor(diverged or [False] * m), truncated=torch.tensor(truncated or [False] * m),
        reward=torch.arange(m, dtype=torch.float32), discount=torch.full((m,), 0.9), executed=torch.tensor(executed),
        obs={"observation.state": torch.arange(m, dtype=torch.float32)[:, None],
             "observation.images.front": (torch.arange(m) / 7).view(m, 1, 1, 1).expand(m, 3, 2, 2),
             "task": ["lift"] * m},
        decision=NoiseDecision(torch.arange(m, dtype=torch.float32)[:, None].repeat(1, 2),
                               (10 * torch.arange(m)[:, None] + torch.arange(3)).float()[..., None]),
    )  # fmt: skip


def test_each_decision_goes_to_the_next_one_of_its_world_and_episode_with_the_rows_that_ran():
    """World 0: decisions 0, 1 (1 ends its episode); world 1: 2, 3 (ends), then 4 (a new episode, ends). Next states:
    0 -> 1; the ended ones point at themselves (unused: done); 2 -> 3. Two rows run per chunk, except decision 1
    (its episode ended after one row: rows [10, 0]) and decision 4 (a late chunk whose rows 1-2 ran: [41, 42])."""
    two = [True, True, False]
    r = rollout([0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [False, True, False, True, True],
                [two, [True, False, False], two, two, [False, True, True]])  # fmt: skip
    t = transitions(r, rows=2)
    assert t["next_obs"]["state"][:, 0].tolist() == [1, 1, 3, 3, 4]
    assert t["done"].tolist() == [False, True, False, True, True] and t["reward"].tolist() == [0, 1, 2, 3, 4]
    assert t["action"].tolist() == [[0, 1], [10, 0], [20, 21], [30, 31], [41, 42]]
    assert t["noise"][:, 0].tolist() == [0, 1, 2, 3, 4] and t["discount"].tolist() == pytest.approx([0.9] * 5)
    # The replay keeps the images as uint8 (value i / 7 -> round(36.43 i): 36, 109, 146) and no instruction.
    assert t["obs"]["images"].dtype == torch.uint8 and set(t["obs"]) == {"images", "state"}
    assert t["next_obs"]["images"][:, 0, 0, 0].tolist() == [36, 36, 109, 109, 146]
    # World 1's first episode blew up: its decisions 2 and 3 are left out; the time limit cut world 0's episode at
    # decision 1: left out too (its next state is unknown).
    blown = rollout([0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [False, True, False, True, True], [two] * 5,
                    diverged=[False, False, True, True, False], truncated=[False, True, False, False, False])  # fmt: skip
    assert transitions(blown, rows=2)["noise"][:, 0].tolist() == [0, 4]


class LinearBase:
    """A stand-in flow policy whose chunk is 0.5 * noise + 0.1 (noise (B, 2, 2): 2 rows of 2 dims), images 4 px."""

    noise_shape, latent_dim, device = (2, 2), 3, torch.device("cpu")
    config = SimpleNamespace(action_dim=2, image_size=4, state_dim=1, cameras=["front"], horizon=2)

    def predict_chunk(self, obs, obs_step=None, noise=None):
        return ActionChunk(0.5 * noise + 0.1, torch.zeros(len(noise), dtype=torch.long))


def test_dsrl_na_moves_the_noise_to_the_one_whose_executed_row_is_rewarded():
    """One step, one state, E = 1 row run of the 2: reward -|a - (0.5, -0.2)|^2 for the executed row a = 0.5 w +
    0.1, so the best noise is w = (0.8, -0.6) (inside the box of 1.5), which only the base's map tells the noise
    critic. 16 warm-up rounds of the base's own noise, then 84 rounds of the agent's, 4 updates each on batches
    drawn from everything collected (a replay). The deterministic noise starts 1.0 or more away and must end within
    0.3 of the best; the row that does not run stays 0."""
    torch.manual_seed(0)
    agent = NoiseAgent(LinearBase(), SACConfig(lr=1e-3, hidden=64, critics=2, distill_batch=16, feature_dim=8,
                                               alpha_init=0.01), executed_rows=1)  # fmt: skip
    obs = {"observation.images.front": torch.zeros(16, 3, 4, 4), "observation.state": torch.zeros(16, 1),
           "task": ["t"] * 16}  # fmt: skip
    batch = {"images": torch.zeros(64, 3, 4, 4, dtype=torch.uint8), "state": torch.zeros(64, 1)}  # the state, 64 times
    best = torch.tensor([0.8, -0.6])
    start = (agent.deterministic_noise(obs)[0, 0] - best).norm()
    noises, actions = [], []
    for i in range(100):
        agent.warming_up = i < 16
        chunk, decision = agent.act(obs, torch.zeros(16, dtype=torch.long))
        noises.append(decision.noise)
        actions.append(chunk.actions[:, 0])
        if agent.warming_up:
            continue
        collected, ran = torch.cat(noises), torch.cat(actions)
        for _ in range(4):
            rows = torch.randint(len(collected), (64,))
            reward = -(ran[rows] - torch.tensor([0.5, -0.2])).pow(2).sum(-1)
            agent.update({"obs": batch, "next_obs": batch, "noise": collected[rows], "action": ran[rows],
                          "reward": reward, "discount": torch.full((64,), 0.9),
                          "done": torch.ones(64, dtype=torch.bool)})  # fmt: skip
    final = agent.deterministic_noise(obs)
    assert start > 1.0 and (final[0, 0] - best).norm() < 0.3 and final[:, 1].abs().max() == 0


def test_vla_rl_dsrl_trains_through_the_shared_rollout_and_evaluates_both_arms(tmp_path):
    from sim.config import EnvConfig
    from vla_rl.dsrl import DSRLConfig, run_dsrl

    save_lift_flow_policy(tmp_path / "policy", image_size=32)
    env = EnvConfig(num_envs=2, max_episode_steps=8, image_size=32, num_threads=1, render_threads=1)
    summary = run_dsrl(DSRLConfig(checkpoint=str(tmp_path / "policy"), env=env, iterations=2, eval_episodes=2,
                                  sac=SACConfig(batch_size=2, utd=1.0, warmup_transitions=2, hidden=16, critics=2,
                                                distill_batch=1, feature_dim=8),
                                  output_dir=str(tmp_path / "dsrl")))  # fmt: skip
    # 8 steps in chunks of 4 steps: 2 decisions per episode, 2 worlds, 2 iterations. No lift succeeds in 8 steps, so
    # the time limit cuts every episode and its second decision is left out: 2 transitions an iteration. The first
    # iteration is the warm-up (the base's own noise); once the buffer holds 2, one update per new transition.
    history = summary["history"]
    assert [h["buffer"] for h in history] == [2, 4] and [h["warmup"] for h in history] == [True, False]
    assert [h["updates"] for h in history] == [2, 2] and "loss_noise_critic" in history[1]
    assert [h["truncated_left_out"] for h in history] == [2, 2] and summary["env_steps"] == 2 * 2 * 8
    assert set(summary["eval"]) == {"base", "dsrl"} and (tmp_path / "dsrl" / "dsrl" / "model.safetensors").exists()
    # `vla-rl eval --steer.dir` and serve's loader take the agent's folder as they take an RL² steering: the policy
    # driven by the agent's deterministic noise; a weight (DSRL has none) and another base are refused.
    from robot_bridge.config import ServeConfig
    from vla_rl.cli import _loader
    from vla_rl.dsrl import NoisePolicy
    from vla_rl.eval import EvalConfig, SteerEvalConfig, evaluate

    agent_dir = str(tmp_path / "dsrl" / "dsrl")
    served = _loader(ServeConfig(checkpoint=str(tmp_path / "policy"), steer_dir=agent_dir))()
    assert isinstance(served, NoisePolicy)
    obs = {"observation.images.front": torch.rand(1, 3, 32, 32), "observation.state": torch.rand(1, 11),
           "task": ["lift the cube"]}  # fmt: skip
    agent_noise = served.predict_chunk(obs).actions  # deterministic: the actor's mean noise, whatever the stream
    torch.testing.assert_close(served.predict_chunk(obs).actions, agent_noise, rtol=0, atol=0)
    assert (served.base.predict_chunk(obs).actions - agent_noise).abs().max() > 1e-4  # not the base's own draw
    for flags in ({"weight": 0.5}, {"mode": "always"}, {"best_of": 8}):
        with pytest.raises(ValueError, match="is a DSRL agent, which sets every chunk's noise with no gate, weight or"):
            evaluate(EvalConfig(checkpoint=str(tmp_path / "policy"), env=env, num_episodes=2, video_episodes=0,
                                steer=SteerEvalConfig(dir=agent_dir, **flags), output_dir=str(tmp_path / "e2")))  # fmt: skip
    from vla_rl.checkpoint import load_policy

    policy = load_policy(str(tmp_path / "policy"))[0]
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    policy.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="steers the policy of .*, not this one"):
        evaluate(EvalConfig(checkpoint=str(tmp_path / "other"), env=env, num_episodes=2, video_episodes=0,
                            steer=SteerEvalConfig(dir=agent_dir), output_dir=str(tmp_path / "e3")))  # fmt: skip


def test_a_stopped_dsrl_run_resumes_to_the_result_of_one_never_stopped(tmp_path, monkeypatch):
    """4 iterations straight, against 4 iterations stopped by SIGTERM during the third (saved after it, though the
    periodic save is every 5) and resumed by the same command: the same history and actor, bit for bit (the replay,
    the critics, the optimizers and torch's stream resume). A resume with another training setting is refused,
    naming it; so is a delay (DSRL steers the rows that run at zero delay)."""
    import os
    import signal
    from dataclasses import replace

    from safetensors.torch import load_file

    import vla_rl.rl.rollout as rollout_module
    from sim.config import EnvConfig
    from vla_core.runtime import DelayConfig
    from vla_rl.dsrl import DSRLConfig, run_dsrl

    save_lift_flow_policy(tmp_path / "policy", image_size=32)
    env = EnvConfig(num_envs=2, max_episode_steps=8, image_size=32, num_threads=1, render_threads=1)

    def config(out: str, **changes) -> DSRLConfig:
        return DSRLConfig(checkpoint=str(tmp_path / "policy"), **{"env": env, **changes}, iterations=4, eval_episodes=2,
                          sac=SACConfig(batch_size=2, utd=1.0, warmup_transitions=2, hidden=16, critics=2,
                                        distill_batch=1, feature_dim=8),
                          output_dir=str(tmp_path / out))  # fmt: skip

    straight = run_dsrl(config("straight"))
    real_collect, calls = rollout_module.collect, []

    def stopped_during_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # noted; the iteration finishes, is saved, then the run stops
        return real_collect(*args, **kwargs)

    monkeypatch.setattr(rollout_module, "collect", stopped_during_the_third)
    with pytest.raises(KeyboardInterrupt):
        run_dsrl(config("resumed"))
    monkeypatch.setattr(rollout_module, "collect", real_collect)
    with pytest.raises(ValueError, match="another seed"):
        run_dsrl(config("resumed", seed=1))
    with pytest.raises(ValueError, match="another env"):
        run_dsrl(config("resumed", env=replace(env, variation="position")))
    # Threads and renderers choose how the worlds are computed, not what: a resume may change them, also against a
    # file written before they were left out of the check (it kept every field of the env).
    state_file = tmp_path / "resumed" / "dsrl_state.pt"
    saved = torch.load(state_file, weights_only=False)
    saved["made_with"]["env"] |= {"num_threads": 1, "render_threads": 1}
    saved["made_with"]["chunking"].pop("on_new_instruction", None)  # as written before the field existed
    torch.save(saved, state_file)
    resumed = run_dsrl(config("resumed", env=replace(env, render_isolation="thread", render_threads=2)))
    assert [h["iteration"] for h in resumed["history"]] == [0, 1, 2, 3] and resumed["history"] == straight["history"]
    a, b = (load_file(str(tmp_path / out / "dsrl" / "model.safetensors")) for out in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="--checkpoint_every=1 or more"):
        run_dsrl(config("zero", checkpoint_every=0))
    with pytest.raises(ValueError, match="steers the noise of the rows that run at zero delay"):
        run_dsrl(config("delayed", delay=DelayConfig(steps=2)))


def test_the_saved_replay_holds_its_filled_rows_and_a_full_buffer_resumes_writing_where_it_was():
    """The saved rows of a buffer of 10,000 holding 10 are 10 rows on disk (a copy: a slice would save the whole
    preallocated storage). A buffer of 10 after 14 writes (wrapped: rows 0-3 hold the 11th-14th) rebuilt from its
    filled rows and writer holds the same rows and overwrites row 4 next, as the original does."""
    import io

    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from vla_rl.dsrl import filled_rows

    def buffer():
        return ReplayBuffer(storage=LazyTensorStorage(10), batch_size=3)

    big = ReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=3)
    big.extend(TensorDict({"a": torch.zeros(10, 100)}, batch_size=[10]))
    saved = io.BytesIO()
    torch.save(filled_rows(big), saved)
    assert saved.tell() < 100_000  # 10 rows of 100 floats, not the 4 MB preallocated for 10,000
    original = buffer()
    assert filled_rows(original) is None
    original.extend(TensorDict({"a": torch.arange(7.0)}, batch_size=[7]))
    assert filled_rows(original)["a"].tolist() == [0, 1, 2, 3, 4, 5, 6]  # 7 rows of a storage of 10
    original.extend(TensorDict({"a": torch.arange(7.0) + 100}, batch_size=[7]))
    rebuilt = buffer()
    rebuilt.extend(filled_rows(original))
    rebuilt._writer.load_state_dict(original._writer.state_dict())
    for rb in (original, rebuilt):
        rb.extend(TensorDict({"a": torch.tensor([-1.0])}, batch_size=[1]))
    expected = [103, 104, 105, 106, -1, 5, 6, 100, 101, 102]
    assert original.storage[:10]["a"].tolist() == rebuilt.storage[:10]["a"].tolist() == expected
