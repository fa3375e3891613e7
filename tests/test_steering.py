"""RL²'s latent steering (`vla_rl.steering`, `vla-rl steer`): the learner's pieces against hand-worked values, the
gate on a tiny flow policy (steered rows move, the others are the unsteered chunk bit for bit), the collected
regression samples against an Euler integral written here, and the command end to end into `vla-rl eval`."""

import json
import math

import pytest
import torch
from tiny_policies import TASK, A, H, make_policy, save_lift_flow_policy

from vla_rl.steering import (
    MAX_WEIGHT,
    FailurePredictor,
    SteeredPolicy,
    Steering,
    SteeringField,
    advantage_weights,
    choose_threshold,
    train_field,
    train_predictor,
)

B = 2


pytestmark = pytest.mark.usefixtures("one_thread")


def observation(batch: int = B) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"observation.images.front": torch.rand(batch, 3, 16, 16, generator=g),
            "observation.state": torch.randn(batch, 3, generator=g), "task": [TASK] * batch}  # fmt: skip


def test_advantage_weights_are_exp_of_return_minus_value_over_beta_capped():
    """Success with p_fail = 0.5 (V = 0.5): exp(0.5 / 0.5) = e; failure: exp(-1); V = 0 (logit +inf-ish) and
    success at beta 0.1: exp(10) capped at 20."""
    weights = advantage_weights(torch.tensor([1, 0, 1]), torch.tensor([0.0, 0.0, 30.0]), beta=0.5)
    assert weights[:2].tolist() == pytest.approx([math.e, math.exp(-1.0)])
    assert advantage_weights(torch.tensor([1]), torch.tensor([30.0]), beta=0.1).item() == MAX_WEIGHT


def test_the_threshold_maximizes_youdens_j_on_held_out_requests():
    """Failures at 0.9, 0.8, 0.3; successes at 0.7, 0.2, 0.1. Steering from 0.8 up: TPR 2/3, FPR 0 (J 0.667);
    from 0.3 up: TPR 1, FPR 1/3 (J 0.667 too): of equal J the higher threshold, 0.8. AUC: 8 of 9 pairs ordered."""
    prob = torch.tensor([0.9, 0.8, 0.3, 0.7, 0.2, 0.1])
    fail = torch.tensor([True, True, True, False, False, False])
    chosen = choose_threshold(prob, fail)
    assert chosen["tpr"] == pytest.approx(2 / 3) and chosen["fpr"] == 0.0 and chosen["auc"] == pytest.approx(8 / 9)
    assert chosen["threshold"] == pytest.approx(0.75) and (prob > chosen["threshold"]).tolist() == [1, 1, 0, 0, 0, 0]
    assert choose_threshold(prob, torch.zeros(6, dtype=torch.bool))["auc"] is None  # one class: no threshold


def test_the_field_fits_the_advantage_weighted_mean_of_its_targets():
    """One input, targets +1 (successes) and -1 (failures) in equal numbers, V = 0.5 for all, beta 1: the
    weighted mean is (e^0.5 - e^-0.5) / (e^0.5 + e^-0.5) = tanh(0.5) = 0.4621."""
    n = 64
    success = torch.arange(n) % 2 == 0
    data = {"x_t": torch.zeros(n, 1, 1), "t": torch.full((n,), 0.5), "latents": torch.zeros(n, 2),
            "residual": torch.where(success, 1.0, -1.0).view(n, 1, 1)}  # fmt: skip
    weights = advantage_weights(success, torch.zeros(n), beta=1.0)
    field = SteeringField((1, 1), latent_dim=2, hidden=16)
    generator = torch.Generator().manual_seed(0)
    # Batches of 4,096 drawn with replacement (their weighted mean within about 0.01 of the whole set's), then a
    # smaller step so Adam settles instead of following the last batch.
    train_field(field, data, weights, steps=300, lr=1e-2, batch_size=4096, generator=generator)
    train_field(field, data, weights, steps=200, lr=1e-3, batch_size=4096, generator=generator)
    assert field(data["x_t"][:1], data["t"][:1], data["latents"][:1]).item() == pytest.approx(math.tanh(0.5), abs=0.02)


def test_the_predictor_learns_which_latents_fail():
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(200, 4, generator=generator)
    fail = latents[:, 0] > 0  # a failure is written in the first latent
    predictor = FailurePredictor(4)
    losses = train_predictor(predictor, latents, fail, steps=300, lr=1e-2, batch_size=64, generator=generator)
    assert losses[-1] < 0.2 < losses[0]
    held = torch.randn(100, 4, generator=generator)
    assert choose_threshold(torch.sigmoid(predictor(held)).detach(), held[:, 0] > 0)["auc"] > 0.98


def steering_for(policy, fail_logits: list[float], shift: float) -> Steering:
    """A steering whose predictor says ``fail_logits`` per row and whose field is the constant ``shift``."""
    steering = Steering(tuple(policy.noise_shape), policy.latent_dim, hidden=8, threshold=0.5)
    steering.predictor.forward = lambda latents: torch.tensor(fail_logits)
    with torch.no_grad():
        steering.field.net[-1].bias.fill_(shift)
    return steering


@pytest.mark.parametrize("kind", ["diffusion-flow", "flow"])
def test_the_gate_steers_only_the_rows_expected_to_fail(kind):
    """Row 0's failure logit +5 (p = 0.993 > 0.5) is steered, row 1's -5 is not: it is the unsteered chunk bit for
    bit from the same noise; always-mode steers both, and weight 0 neither."""
    torch.manual_seed(0)
    policy = make_policy(kind)
    obs, noise = observation(), torch.randn(B, H, A)
    free = policy.predict_chunk(obs, noise=noise).actions
    gated = SteeredPolicy(policy, steering_for(policy, [5.0, -5.0], shift=0.3), "gated").predict_chunk(obs, noise=noise)
    torch.testing.assert_close(gated.actions[1], free[1], rtol=0, atol=0)
    assert (gated.actions[0] - free[0]).abs().max() > 1e-3
    always = SteeredPolicy(policy, steering_for(policy, [5.0, -5.0], shift=0.3), "always").predict_chunk(
        obs, noise=noise
    )
    assert (always.actions - free).abs().flatten(1).max(1).values.min() > 1e-3
    off = SteeredPolicy(policy, steering_for(policy, [5.0, 5.0], shift=0.3), "gated", weight=0.0)
    torch.testing.assert_close(off.predict_chunk(obs, noise=noise).actions, free, rtol=0, atol=0)
    with pytest.raises(ValueError, match="steer mode must be one of"):
        SteeredPolicy(policy, steering_for(policy, [0.0, 0.0], 0.0), "sometimes")


def test_a_request_records_its_regression_samples_on_the_straight_path_of_its_own_chunk():
    """x_0 is the sampler's end (an Euler integral over the velocity hook, by hand here); each sample lies on the
    straight path x_t = t e + (1 - t) x_0 and its residual is (e - x_0) - v(x_t, t)."""
    from vla_rl.steer import record_request

    torch.manual_seed(0)
    policy = make_policy("diffusion-flow")
    obs = observation()
    _, record = record_request(policy, obs, torch.zeros(B, dtype=torch.long), 2, torch.Generator().manual_seed(3))
    noise = torch.randn(B, H, A, generator=torch.Generator().manual_seed(3))  # the draw record_request made first
    n = policy.config.num_inference_steps
    x = noise.clone()
    with torch.no_grad():
        for k in range(n):
            x = x - policy.velocity(obs, x, 1.0 - k / n) / n
        for s in range(2):
            t = record["t"][:, s]
            tt = t.view(-1, 1, 1)
            torch.testing.assert_close(record["x_t"][:, s], tt * noise + (1 - tt) * x, rtol=0, atol=1e-5)
            expected = (noise - x) - policy.velocity(obs, record["x_t"][:, s], t)
            torch.testing.assert_close(record["residual"][:, s], expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(record["gate"], policy.latents(obs, noise, 1.0), rtol=0, atol=1e-6)


def test_vla_rl_steer_collects_trains_and_eval_serves_the_steered_policy(tmp_path):
    """A random flow `diffusion` policy on lift (4 steps an episode, 2 worlds): 6 episodes collected, the gate and
    the field trained and written; `vla-rl eval --steer.dir` loads them and runs."""
    from sim.config import EnvConfig
    from vla_rl.eval import EvalConfig, SteerEvalConfig, evaluate
    from vla_rl.steer import SteerConfig, run_steer

    policy = save_lift_flow_policy(tmp_path / "policy", image_size=32)
    env = EnvConfig(num_envs=2, max_episode_steps=8, image_size=32, num_threads=1, render_threads=1, variation="colour")
    summary = run_steer(SteerConfig(checkpoint=str(tmp_path / "policy"), env=env, episodes=6, samples_per_chunk=1,
                                    held_out_fraction=0.34, predictor_steps=5, field_steps=5, batch_size=8, hidden=16,
                                    output_dir=str(tmp_path / "steer")))  # fmt: skip
    # 8 steps in chunks of 4 steps executed: two requests an episode (at steps 0 and 4), 3 episodes in each of the 2
    # worlds (the worlds' further episodes are not written), none succeeds in 8 steps.
    assert (summary["requests"], summary["episodes"], summary["held_out_episodes"]) == (12, 6, 2)
    assert summary["success_rate"] == 0.0 and summary["gate"]["threshold"] == 0.5  # one class: no threshold to fit
    # The rollouts are a LeRobotDataset: one episode per rollout, one frame per request, the steer.* features.
    from vla_core.data import open_dataset
    from vla_rl.steer import load_rollouts

    rollouts = open_dataset(tmp_path / "steer" / "rollouts")
    assert (rollouts.meta.total_episodes, rollouts.meta.total_frames) == (6, 12)
    frame = rollouts[0]
    assert frame["observation.images.front"].shape == (3, 32, 32) and frame["steer.chunk"].shape == (8, 4)
    assert frame["steer.x_t"].shape == frame["steer.residual"].shape == (1, 8, 4) and not frame["steer.success"]
    data = load_rollouts(tmp_path / "steer" / "rollouts")
    assert data["t"].shape == (12, 1) and data["latents"].shape == (12, 1, policy.latent_dim)
    assert data["episode"].tolist() == [e for e in range(6) for _ in range(2)]
    assert data["obs_step"].tolist() == [0, 4] * 6 and data["setting"].tolist() == [0] * 12
    assert ((data["t"] >= 0) & (data["t"] <= 1)).all() and not data["success"].any()
    with pytest.raises(ValueError, match="was collected with another seed"):  # resumed under another setting
        run_steer(SteerConfig(checkpoint=str(tmp_path / "policy"), env=env, episodes=6, seed=1,
                              output_dir=str(tmp_path / "steer")))  # fmt: skip
    saved = json.loads((tmp_path / "steer" / "steering" / "config.json").read_text())
    assert saved["noise_shape"] == [8, 4] and saved["threshold"] == 0.5
    result = evaluate(EvalConfig(checkpoint=str(tmp_path / "policy"), env=env, num_episodes=2, video_episodes=0,
                                 steer=SteerEvalConfig(dir=str(tmp_path / "steer" / "steering"), mode="always"),
                                 output_dir=str(tmp_path / "eval")))  # fmt: skip
    assert len(result["per_episode"]) == 2 and result["config"]["steer"]["mode"] == "always"
    # serve and the policy server load the same composition in their inference process.
    from robot_bridge.config import ServeConfig
    from robot_bridge.inference import policy_info
    from vla_rl.cli import _loader

    served = _loader(ServeConfig(checkpoint=str(tmp_path / "policy"), steer_dir=str(tmp_path / "steer" / "steering"),
                                 steer_mode="always"))()  # fmt: skip
    assert isinstance(served, SteeredPolicy) and served.mode == "always"
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


def test_a_policy_without_a_flow_velocity_is_refused_naming_the_fix():
    from vla_rl.steering import check_steerable

    with pytest.raises(ValueError, match="steering needs a flow policy: .*--policy.objective=flow"):
        check_steerable(make_policy("diffusion"))
    check_steerable(make_policy("diffusion-flow"))  # a flow policy passes
