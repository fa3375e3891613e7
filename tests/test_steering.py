"""RL²'s latent steering (`vla_rl.steering`, `vla-rl steer`): the chunk-level critic against the values of a toy
decision process worked by hand, the advantage-weighted flow policy against the weighted mean of its targets, the
gate on the observation-only latents and the composed velocity on a tiny flow policy (steered rows are the hand
integral of the composition, the others the unsteered chunk bit for bit), the collected decisions, and the
command end to end into `vla-rl eval` and serve's loader."""

import json
import math
from dataclasses import replace

import pytest
import torch
from tiny_policies import TASK, A, H, make_policy, save_lift_flow_policy

from vla_rl.steering import (
    MAX_WEIGHT,
    ChunkCritic,
    FailurePredictor,
    RLFlowPolicy,
    SteeredPolicy,
    Steering,
    advantage_weights,
    choose_threshold,
    observation_latents,
    train_critic,
    train_flow_policy,
    train_predictor,
)

B = 2


pytestmark = pytest.mark.usefixtures("one_thread")


def observation(batch: int = B) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"observation.images.front": torch.rand(batch, 3, 16, 16, generator=g),
            "observation.state": torch.randn(batch, 3, generator=g), "task": [TASK] * batch}  # fmt: skip


def test_advantage_weights_are_exp_of_the_advantage_over_beta_capped():
    """beta 0.05: A = 0.1 -> e^2, A = -0.1 -> e^-2; A = 1 -> e^20, capped at MAX_WEIGHT."""
    weights = advantage_weights(torch.tensor([0.1, -0.1, 1.0]), beta=0.05)
    assert weights[:2].tolist() == pytest.approx([math.exp(2.0), math.exp(-2.0)], rel=1e-5)
    assert weights[2].item() == MAX_WEIGHT


def test_the_threshold_maximizes_youdens_j_on_held_out_requests():
    """Failures at 0.9, 0.8, 0.3; successes at 0.7, 0.2, 0.1. Steering from 0.8 up: TPR 2/3, FPR 0 (J 0.667);
    from 0.3 up: TPR 1, FPR 1/3 (J 0.667 too): of equal J the higher threshold, 0.8. AUC: 8 of 9 pairs ordered."""
    prob = torch.tensor([0.9, 0.8, 0.3, 0.7, 0.2, 0.1])
    fail = torch.tensor([True, True, True, False, False, False])
    chosen = choose_threshold(prob, fail)
    assert chosen["tpr"] == pytest.approx(2 / 3) and chosen["fpr"] == 0.0 and chosen["auc"] == pytest.approx(8 / 9)
    assert chosen["threshold"] == pytest.approx(0.75) and (prob > chosen["threshold"]).tolist() == [1, 1, 0, 0, 0, 0]
    assert choose_threshold(prob, torch.zeros(6, dtype=torch.bool))["auc"] is None  # one class: no threshold


def two_request_episodes() -> dict[str, torch.Tensor]:
    """400 episodes of two requests. State A (z = [1, 0]) then state B (z = [0, 1]); each takes action +1 or -1
    (x0 of shape (1, 1)), half each. From A nothing is rewarded; at B, +1 succeeds in 80 of its 100 episodes of
    each A-action and -1 in 20: the reward 1 lands on B's request, which ends the episode."""
    rows = {"z": [], "x0": [], "reward": [], "next_z": [], "done": []}
    a_state, b_state = [1.0, 0.0], [0.0, 1.0]
    for k in range(400):
        a_action, b_action = (1.0 if k % 2 else -1.0), (1.0 if k // 200 == 0 else -1.0)
        success = (k % 200) // 2 < (80 if b_action > 0 else 20)  # 80 (or 20) of the 100 episodes of each A-action
        for z, x0, reward, next_z, done in ((a_state, a_action, 0.0, b_state, False),
                                            (b_state, b_action, float(success), b_state, True)):  # fmt: skip
            for name, value in zip(rows, (z, [[x0]], reward, next_z, done), strict=True):
                rows[name].append(value)
    return {k: torch.tensor(v) for k, v in rows.items()}


@pytest.mark.parametrize("expectile", [0.5, 0.9])
def test_the_critic_learns_the_toys_values_by_td_and_expectile(expectile):
    """Worked by hand, gamma 0.9. Q(B, +1) = 0.8, Q(B, -1) = 0.2 (the success rates: B ends the episode). V(B) is
    the tau-expectile of Q(B, .) over the data's actions, half each: tau 0.5 gives the mean, 0.5; tau 0.9 solves
    0.9 (0.8 - v) = 0.1 (v - 0.2), v = 0.74. Then Q(A, +-1) = 0 + 0.9 V(B) (0.45, 0.666), and V(A) the same."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    critic = ChunkCritic((1, 1), latent_dim=2, hidden=64)
    data = two_request_episodes()
    # Then a smaller step, so Adam settles on the whole set's values instead of following the last batches.
    for steps, lr in ((1500, 1e-3), (1000, 1e-4)):
        train_critic(critic, data, steps=steps, lr=lr, batch_size=512, gamma=0.9, expectile=expectile,
                     generator=generator, polyak=0.02)  # fmt: skip
    v_b = 0.5 if expectile == 0.5 else 0.74
    z = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    x0 = torch.tensor([1.0, -1.0, 1.0, -1.0]).view(4, 1, 1)
    with torch.no_grad():
        q, v = critic.q(z, x0), critic.v(z)
    assert q.tolist() == pytest.approx([0.8, 0.2, 0.9 * v_b, 0.9 * v_b], abs=0.03)
    assert v.tolist() == pytest.approx([v_b, v_b, 0.9 * v_b, 0.9 * v_b], abs=0.03)


def test_the_flow_policy_samples_the_advantage_weighted_mixture_of_its_chunks():
    """One state, chunks +1 and -1 (shape (1, 1)) in equal numbers, advantages +0.1 and -0.1 at beta 0.05: weights
    e^2 and e^-2, so the weighted data is +1 with probability e^2 / (e^2 + e^-2) = 0.982, mean 0.964. The trained
    flow's samples (Euler steps from N(0, 1)) have about that mean; with equal weights, about 0."""

    def sampled_mean(weights: torch.Tensor) -> float:
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        flow = RLFlowPolicy((1, 1), latent_dim=1, hidden=64)
        x0 = torch.tensor([1.0, -1.0] * 64).view(128, 1, 1)
        z = torch.zeros(128, 1)
        train_flow_policy(flow, z, x0, weights, steps=1500, lr=3e-3, batch_size=512, generator=generator)
        x = torch.randn(4000, 1, 1, generator=generator)
        with torch.no_grad():
            for k in range(20):
                x = x - flow(x, torch.full((4000,), 1.0 - k / 20), torch.zeros(4000, 1)) / 20
        return float(x.mean())

    sharp = advantage_weights(torch.tensor([0.1, -0.1] * 64), beta=0.05)
    expected = (math.exp(2) - math.exp(-2)) / (math.exp(2) + math.exp(-2))
    assert sampled_mean(sharp) == pytest.approx(expected, abs=0.08)
    assert sampled_mean(torch.ones(128)) == pytest.approx(0.0, abs=0.1)


def test_the_predictor_learns_which_latents_fail():
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(200, 4, generator=generator)
    fail = latents[:, 0] > 0  # a failure is written in the first latent
    predictor = FailurePredictor(4)
    losses = train_predictor(predictor, latents, fail, steps=300, lr=1e-2, batch_size=64, generator=generator)
    assert losses[-1] < 0.2 < losses[0]
    held = torch.randn(100, 4, generator=generator)
    assert choose_threshold(torch.sigmoid(predictor(held)).detach(), held[:, 0] > 0)["auc"] > 0.98


def normalized(actions: torch.Tensor) -> torch.Tensor:
    """Actions in the tiny policies' range ([-2, 2] and [0, 1]) in the sampler's normalized units, [-1, 1]."""
    low, high = torch.tensor([-2.0, 0.0]), torch.tensor([2.0, 1.0])
    return (actions - low) / (high - low) * 2 - 1


def steering_for(policy, fail_logits: list[float], c: float, weight: float = 1.0) -> tuple[Steering, list]:
    """A steering whose predictor says ``fail_logits`` per row (recording its input) and whose RL flow policy's
    velocity is the constant ``c``."""
    steering = Steering(tuple(policy.noise_shape), policy.latent_dim, hidden=8, threshold=0.5, weight=weight)
    seen = []
    steering.predictor.forward = lambda latents: seen.append(latents.clone()) or torch.tensor(fail_logits)
    with torch.no_grad():
        steering.flow.net[-1].weight.zero_()
        steering.flow.net[-1].bias.fill_(c)
    return steering, seen


@pytest.mark.parametrize("kind", ["diffusion-flow", "flow"])
def test_the_gate_reads_the_state_and_the_steered_rows_follow_the_composed_velocity(kind):
    """Row 0's failure logit +5 (p = 0.993 > 0.5) is steered, row 1's -5 is not: it is the unsteered chunk bit for
    bit from the same noise. The gate reads the observation-only latents (the expert's at x = 0, t = 1), the same
    for any noise. Steered with w: each Euler step's velocity is v + w (c - v), integrated here by hand over the
    velocity hook; w = 1 gives noise - c exactly. Always-mode steers both rows; weight 0 neither."""
    torch.manual_seed(0)
    policy = make_policy(kind)
    obs = observation()
    noise = torch.rand(B, H, A, generator=torch.Generator().manual_seed(2)) - 0.5
    free = policy.predict_chunk(obs, noise=noise).actions
    steering, seen = steering_for(policy, [5.0, -5.0], c=0.2)
    gated = SteeredPolicy(policy, steering, "gated").predict_chunk(obs, noise=noise)
    torch.testing.assert_close(gated.actions[1], free[1], rtol=0, atol=0)
    torch.testing.assert_close(normalized(gated.actions[0]), (noise[0] - 0.2).clamp(-1, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(seen[0], observation_latents(policy, obs), rtol=0, atol=0)
    torch.testing.assert_close(seen[0], policy.latents(obs, torch.zeros(B, H, A), 1.0), rtol=0, atol=1e-6)
    # w = 0.5: x <- x - (v + 0.5 (0.2 - v)) / n, by hand.
    half, _ = steering_for(policy, [5.0, -5.0], c=0.2, weight=0.5)
    n, x = policy.config.num_inference_steps, noise.clone()
    with torch.no_grad():
        for k in range(n):
            v = policy.velocity(obs, x, 1.0 - k / n)
            x = x - (v + 0.5 * (0.2 - v)) / n
    steered = normalized(SteeredPolicy(policy, half, "gated").predict_chunk(obs, noise=noise).actions)
    torch.testing.assert_close(steered[0], x[0].clamp(-1, 1), rtol=0, atol=1e-5)
    always = SteeredPolicy(policy, steering_for(policy, [5.0, -5.0], c=0.2)[0], "always").predict_chunk(
        obs, noise=noise
    )
    torch.testing.assert_close(normalized(always.actions), (noise - 0.2).clamp(-1, 1), rtol=0, atol=1e-5)
    off = SteeredPolicy(policy, steering_for(policy, [5.0, 5.0], c=0.2)[0], "gated", weight=0.0)
    torch.testing.assert_close(off.predict_chunk(obs, noise=noise).actions, free, rtol=0, atol=0)
    with pytest.raises(ValueError, match="steer mode must be one of"):
        SteeredPolicy(policy, steering_for(policy, [0.0, 0.0], 0.0)[0], "sometimes")


def test_the_noise_scaled_policy_samples_from_sigma_times_the_noise():
    """Given noise e: the chunk the base makes of 1.5 e, bit for bit; with none: 1.5 times the standard normal draw
    torch's stream gives next. A scale <= 0 and a policy without flow noise are refused, naming why."""
    from vla_rl.steering import NoiseScaledPolicy

    policy = make_policy("diffusion-flow")
    obs, noise = observation(), torch.randn(B, H, A, generator=torch.Generator().manual_seed(2))
    scaled = NoiseScaledPolicy(policy, 1.5)
    expected = policy.predict_chunk(obs, noise=1.5 * noise).actions
    torch.testing.assert_close(scaled.predict_chunk(obs, noise=noise).actions, expected, rtol=0, atol=0)
    assert (expected - policy.predict_chunk(obs, noise=noise).actions).abs().max() > 1e-3  # the scale shows
    torch.manual_seed(7)
    drawn = scaled.predict_chunk(obs).actions
    torch.manual_seed(7)
    torch.testing.assert_close(
        drawn, policy.predict_chunk(obs, noise=1.5 * torch.randn(B, H, A)).actions, rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="noise scale must be > 0"):
        NoiseScaledPolicy(policy, 0.0)
    with pytest.raises(ValueError, match="a noise scale needs a flow policy: .*--policy.objective=flow"):
        NoiseScaledPolicy(make_policy("diffusion"), 1.5)


def test_a_request_records_the_state_latents_and_the_samplers_end():
    """x0 is the sampler's end (an Euler integral over the velocity hook, by hand here) and z the observation-only
    latents."""
    from vla_rl.steer import record_request

    torch.manual_seed(0)
    policy = make_policy("diffusion-flow")
    obs = observation()
    _, record = record_request(policy, obs, torch.zeros(B, dtype=torch.long), torch.Generator().manual_seed(3))
    noise = torch.randn(B, H, A, generator=torch.Generator().manual_seed(3))  # the draw record_request made first
    n = policy.config.num_inference_steps
    x = noise.clone()
    with torch.no_grad():
        for k in range(n):
            x = x - policy.velocity(obs, x, 1.0 - k / n) / n
    torch.testing.assert_close(record["x0"], x, rtol=0, atol=1e-5)
    torch.testing.assert_close(record["z"], policy.latents(obs, torch.zeros(B, H, A), 1.0), rtol=0, atol=1e-6)


def test_the_requests_become_transitions_rewarded_at_a_successful_episodes_last():
    """Episodes 0 (3 requests, success), 1 (1 request, failure), 2 (2 requests, success): rewards 0 0 1 | 0 | 0 1,
    done at each episode's last, next_z the next request's latents within the episode."""
    from vla_rl.steer import decisions

    z = torch.arange(6, dtype=torch.float32).view(6, 1)
    data = {"z": z, "x0": torch.zeros(6, 1, 1), "episode": torch.tensor([0, 0, 0, 1, 2, 2]),
            "success": torch.tensor([True, True, True, False, True, True])}  # fmt: skip
    rows = decisions(data)
    assert rows["reward"].tolist() == [0, 0, 1, 0, 0, 1]
    assert rows["done"].tolist() == [False, False, True, True, False, True]
    assert rows["next_z"][[0, 1, 4], 0].tolist() == [1, 2, 5]


def test_the_weight_and_best_of_are_the_pair_of_the_highest_episode_success_of_equal_ones_the_smallest(monkeypatch):
    """Stubbed rollouts, 4 episodes a pair and setting over two settings, weights [2, 0.5, 1, 0] and best_of [1, 8]:
    (w, N) = (0, 8) wins 4 of 8, (0.5, 1) 5, (0.5, 8) 5, (1, 1) 6, (1, 8) 6, (2, 1) 6, (2, 8) 3: the highest rate is
    shared by three pairs, so the cheapest: the smallest N, then the smallest w: (1, 1). (0, 1) is the base, run for the record
    and never chosen: it wins 7 of 8, which the record flags (the steering hurts where it was chosen)."""
    import numpy as np

    from vla_rl import steer

    wins = {
        (0.0, 1): [4, 3],
        (0.0, 8): [2, 2],
        (0.5, 1): [3, 2],
        (0.5, 8): [2, 3],
        (1.0, 1): [3, 3],
        (1.0, 8): [4, 2],
        (2.0, 1): [4, 2],
        (2.0, 8): [1, 2],
    }  # by pair, per setting; fmt: skip
    calls = []

    def outcomes(cfg, policy, env):
        pair = (policy.weight, policy.best_of)
        calls.append((pair, cfg.env.variation, cfg.seed, cfg.episodes))
        k = wins[pair][len([c for c in calls if c[0] == pair]) - 1]
        return np.array([True] * k + [False] * (4 - k))

    class NoEnv:
        def __enter__(self):
            return None

        def __exit__(self, *_):
            return False

    monkeypatch.setattr(steer, "rollout_outcomes", outcomes)
    monkeypatch.setattr("sim.factory.make_env", lambda env_cfg: NoEnv())
    policy = make_policy("diffusion-flow")
    steering = Steering(tuple(policy.noise_shape), policy.latent_dim, hidden=8)
    from sim.config import EnvConfig

    cfg = steer.SteerConfig(env=EnvConfig(), variations=["", "camera"], weights=[2.0, 0.5, 1.0, 0.0], best_of=[1, 8],
                            choose_episodes=4, seed=7000)  # fmt: skip
    chosen = steer.choose_weight(cfg, policy, steering)
    assert chosen == {"chosen": 1.0, "best_of": 1, "base_better": True,
                      "success": {"base": 0.875, "w=0,best_of=8": 0.5, "w=0.5,best_of=1": 0.625,
                                  "w=0.5,best_of=8": 0.625, "w=1,best_of=1": 0.75, "w=1,best_of=8": 0.75,
                                  "w=2,best_of=1": 0.75, "w=2,best_of=8": 0.375}}  # fmt: skip
    assert (steering.weight, steering.best_of) == (1.0, 1)
    assert {(c[1], c[2], c[3]) for c in calls} == {("", 7500, 4), ("camera", 7500, 4)}
    assert len(calls) == 2 * 8  # every pair and the base, in both settings


def test_vla_rl_steer_collects_trains_and_eval_serves_the_steered_policy(tmp_path):
    """A random flow `diffusion` policy on lift (8 steps an episode, 2 worlds): 6 episodes collected, the critic,
    the RL flow policy and the gate trained, the weight chosen on 2 episodes each, all written; `vla-rl eval
    --steer.dir` and serve's loader load them and run; a steering of the earlier format is refused in one line."""
    from sim.config import EnvConfig
    from vla_rl.eval import EvalConfig, SteerEvalConfig, evaluate
    from vla_rl.steer import SteerConfig, run_steer

    policy = save_lift_flow_policy(tmp_path / "policy", image_size=32)
    env = EnvConfig(num_envs=2, max_episode_steps=8, image_size=32, num_threads=1, render_threads=1, variation="colour")
    summary = run_steer(SteerConfig(checkpoint=str(tmp_path / "policy"), env=env, episodes=6, held_out_fraction=0.34,
                                    predictor_steps=5, critic_steps=5, flow_steps=5, batch_size=8, hidden=16,
                                    choose_episodes=2, output_dir=str(tmp_path / "steer")))  # fmt: skip
    # 8 steps in chunks of 4 steps executed: two requests an episode (at steps 0 and 4), 3 episodes in each of the 2
    # worlds (the worlds' further episodes are not written), none succeeds in 8 steps.
    assert (summary["requests"], summary["episodes"], summary["held_out_episodes"]) == (12, 6, 2)
    assert summary["episode_success_rate"] == summary["request_success_rate"] == 0.0
    assert summary["gate"]["threshold"] == 0.5  # one class: no threshold to fit
    # Every pair failed its 2 episodes: of equal rates the cheapest (N = 1, then the smallest w).
    assert summary["weights"] == {"chosen": 0.5, "best_of": 1, "base_better": False,
                                  "success": {"base": 0.0, **dict.fromkeys(["w=0.5,best_of=1", "w=1,best_of=1",
                                              "w=0,best_of=8", "w=0.5,best_of=8", "w=1,best_of=8"], 0.0)}}  # fmt: skip
    # The rollouts are a LeRobotDataset: one episode per rollout, one frame per request, the steer.* features.
    from vla_core.data import open_dataset
    from vla_rl.steer import load_rollouts

    rollouts = open_dataset(tmp_path / "steer" / "rollouts")
    assert (rollouts.meta.total_episodes, rollouts.meta.total_frames) == (6, 12)
    frame = rollouts[0]
    assert frame["observation.images.front"].shape == (3, 32, 32) and frame["steer.chunk"].shape == (8, 4)
    assert frame["steer.x0"].shape == (8, 4) and frame["steer.z"].shape == (policy.latent_dim,)
    assert not frame["steer.success"]
    data = load_rollouts(tmp_path / "steer" / "rollouts")
    assert data["z"].shape == (12, policy.latent_dim) and data["x0"].shape == (12, 8, 4)
    assert data["episode"].tolist() == [e for e in range(6) for _ in range(2)]
    assert data["obs_step"].tolist() == [0, 4] * 6 and data["setting"].tolist() == [0] * 12
    assert not data["success"].any()
    with pytest.raises(ValueError, match="was collected with another seed"):  # resumed under another setting
        run_steer(SteerConfig(checkpoint=str(tmp_path / "policy"), env=env, episodes=6, seed=1,
                              output_dir=str(tmp_path / "steer")))  # fmt: skip
    # Other threads and renderers go on from the rollouts (they change how the worlds are computed, not what), also
    # against a collection written when every field of the env was kept; the rollouts are read, not collected again.
    made_with = tmp_path / "steer" / "rollouts" / "meta" / "vla_rl_steer_collection.json"
    old = json.loads(made_with.read_text())
    made_with.write_text(json.dumps({**old, "env": {**old["env"], "num_threads": 1, "render_threads": 1}}))
    collected = (tmp_path / "steer" / "rollouts" / "meta" / "info.json").stat().st_ino
    again = run_steer(SteerConfig(checkpoint=str(tmp_path / "policy"), episodes=6, held_out_fraction=0.34,
                                  env=replace(env, render_isolation="thread", render_threads=2, num_threads=2),
                                  predictor_steps=5, critic_steps=5, flow_steps=5, batch_size=8, hidden=16,
                                  choose_episodes=2, output_dir=str(tmp_path / "steer")))  # fmt: skip
    assert again["requests"] == 12
    assert (tmp_path / "steer" / "rollouts" / "meta" / "info.json").stat().st_ino == collected
    saved = json.loads((tmp_path / "steer" / "steering" / "config.json").read_text())
    assert saved["noise_shape"] == [8, 4] and saved["threshold"] == 0.5 and saved["weight"] == 0.5
    assert (saved["version"], saved["best_of"], saved["executed"]) == (3, 1, [4, 4])  # the critic reads 4 rows
    result = evaluate(EvalConfig(checkpoint=str(tmp_path / "policy"), env=env, num_episodes=2, video_episodes=0,
                                 steer=SteerEvalConfig(dir=str(tmp_path / "steer" / "steering"), mode="always"),
                                 output_dir=str(tmp_path / "eval")))  # fmt: skip
    assert len(result["per_episode"]) == 2 and result["config"]["steer"]["mode"] == "always"
    # Best-of-2 through eval (its selection is checked by hand in the test of `SteeredPolicy.select`); the record
    # names the steering's files, so a steering trained again in the same folder is not resumed as this one.
    best = evaluate(EvalConfig(checkpoint=str(tmp_path / "policy"), env=env, num_episodes=2, video_episodes=0,
                               steer=SteerEvalConfig(dir=str(tmp_path / "steer" / "steering"), mode="always",
                                                     best_of=2), output_dir=str(tmp_path / "eval_best")))  # fmt: skip
    assert len(best["per_episode"]) == 2 and best["config"]["steer"]["best_of"] == 2
    from vla_rl.eval import files_sha256, identity

    steered_identity = identity(EvalConfig(steer=SteerEvalConfig(dir=str(tmp_path / "steer" / "steering"))), "sha")
    assert steered_identity["steering_sha256"] == files_sha256(tmp_path / "steer" / "steering")
    # serve and the policy server load the same composition in their inference process.
    from robot_bridge.config import ServeConfig
    from robot_bridge.inference import policy_info
    from vla_rl.cli import _loader

    served = _loader(ServeConfig(checkpoint=str(tmp_path / "policy"), steer_dir=str(tmp_path / "steer" / "steering"),
                                 steer_mode="always"))()  # fmt: skip
    assert isinstance(served, SteeredPolicy) and served.mode == "always" and served.weight == 0.5  # the chosen
    assert served.best_of == 1  # the chosen N
    served = _loader(ServeConfig(checkpoint=str(tmp_path / "policy"), steer_dir=str(tmp_path / "steer" / "steering"),
                                 steer_best_of=4))()  # fmt: skip
    assert served.best_of == 4
    assert policy_info(served)["noise_shape"] == (8, 4) and policy_info(served)["horizon"] == 8
    with pytest.raises(ValueError, match="steer nothing without --steer.dir"):
        evaluate(EvalConfig(checkpoint=str(tmp_path / "policy"), env=env, num_episodes=2, video_episodes=0,
                            steer=SteerEvalConfig(mode="always"), output_dir=str(tmp_path / "eval_unsteered")))  # fmt: skip
    # Another base (one weight changed) is refused, naming the checkpoint the steering was trained on.
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    policy.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"trained on another base policy .* steer .*policy"):
        evaluate(EvalConfig(checkpoint=str(tmp_path / "other"), env=env, num_episodes=2, video_episodes=0,
                            steer=SteerEvalConfig(dir=str(tmp_path / "steer" / "steering")),
                            output_dir=str(tmp_path / "eval_other")))  # fmt: skip
    # A steering written by the earlier `vla-rl steer` (no version): refused, naming the fix.
    del saved["version"]
    (tmp_path / "steer" / "steering" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"earlier vla-rl steer .* train it again with `vla-rl steer`"):
        Steering.load(tmp_path / "steer" / "steering")


def test_a_policy_without_a_flow_velocity_is_refused_naming_the_fix():
    from vla_rl.steering import check_steerable

    with pytest.raises(ValueError, match="steering needs a flow policy: .*--policy.objective=flow"):
        check_steerable(make_policy("diffusion"))
    check_steerable(make_policy("diffusion-flow"))  # a flow policy passes


def test_best_of_n_runs_the_candidate_the_critic_ranks_first_in_the_steered_rows():
    """Row 0 gated (logit +5), row 1 not. With w = 1 and the RL velocity the constant 0.2, a candidate's end is its
    noise - 0.2 exactly (the composed velocity is 0.2 at every step). The critic's Q is stubbed to x_0[:, 0, 0]:
    of N = 4 candidates (the first from the request's noise, three drawn from torch's stream after the seed), row 0
    runs the one whose noise has the largest first value, and the critic saw each candidate's end; row 1 is the
    unsteered chunk bit for bit. A request's real-time-chunking guidance reaches each of its candidates."""
    torch.manual_seed(0)
    policy = make_policy("diffusion-flow")
    obs = observation()
    noise = torch.rand(B, H, A, generator=torch.Generator().manual_seed(2)) - 0.5
    free = policy.predict_chunk(obs, noise=noise).actions
    steering, _ = steering_for(policy, [5.0, -5.0], c=0.2)
    seen = []
    steering.critic.q = lambda z, x0: seen.append(x0.clone()) or x0[:, 0, 0]
    torch.manual_seed(3)
    chunk = SteeredPolicy(policy, steering, "gated", best_of=4).predict_chunk(obs, noise=noise)
    torch.manual_seed(3)
    candidates = torch.randn(4, H, A)  # one steered row, 4 candidates drawn from the stream after the seed,
    candidates[0] = noise[0]  # the first from the request's own noise
    torch.testing.assert_close(seen[0], candidates - 0.2, rtol=0, atol=1e-5)
    best = candidates[candidates[:, 0, 0].argmax()]
    torch.testing.assert_close(normalized(chunk.actions[0]), (best - 0.2).clamp(-1, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(chunk.actions[1], free[1], rtol=0, atol=0)
    # No row gated: nothing is sampled beyond the one chunk (the critic is never asked).
    seen.clear()
    quiet, _ = steering_for(policy, [-5.0, -5.0], c=0.2)
    quiet.critic.q = steering.critic.q
    torch.testing.assert_close(SteeredPolicy(policy, quiet, "gated", best_of=4).predict_chunk(obs, noise=noise).actions,
                               free, rtol=0, atol=0)  # fmt: skip
    assert not seen
    with pytest.raises(ValueError, match="best_of=0: it must be >= 1"):
        SteeredPolicy(policy, steering, "gated", best_of=0)
    # Guidance (target (B, H, A), weights (B, H)): the candidates' call gets row 0's, repeated for its 4 candidates.
    calls = []
    plain = policy.predict_chunk
    policy.predict_chunk = lambda *args, **kwargs: calls.append(kwargs) or plain(*args, **kwargs)
    target, weights = torch.rand(B, H, A), torch.rand(B, H)
    SteeredPolicy(policy, steering, "gated", best_of=4).predict_chunk(obs, noise=noise, inpaint=(target, weights))
    repeated = calls[-1]["inpaint"]
    torch.testing.assert_close(repeated[0], target[[0, 0, 0, 0]], rtol=0, atol=0)
    torch.testing.assert_close(repeated[1], weights[[0, 0, 0, 0]], rtol=0, atol=0)
    with pytest.raises(ValueError, match="prepared request cannot be repeated per candidate"):
        SteeredPolicy(policy, steering, "gated", best_of=4).predict_chunk(obs, prepared={"cond": None})


def test_a_steering_saved_without_its_critic_loads_and_refuses_best_of_n(tmp_path):
    """A version-2 steering (before best-of-N: no critic in its files) still steers by composition; asking it for
    candidates names the fix."""
    from safetensors.torch import load_file, save_file

    policy = make_policy("diffusion-flow")
    Steering(tuple(policy.noise_shape), policy.latent_dim, hidden=8, weight=0.5).save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("best_of", "executed"):
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps({**config, "version": 2}))
    weights = load_file(str(tmp_path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("critic.")}, str(tmp_path / "model.safetensors"))
    old = Steering.load(tmp_path)
    assert old.critic is None and old.best_of == 1 and old.weight == 0.5
    assert SteeredPolicy(policy, old, "gated").best_of == 1
    with pytest.raises(ValueError, match="needs the critic .* train it again with `vla-rl steer`"):
        SteeredPolicy(policy, old, "gated", best_of=8)
