"""DSRL (`vla_rl.rl.sac`, `vla-rl dsrl`): the rollout's decisions as transitions (pairing worked out by hand), the
chunk discount, SAC through TorchRL learning a noise bandit, and the command end to end on a tiny flow policy."""

from types import SimpleNamespace

import pytest
import torch
from extras import require
from tiny_policies import save_lift_flow_policy

from vla_rl.rl.sac import NoiseAgent, NoiseDecision, SACConfig, chunk_discount, transitions

require("torchrl", "steer")


def rollout(world, episode, done, discount=None, diverged=None, truncated=None):
    m = len(world)
    return SimpleNamespace(
        world=torch.tensor(world), episode=torch.tensor(episode), done=torch.tensor(done),
        diverged=torch.tensor(diverged or [False] * m), truncated=torch.tensor(truncated or [False] * m),
        reward=torch.arange(m, dtype=torch.float32), discount=torch.tensor(discount or [0.9] * m),
        decision=NoiseDecision(torch.arange(m, dtype=torch.float32)[:, None].repeat(1, 2),
                               10 + torch.arange(m, dtype=torch.float32)[:, None]),
        __len__=None,
    )  # fmt: skip


class _Rollout(SimpleNamespace):
    def __len__(self):
        return len(self.world)


def test_each_decision_goes_to_the_next_one_of_its_world_and_episode():
    """World 0: decisions 0, 1 (1 ends its episode); world 1: 2, 3 (ends), then 4 (a new episode, ends). Next states:
    0 -> 1; the ended ones point at themselves (unused: done); 2 -> 3."""
    r = _Rollout(**vars(rollout([0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [False, True, False, True, True])))
    td = transitions(r)
    assert td["next", "observation"][:, 0].tolist() == [11, 11, 13, 13, 14]
    assert td["next", "done"][:, 0].tolist() == [False, True, False, True, True]
    assert td["action"][:, 0].tolist() == [0, 1, 2, 3, 4] and td["next", "reward"][:, 0].tolist() == [0, 1, 2, 3, 4]
    # World 1's first episode blew up: its decisions 2 and 3 are left out.
    blown = _Rollout(**vars(rollout([0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [False, True, False, True, True],
                                    diverged=[False, False, True, True, False])))  # fmt: skip
    assert transitions(blown)["action"][:, 0].tolist() == [0, 1, 4]
    # The time limit cut world 0's episode at decision 1 and world 1's first at 3: those two are left out (their
    # next state is unknown), the decisions before them keep theirs, decision 4 (a success) stays terminal.
    cut = _Rollout(**vars(rollout([0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [False, True, False, True, True],
                                  truncated=[False, True, False, True, False])))  # fmt: skip
    td = transitions(cut)
    assert td["action"][:, 0].tolist() == [0, 2, 4] and td["next", "observation"][:, 0].tolist() == [11, 13, 14]
    assert td["next", "done"][:, 0].tolist() == td["next", "terminated"][:, 0].tolist() == [False, False, True]


def test_the_chunk_discount_is_that_of_the_chunks_that_did_not_end_their_episode():
    """gamma 0.99, chunks of 4 steps (0.99^4 = 0.96059601) unless they end the episode (shorter: left out)."""
    r = _Rollout(**vars(rollout([0, 0, 0], [0, 0, 0], [False, False, True], [0.99**4, 0.99**4, 0.99])))
    assert chunk_discount(r, 0.99) == pytest.approx(0.99**4)
    assert chunk_discount(_Rollout(**vars(rollout([0], [0], [True]))), 0.99) == 0.99


def test_sac_moves_the_noise_toward_the_rewarded_one():
    """A one-step bandit on a fixed state: reward -|w - target|^2 with target (0.8, -0.6, 0.4, 0.0), each episode
    one decision (done). The deterministic noise starts at 0 (|w - target| = 1.077) and must end within 0.3."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    torch.manual_seed(0)
    policy = SimpleNamespace(noise_shape=(2, 2), latent_dim=3, device=torch.device("cpu"))
    agent = NoiseAgent(policy, SACConfig(lr=3e-3, batch_size=128, updates=1, hidden=64, alpha_init=0.01))
    agent.loss.make_value_estimator(gamma=0.9)
    target, state = torch.tensor([0.8, -0.6, 0.4, 0.0]), torch.zeros(64, 3)
    replay = ReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=128)

    def deterministic() -> torch.Tensor:
        from tensordict.nn import InteractionType, set_interaction_type

        with torch.no_grad(), set_interaction_type(InteractionType.DETERMINISTIC):
            return agent.actor(TensorDict({"observation": state[:1]}, batch_size=[1]))["action"][0]

    start = (deterministic() - target).norm()
    with torch.no_grad():  # the rollout's draws explore: two draws for one state differ
        assert not torch.equal(agent.sample(state[:1]), agent.sample(state[:1]))
    for _ in range(400):
        with torch.no_grad():
            noise = agent.sample(state)  # as act draws them
        done = torch.ones(64, 1, dtype=torch.bool)
        replay.extend(TensorDict({"observation": state, "action": noise, "next": TensorDict({
            "observation": state, "reward": -(noise - target).pow(2).sum(-1, keepdim=True), "done": done,
            "terminated": done}, batch_size=[64])}, batch_size=[64]))  # fmt: skip
        agent.update(replay)
    assert start > 1.0 and (deterministic() - target).norm() < 0.3


def test_vla_rl_dsrl_trains_through_the_shared_rollout_and_evaluates_both_arms(tmp_path):
    from sim.config import EnvConfig
    from vla_rl.dsrl import DSRLConfig, run_dsrl

    save_lift_flow_policy(tmp_path / "policy", image_size=32)
    env = EnvConfig(num_envs=2, max_episode_steps=8, image_size=32, num_threads=1, render_threads=1)
    summary = run_dsrl(DSRLConfig(checkpoint=str(tmp_path / "policy"), env=env, iterations=2, eval_episodes=2,
                                  sac=SACConfig(batch_size=2, updates=2, hidden=16), output_dir=str(tmp_path / "dsrl")))  # fmt: skip
    # 8 steps in chunks of 4 steps: 2 decisions per episode, 2 worlds, 2 iterations. No lift succeeds in 8 steps, so
    # the time limit cuts every episode and its second decision is left out: 2 transitions an iteration.
    assert [h["buffer"] for h in summary["history"]] == [2, 4] and "loss_qvalue" in summary["history"][1]
    assert [h["truncated_left_out"] for h in summary["history"]] == [2, 2]
    assert summary["gamma_chunk"] == pytest.approx(0.99**4)
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
    with pytest.raises(ValueError, match="is a DSRL agent, which sets every chunk's noise with no weight"):
        evaluate(EvalConfig(checkpoint=str(tmp_path / "policy"), env=env, num_episodes=2, video_episodes=0,
                            steer=SteerEvalConfig(dir=agent_dir, weight=0.5), output_dir=str(tmp_path / "e2")))  # fmt: skip
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
    periodic save is every 5) and resumed by the same command: the same history and actor, bit for bit. Delays
    are drawn at random and announced as measured, so the delay stream and the measured lags must resume too.
    A resume with another training setting is refused, naming it."""
    import os
    import signal

    from safetensors.torch import load_file

    import vla_rl.rl.rollout as rollout_module
    from sim.config import EnvConfig
    from vla_core.runtime import DelayConfig
    from vla_rl.dsrl import DSRLConfig, run_dsrl

    save_lift_flow_policy(tmp_path / "policy", image_size=32)
    env = EnvConfig(num_envs=2, max_episode_steps=8, image_size=32, num_threads=1, render_threads=1)

    def config(out: str, **changes) -> DSRLConfig:
        return DSRLConfig(checkpoint=str(tmp_path / "policy"), env=env, iterations=4, eval_episodes=2,
                          delay=DelayConfig(kind="uniform", high=2, seed=3, estimate="measured"),
                          sac=SACConfig(batch_size=2, updates=2, hidden=16), output_dir=str(tmp_path / out),
                          **changes)  # fmt: skip

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
    resumed = run_dsrl(config("resumed"))
    assert [h["iteration"] for h in resumed["history"]] == [0, 1, 2, 3] and resumed["history"] == straight["history"]
    a, b = (load_file(str(tmp_path / out / "dsrl" / "model.safetensors")) for out in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="--checkpoint_every=1 or more"):
        run_dsrl(config("zero", checkpoint_every=0))
