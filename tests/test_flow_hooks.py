"""The flow objective of the small ``diffusion`` policy, and the steering hooks of vla-rl's own flow policies
(`vla_core.types.FlowSteerable`: ``velocity``, ``latents``, ``noise_shape``, ``predict_chunk(noise=, steer=)``).

Expected values are worked out here, not read back from the sampler under test: the flow loss from its
definition, chunks by a hand-written Euler loop over the ``velocity`` hook, the shift of a constant steer
from the Euler sum. LeRobot's flow VLAs get the same checks in ``test_lerobot_vla.py``.
"""

import dataclasses
import json

import pytest
import torch
from tiny_policies import ACTION_MAX, ACTION_MIN, TASK, A, H, make_policy, save_lift_flow_policy

from policies.pretrained import PreTrainedPolicy
from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK, OBS_DELAY_STEPS, FlowSteerable

B = 2
FLOW_KINDS = ["diffusion-flow", "flow"]  # the small policy and the VLA, flow objective
FIX = "train with --policy.objective=flow"

# Sample 0 commits 2 chunk steps, sample 1 commits 3 (the values are in dataset units).
COMMITTED = torch.tensor([[[0.5, 0.25], [-1.5, 0.9], [9.0, 9.0]], [[1.9, 0.1], [1.0, 0.7], [-0.3, 0.3]]])
MASK = torch.tensor([[True, True, False], [True, True, True]])
KNOWN = torch.tensor([[True, True, False, False, False, False], [True, True, True, False, False, False]])


pytestmark = pytest.mark.usefixtures("one_thread")


def observation(delayed: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    obs = {"observation.images.front": torch.rand(B, 3, 16, 16, generator=g),
           "observation.state": torch.randn(B, 3, generator=g), "task": [TASK] * B}  # fmt: skip
    if delayed:
        obs |= {OBS_COMMITTED_ACTIONS: COMMITTED, OBS_COMMITTED_MASK: MASK, OBS_DELAY_STEPS: MASK.sum(1)}
    return obs


def normalized(actions: torch.Tensor) -> torch.Tensor:
    """Dataset units -> [-1, 1] with the tiny policies' min/max, written out."""
    low, high = torch.tensor(ACTION_MIN), torch.tensor(ACTION_MAX)
    return (actions - low) / (high - low) * 2 - 1


def unnormalized(x: torch.Tensor) -> torch.Tensor:
    low, high = torch.tensor(ACTION_MIN), torch.tensor(ACTION_MAX)
    return (x + 1) / 2 * (high - low) + low


def euler_by_hand(policy, obs, noise, extra=None) -> torch.Tensor:
    """The chunk (normalized, unclamped) of n Euler steps of 1/n from t = 1 over the ``velocity`` hook:
    x <- x - (v(x, t) + extra) / n at t = 1 - k / n."""
    n = policy.config.num_inference_steps
    x = noise.clone()
    with torch.no_grad():
        for k in range(n):
            v = policy.velocity(obs, x, 1.0 - k / n)
            x = x - (v + (0 if extra is None else extra)) / n
    return x


# -- the flow objective of the small policy -----------------------------------------------------------


def test_the_small_policys_flow_loss_regresses_the_velocity_at_the_drawn_time(monkeypatch):
    policy = make_policy("diffusion-flow").train()
    seen = {}

    def denoiser(noisy, t, cond, known=None):  # a prediction that reads x_t, so the loss depends on t
        seen["t"] = t
        return 0.5 * noisy

    monkeypatch.setattr(policy, "denoise", denoiser)
    g = torch.Generator().manual_seed(3)
    actions = torch.rand(B, H, A, generator=g) * torch.tensor([4.0, 1.0]) + torch.tensor([-2.0, 0.0])
    pad = torch.zeros(B, H, dtype=torch.bool)
    pad[1, 4:] = True  # sample 1's episode ends after 4 steps
    loss = policy({**observation(), "action": actions, "action_is_pad": pad}, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)  # forward()'s draws: the noise, then one time per frame
    noise = torch.randn(B, H, A, generator=g)
    t = torch.rand(B, generator=g)
    x0 = normalized(actions)
    x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * x0
    err = (0.5 * x_t - (noise - x0)).square().mean(-1)  # (B, H) against the velocity noise - x_0
    expected = (err[0].sum() + err[1, :4].sum()) / 10  # the 10 rows that are not padding
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.equal(seen["t"], t)


def test_a_tiny_flow_diffusion_policy_fits_a_fixed_batch():
    torch.manual_seed(0)
    policy = make_policy("diffusion-flow").train()
    g = torch.Generator().manual_seed(3)
    actions = torch.rand(4, H, A, generator=g) * torch.tensor([4.0, 1.0]) + torch.tensor([-2.0, 0.0])
    obs = {"observation.images.front": torch.rand(4, 3, 16, 16, generator=g),
           "observation.state": torch.randn(4, 3, generator=g), "task": [TASK] * 4}  # fmt: skip
    batch = {**obs, "action": actions, "action_is_pad": torch.zeros(4, H, dtype=torch.bool)}

    def loss() -> torch.Tensor:  # one fixed draw of noise and times
        return policy(batch, torch.Generator().manual_seed(0))

    before = loss().item()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=2e-3)
    for step in range(150):
        optimizer.zero_grad()
        policy(batch, torch.Generator().manual_seed(step)).backward()
        optimizer.step()
    after = loss().item()
    assert after < 0.3 * before, (before, after)


def test_the_objective_flag_defaults_to_ddpm_and_old_configs_load_as_ddpm(tmp_path):
    from vla_rl.cli import parse_config

    assert parse_config("train", []).policy.objective == "ddpm"  # the small policy's objective as before
    assert parse_config("train", ["--policy.objective=flow"]).policy.objective == "flow"
    assert parse_config("train", ["--policy.type=diffusion_vla"]).policy.objective == "flow"  # the VLA's, as before
    with pytest.raises(ValueError, match=r"policy.objective must be one of \('flow', 'ddpm'\), got 'epsilon'"):
        dataclasses.replace(make_policy("diffusion").config, objective="epsilon").validate()
    # A config.json written before the field existed (test_compat.py holds a real 0.2 one) loads as ddpm.
    policy = make_policy("diffusion")
    policy.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.pop("objective") == "ddpm" and saved.pop("rtc_max_guidance") == 5.0
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = PreTrainedPolicy.from_pretrained(tmp_path)
    noise = torch.randn(B, H, A, generator=torch.Generator().manual_seed(2))
    assert loaded.config.objective == "ddpm" and not loaded.supports_inpainting
    assert torch.equal(loaded.predict_chunk(observation(), noise=noise).actions,
                       policy.predict_chunk(observation(), noise=noise).actions)  # fmt: skip
    flow = make_policy("diffusion-flow")
    flow.save_pretrained(tmp_path / "flow")
    again = PreTrainedPolicy.from_pretrained(tmp_path / "flow")
    assert again.config.objective == "flow" and again.supports_inpainting
    assert torch.equal(again.predict_chunk(observation(), noise=noise).actions,
                       flow.predict_chunk(observation(), noise=noise).actions)  # fmt: skip


# -- the hooks: velocity, latents, steer ---------------------------------------------------------------


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_predict_chunk_is_the_euler_integral_of_the_velocity_hook(kind, delayed):
    policy = make_policy(kind, max_delay_steps=3 if delayed else 0)
    assert isinstance(policy, FlowSteerable) and policy.noise_shape == (H, A)
    obs, noise = observation(delayed), torch.randn(B, H, A, generator=torch.Generator().manual_seed(2))
    expected = unnormalized(euler_by_hand(policy, obs, noise).clamp(-1, 1))
    if delayed:  # the committed rows are the committed actions exactly
        expected[:, :3] = torch.where(MASK[..., None], COMMITTED, expected[:, :3])
    torch.testing.assert_close(policy.predict_chunk(obs, noise=noise).actions, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_a_steer_is_added_to_every_euler_step_with_the_steps_latents(kind):
    policy = make_policy(kind)
    n = policy.config.num_inference_steps
    obs, noise = observation(), torch.randn(B, H, A, generator=torch.Generator().manual_seed(2))
    c = torch.rand(B, H, A, generator=torch.Generator().manual_seed(4)) * 0.6 - 0.3
    calls = []

    def steer(x_t, t, latents):
        calls.append((x_t.clone(), t.clone(), latents.clone()))
        return c

    steered = policy.predict_chunk(obs, noise=noise, steer=steer).actions
    expected = unnormalized(euler_by_hand(policy, obs, noise, extra=c).clamp(-1, 1))
    torch.testing.assert_close(steered, expected, rtol=0, atol=1e-6)
    times = torch.stack([t for _, t, _ in calls])  # (n, B): t_k = 1 - k / n for every sample, float32
    assert torch.equal(times, torch.tensor([[1.0 - k / n] * B for k in range(n)]))
    for x_t, t, latents in calls:  # the latents are the hook's at that step's state
        torch.testing.assert_close(latents, policy.latents(obs, x_t, t), rtol=0, atol=1e-6)
    torch.testing.assert_close(calls[0][0], noise)


@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_a_constant_steer_shifts_the_chunk_by_minus_itself_when_the_velocity_ignores_x(kind):
    """x <- x - (v(t) + c) / n over n steps: the steered chunk is the free one minus c (normalized units)."""
    policy = make_policy(kind)
    with torch.no_grad():  # the velocity no longer reads x, and stays small: the chunks stay inside [-1, 1]
        first, last = (policy.input_proj, policy.output_proj[1]) if kind.startswith("diffusion") else (
            policy.dit.action_in, policy.dit.action_out)  # fmt: skip
        first.weight.zero_()
        last.weight.mul_(0.01)
        last.bias.mul_(0.01)
    obs = observation()
    noise = torch.rand(B, H, A, generator=torch.Generator().manual_seed(2)) - 0.5
    c = torch.rand(B, H, A, generator=torch.Generator().manual_seed(4)) * 0.6 - 0.3
    free = normalized(policy.predict_chunk(obs, noise=noise).actions)
    steered = normalized(policy.predict_chunk(obs, noise=noise, steer=lambda x, t, latents: c).actions)
    assert free.abs().max() < 0.65 and steered.abs().max() < 0.95  # no clamping: the shift is all there
    torch.testing.assert_close(steered - free, -c, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_a_steer_that_reads_the_velocity_gets_the_policys_own_at_each_step(kind):
    """A steer marked ``reads_velocity`` is called with the step's velocity: returning c - v makes every step's
    velocity c, so the chunk is noise - c whatever the policy (n steps of c / n), and each v it got is the hook's
    at that step's state."""
    policy = make_policy(kind)
    obs = observation()
    noise = torch.rand(B, H, A, generator=torch.Generator().manual_seed(2)) - 0.5
    c = torch.rand(B, H, A, generator=torch.Generator().manual_seed(4)) * 0.6 - 0.3
    seen = []

    def steer(x_t, t, latents, velocity):
        seen.append((x_t.clone(), t.clone(), velocity.clone()))
        return c - velocity

    steer.reads_velocity = True
    steered = normalized(policy.predict_chunk(obs, noise=noise, steer=steer).actions)
    torch.testing.assert_close(steered, (noise - c).clamp(-1, 1), rtol=0, atol=1e-5)
    assert len(seen) == policy.config.num_inference_steps
    for x_t, t, velocity in seen:
        torch.testing.assert_close(velocity, policy.velocity(obs, x_t, t), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_a_steer_composes_with_rtc_guidance(kind):
    """Under inpainting guidance the steer is added to the guided velocity: a zero steer changes nothing,
    and its latents are those of the pass that computed the velocity."""
    policy = make_policy(kind, max_delay_steps=3)
    obs, noise = observation(delayed=True), torch.randn(B, H, A, generator=torch.Generator().manual_seed(2))
    inpaint = (torch.tensor([[1.0, 0.5]]).expand(B, H, A), torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 0.0]]).expand(B, H))
    guided = policy.predict_chunk(obs, noise=noise, inpaint=inpaint).actions
    seen = []

    def zero(x_t, t, latents):
        seen.append(torch.equal(latents, policy.latents(obs, x_t, t)))
        return torch.zeros_like(x_t)

    torch.testing.assert_close(policy.predict_chunk(obs, noise=noise, inpaint=inpaint, steer=zero).actions, guided,
                               rtol=0, atol=0)  # fmt: skip
    assert seen == [True] * policy.config.num_inference_steps
    pushed = policy.predict_chunk(obs, noise=noise, inpaint=inpaint, steer=lambda x, t, lat: torch.full_like(x, 0.3))
    assert (pushed.actions - guided).abs().max() > 1e-2
    assert torch.equal(pushed.actions[1, :3], COMMITTED[1, :3])  # the committed prefix still exact


@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_latents_are_the_pooled_hidden_state_and_move_with_x_t(kind):
    policy = make_policy(kind)
    obs, x = observation(), torch.randn(B, H, A, generator=torch.Generator().manual_seed(2))
    assert policy.latent_dim == 32  # hidden_dim of the small policy, dim of the VLA
    latents = policy.latents(obs, x, 0.7)
    assert latents.shape == (B, 32) and torch.isfinite(latents).all()
    assert (policy.latents(obs, x + 0.5, 0.7) - latents).abs().max() > 1e-3
    torch.testing.assert_close(policy.latents(obs, x, torch.full((B,), 0.7)), latents, rtol=0, atol=0)
    # Per-sample times: row b at t[b], as when each sample is alone.
    t = torch.tensor([0.2, 0.9])
    both = policy.velocity(obs, x, t)
    alone = policy.velocity({k: v[1:] for k, v in obs.items()}, x[1:], 0.9)
    torch.testing.assert_close(both[1:], alone, rtol=1e-5, atol=1e-6)
    if kind == "flow":  # the DiT's final tokens, mean over the chunk: what its output layer reads
        cond, mask = policy.encode_observation(obs)
        _, hidden = policy.dit(x[:, None], torch.full((B, 1), 0.7), cond, mask, with_hidden=True)
        torch.testing.assert_close(latents, hidden[:, 0].mean(1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_the_observation_is_encoded_once_per_chunk_not_once_per_step(kind, monkeypatch):
    policy = make_policy(kind)
    encodings, prepare = [], policy.prepare_request
    monkeypatch.setattr(policy, "prepare_request", lambda obs: encodings.append(1) or prepare(obs))
    steps = []
    policy.predict_chunk(observation(), steer=lambda x, t, latents: steps.append(1) or torch.zeros_like(x))
    assert len(steps) == policy.config.num_inference_steps and len(encodings) == 1


@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_a_repeated_noise_gives_a_finite_chunk_of_the_right_shape(kind):
    """One vector repeated along the chunk (an expanded view, its rows sharing memory): DSRL's noise in the
    (rows, dims) space the sampler integrates, taken as it is."""
    policy = make_policy(kind, max_delay_steps=3)
    row = torch.randn(A, generator=torch.Generator().manual_seed(5))
    repeated = row.expand(B, *policy.noise_shape)
    for obs in (observation(), observation(delayed=True)):
        chunk = policy.predict_chunk(obs, noise=repeated).actions
        assert chunk.shape == (B, H, A) and torch.isfinite(chunk).all()
        assert torch.equal(chunk, policy.predict_chunk(obs, noise=repeated.clone()).actions)
        steered = policy.predict_chunk(obs, noise=repeated, steer=lambda x, t, latents: torch.ones_like(x))
        assert torch.isfinite(steered.actions).all()
    assert torch.equal(repeated, row.expand(B, H, A))  # the caller's noise untouched


# -- what is refused -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["diffusion", "ddpm"])
def test_an_epsilon_policy_refuses_the_hooks_and_steer_naming_the_fix(kind):
    policy = make_policy(kind)
    obs, x = observation(), torch.zeros(B, H, A)
    assert policy.noise_shape == (H, A)  # its DDIM sampler still starts from a (horizon, action_dim) noise
    for call in (lambda: policy.velocity(obs, x, 0.5), lambda: policy.latents(obs, x, 0.5),
                 lambda: policy.latent_dim, lambda: policy.predict_chunk(obs, steer=lambda *a: 0),
                 lambda: policy.predict_chunk(obs, inpaint=(torch.zeros(B, H, A), torch.ones(B, H)))):  # fmt: skip
        with pytest.raises(ValueError, match=f"needs a flow .*objective=ddpm; {FIX}|needs a flow policy; {FIX}"):
            call()


def test_bad_hook_inputs_are_refused_in_one_line():
    policy = make_policy("diffusion-flow")
    obs = observation()
    with pytest.raises(ValueError, match=r"x_t must be \(B, horizon, action_dim\) = \(2, 6, 2\), got \(2, 6, 3\)"):
        policy.velocity(obs, torch.zeros(B, H, 3), 0.5)
    with pytest.raises(ValueError, match=r"noise must be \(B, horizon, action_dim\) = \(2, 6, 2\), got \(2, 1, 2\)"):
        policy.predict_chunk(obs, noise=torch.zeros(B, 1, A))  # a repeated noise must be expanded to every row
    with pytest.raises(ValueError, match=r"t must be a float or a \(B,\) = \(2,\) tensor"):
        policy.velocity(obs, torch.zeros(B, H, A), torch.ones(3))
    with pytest.raises(
        ValueError, match=r"steer must return an extra velocity shaped like x_t.*\(2, 6, 2\), got \(2, 2\)"
    ):
        policy.predict_chunk(obs, steer=lambda x, t, latents: torch.zeros(B, A))


def test_a_token_policy_refuses_steering_naming_the_policies_that_have_it():
    from policies.autoregressive_vla import AutoregressiveVLAConfig
    from policies.autoregressive_vla.modeling_autoregressive_vla import AutoregressiveVLAPolicy
    from policies.tokenizer import word_vocabulary

    policy = AutoregressiveVLAPolicy(AutoregressiveVLAConfig(
        state_dim=3, action_dim=A, cameras=["front"], image_size=16, horizon=H, n_action_steps=2,
        vocabulary=word_vocabulary([TASK]),
    ))  # fmt: skip
    names = r"steer a flow policy: diffusion or diffusion_vla trained with --policy.objective=flow, or LeRobot's pi0"
    for call in (lambda: policy.predict_chunk(observation(), steer=lambda *a: 0),
                 lambda: policy.velocity(observation(), torch.zeros(B, H, A), 0.5), lambda: policy.latent_dim):  # fmt: skip
        with pytest.raises(
            ValueError, match=r"needs a flow velocity, which the 'autoregressive_vla' policy does not have; " + names
        ):
            call()
    with pytest.raises(ValueError, match="samples from no initial noise"):
        policy.noise_shape  # noqa: B018


# -- RL: vla-rl finetune trains a flow diffusion policy unchanged ----------------------------------------


def test_finetune_runs_an_rl_update_on_a_flow_diffusion_policy(tmp_path):
    """A random flow `diffusion` policy for the lift env (front camera 64 px, 11 states, 4 actions), saved and
    fine-tuned one PPO iteration by `vla-rl finetune`: its Euler chains train (ReinFlow)."""
    from safetensors.torch import load_file
    from test_rl import small_run

    from vla_rl.finetune import finetune
    from vla_rl.rl.ppo import PPOConfig

    save_lift_flow_policy(tmp_path / "policy", image_size=64)
    summary = finetune(small_run(tmp_path / "policy", tmp_path / "run", iterations=1, minibatch_size=8, lr=1e-3,
                                 num_threads=1, ppo=PPOConfig(critic_warmup_iterations=0)))  # fmt: skip
    assert summary["iterations"] == 1 and summary["history"][0]["executed_env_steps"] > 0
    before = load_file(str(tmp_path / "policy" / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "checkpoints" / "last" / "pretrained_model" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the update changed nothing"
    saved = json.loads((tmp_path / "run" / "checkpoints" / "last" / "pretrained_model" / "config.json").read_text())
    assert saved["objective"] == "flow"
