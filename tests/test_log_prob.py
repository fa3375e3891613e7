"""RL log-probabilities of the denoising policies' sampling chains (``policies.denoising_chain``).

The expected densities are brute force, worked out here step by step: each step's mean from diffusers'
own ``DDIMScheduler.step`` (epsilon objective) or the Euler step written out (flow), with the denoiser
called once per step, and the density from ``torch.distributions.Normal``.
"""

import math

import pytest
import torch
from diffusers import DDIMScheduler
from tiny_policies import ACTION_MAX, ACTION_MIN, TASK, A, H, make_policy
from torch.distributions import Normal

from policies.denoising_chain import DenoisingChain, ExplorationNoise, gaussian_log_prob
from policies.diffusion.modeling_diffusion import DiffusionPolicy
from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK, OBS_DELAY_STEPS

B = 2
# The small policy and the VLA with each objective, and the VLA whose deterministic sampler is DDPM.
KINDS = ["diffusion", "diffusion-flow", "ddpm", "flow"]
EPSILON_KINDS = ["diffusion", "ddpm", "ddpm-sampler"]
FLOW_KINDS = ["diffusion-flow", "flow"]

# Sample 0 commits 2 chunk steps (its row 2 is padding), sample 1 commits 3; 3.0 is outside the range.
COMMITTED = torch.tensor([[[0.5, 0.25], [-1.5, 0.9], [9.0, 9.0]], [[1.9, 0.1], [3.0, 0.7], [-0.3, 0.3]]])
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
    """Dataset units -> [-1, 1] with the min/max above, written out."""
    low, high = torch.tensor(ACTION_MIN), torch.tensor(ACTION_MAX)
    return (actions - low) / (high - low) * 2 - 1


def committed_clean() -> torch.Tensor:
    """(B, H, A) the normalized committed actions at the known steps (zeros elsewhere)."""
    clean = torch.zeros(B, H, A)
    clean[:, :3] = torch.where(MASK[..., None], normalized(COMMITTED), 0.0)
    return clean


def sample(policy, obs, noise: ExplorationNoise, seed: int = 3):
    torch.manual_seed(seed)
    return policy.sample_with_log_prob(obs, noise=noise)


def denoiser_output(policy, x: torch.Tensor, t: float, obs: dict, known: torch.Tensor | None) -> torch.Tensor:
    """The denoiser at one step, x (B, H, A) -> (B, H, A) noise or velocity; known steps already clean.
    t: the objective's time (a DDPM timestep, or the flow's t in [0, 1]). The VLA's known tokens sit at the
    clean end of the schedule (time 0)."""
    if isinstance(policy, DiffusionPolicy):
        cond = policy.encode_observation(obs)
        return policy.denoise(x, torch.full((B,), t), cond, known)
    cond, mask = policy.encode_observation(obs)
    if known is None:
        return policy.dit(x[:, None], torch.full((B, 1), t), cond, mask)[:, 0]
    tt = torch.where(known, 0.0, torch.full((B, H), t))[:, None]
    return policy.dit(x[:, None], tt, cond, mask, known[:, None])[:, 0]


def brute_force(policy, obs, chain, step_mean_std, delayed: bool):
    """(B,) log-density of the chain's K steps, and the standardized residuals of its samples."""
    known = KNOWN if delayed else None
    total, residuals = torch.zeros(B), []
    for k in range(chain.latents.shape[1] - 1):
        x = chain.latents[:, k]
        if delayed:
            x = torch.where(KNOWN[..., None], committed_clean(), x)
        mean, std = step_mean_std(k, x, known)
        nxt = chain.latents[:, k + 1]
        free = torch.ones(B, H, A, dtype=torch.bool) if known is None else ~known[..., None].expand(B, H, A)
        total += (Normal(mean, std).log_prob(nxt) * free).sum((1, 2))
        residuals.append(((nxt - mean) / std)[free])
    return total, torch.cat(residuals)


# -- 1, 2: the chain's density is the brute-force one ---------------------------------------------------


@pytest.mark.parametrize(
    ("eta", "min_std"),
    [
        (1.0, 0.01),  # the last DDIM step lands on alpha = 1 where DDIM's variance is 0: min_std floors it
        (0.0, 0.1),  # vla-rl finetune's default: the deterministic DDIM step plus 0.1 of noise, every step
    ],
)
@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("kind", EPSILON_KINDS)
def test_epsilon_chain_density_is_ddim_with_eta(kind, delayed, eta, min_std):
    policy = make_policy(kind, max_delay_steps=3 if delayed else 0)
    obs = observation(delayed)
    cfg = policy.config
    _, chain, log_prob = sample(policy, obs, ExplorationNoise(eta=eta, min_std=min_std))
    sched = DDIMScheduler(num_train_timesteps=cfg.num_train_timesteps, beta_schedule=cfg.beta_schedule,
                          clip_sample=True, prediction_type="epsilon")  # fmt: skip
    sched.set_timesteps(cfg.num_inference_steps)
    ratio = cfg.num_train_timesteps // cfg.num_inference_steps
    stds = []

    def step(k, x, known):
        t = sched.timesteps[k]
        with torch.no_grad():
            eps = denoiser_output(policy, x, float(t), obs, known)
        mean = sched.step(eps, t, x, eta=eta, variance_noise=torch.zeros_like(x)).prev_sample
        std = max(eta * float(sched._get_variance(int(t), int(t) - ratio)) ** 0.5, min_std)
        stds.append(std)
        return mean, std

    expected, residuals = brute_force(policy, obs, chain, step, delayed)
    floored = [s == min_std for s in stds]
    if eta > 0:
        assert floored == [False] * (len(stds) - 1) + [True], stds  # the floor applies, on the last step only
    else:
        assert all(floored), stds  # eta = 0: every step's std is the floor
    torch.testing.assert_close(chain.std, torch.tensor(stds), rtol=1e-5, atol=1e-7)
    assert chain.eta == eta
    torch.testing.assert_close(log_prob, expected, rtol=1e-5, atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(policy.log_prob(obs, chain), expected, rtol=1e-5, atol=1e-3)
    # The samples are draws of those Gaussians: standardized residuals ~ N(0, 1).
    assert abs(float(residuals.mean())) < 0.2 and abs(float(residuals.std()) - 1) < 0.15, residuals.std()


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_flow_chain_density_is_euler_with_fixed_std(kind, delayed):
    policy = make_policy(kind, max_delay_steps=3 if delayed else 0)
    obs = observation(delayed)
    n, min_std = policy.config.num_inference_steps, 0.2
    _, chain, log_prob = sample(policy, obs, ExplorationNoise(eta=0.7, min_std=min_std))

    def step(k, x, known):
        with torch.no_grad():
            v = denoiser_output(policy, x, 1.0 - k / n, obs, known)
        return x - v / n, min_std

    expected, residuals = brute_force(policy, obs, chain, step, delayed)
    torch.testing.assert_close(chain.std, torch.full((n,), min_std))
    torch.testing.assert_close(log_prob, expected, rtol=1e-5, atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(policy.log_prob(obs, chain), expected, rtol=1e-5, atol=1e-3)
    assert abs(float(residuals.mean())) < 0.2 and abs(float(residuals.std()) - 1) < 0.15, residuals.std()


# -- 3: without noise the chain is the deterministic sampler ---------------------------------------------


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_zero_noise_reproduces_predict_chunk(kind, delayed):
    policy = make_policy(kind, max_delay_steps=3 if delayed else 0)
    obs = observation(delayed)
    chunk, chain, log_prob = sample(policy, obs, ExplorationNoise(eta=0.0, min_std=0.0))
    assert torch.equal(chain.std, torch.zeros(policy.config.num_inference_steps))
    assert torch.isnan(log_prob).all()  # a point mass has no density
    expected = policy.predict_chunk(obs, noise=chain.latents[:, 0]).actions
    torch.testing.assert_close(chunk.actions, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunk.obs_step, torch.zeros(B, dtype=torch.long))
    # The returned chunk is the chain's last latent, clamped and in dataset units.
    last = (chain.latents[:, -1].clamp(-1, 1) + 1) / 2 * (torch.tensor(ACTION_MAX) - torch.tensor(ACTION_MIN))
    free = ~KNOWN if delayed else torch.ones(B, H, dtype=torch.bool)
    torch.testing.assert_close(chunk.actions[free], (last + torch.tensor(ACTION_MIN))[free], rtol=0, atol=1e-5)
    # With noise, the chunk moves away from the deterministic one.
    noisy, _, _ = sample(policy, obs, ExplorationNoise(eta=1.0, min_std=0.1))
    assert (noisy.actions - expected).abs().max() > 1e-2


# -- 4: log_prob re-evaluates the chain, with gradients ---------------------------------------------------


def denoiser_weight(policy) -> torch.Tensor:
    return policy.output_proj[1].weight if isinstance(policy, DiffusionPolicy) else policy.dit.action_out.weight


@pytest.mark.parametrize("kind", KINDS)
def test_log_prob_matches_sampling_and_has_gradients(kind):
    policy = make_policy(kind)
    obs = observation()
    _, chain, sampled = sample(policy, obs, ExplorationNoise(eta=1.0, min_std=0.05))
    assert not sampled.requires_grad and sampled.shape == (B,)
    log_prob = policy.log_prob(obs, chain)
    torch.testing.assert_close(log_prob.detach(), sampled, rtol=0, atol=1e-4)
    per_step = policy.log_prob(obs, chain, per_step=True)
    assert per_step.shape == (B, policy.config.num_inference_steps)
    torch.testing.assert_close(per_step.detach().sum(1), sampled, rtol=0, atol=1e-4)
    log_prob.sum().backward()
    weight = denoiser_weight(policy)
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    with torch.no_grad():
        weight.add_(0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(9)))
        changed = policy.log_prob(obs, chain)
    assert (changed - sampled).abs().max() > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_chains_select_and_cat(kind):
    policy = make_policy(kind)
    obs = observation()
    _, chain, sampled = sample(policy, obs, ExplorationNoise(eta=1.0, min_std=0.05))
    swapped = DenoisingChain.cat([chain.select(torch.tensor([1])), chain.select(torch.tensor([True, False]))])
    assert len(swapped) == B and swapped.eta == chain.eta and swapped.known is None
    reversed_obs = {k: v[::-1] if k == "task" else v.flip(0) for k, v in obs.items()}
    with torch.no_grad():
        torch.testing.assert_close(policy.log_prob(reversed_obs, swapped), sampled.flip(0), rtol=0, atol=1e-4)
    # known: None only where all are None; the missing rows are filled with False.
    with_known = DenoisingChain(chain.latents, chain.std, torch.ones(B, H, dtype=torch.bool), chain.eta)
    both = DenoisingChain.cat([chain, with_known])
    assert both.known.shape == (2 * B, H) and not both.known[:B].any() and both.known[B:].all()
    with pytest.raises(ValueError, match="eta"):
        DenoisingChain.cat([chain, DenoisingChain(chain.latents, chain.std, None, 0.5)])


@pytest.mark.parametrize("kind", KINDS)
def test_condition_features(kind):
    policy = make_policy(kind)
    features = policy.condition_features(observation())
    assert features.shape == (B, policy.condition_dim) and features.requires_grad
    expected = 32  # hidden_dim of the small policy, dim of the VLA
    assert policy.condition_dim == expected


# -- 5: the delay augmentation's known steps ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_known_steps_are_clean_and_out_of_the_log_prob(kind):
    policy = make_policy(kind, max_delay_steps=3)
    obs = observation(delayed=True)
    chunk, chain, sampled = sample(policy, obs, ExplorationNoise(eta=1.0, min_std=0.1))
    assert torch.equal(chain.known, KNOWN)
    # Every latent, the initial noise included, holds the clean committed actions at the known steps.
    clean = committed_clean()[:, None].expand_as(chain.latents)
    known = KNOWN[:, None, :, None].expand_as(chain.latents)
    torch.testing.assert_close(chain.latents[known], clean[known], rtol=0, atol=1e-6)
    assert torch.equal(chunk.actions[0, :2], COMMITTED[0, :2]) and torch.equal(chunk.actions[1, :3], COMMITTED[1, :3])
    with torch.no_grad():
        log_prob = policy.log_prob(obs, chain)
        torch.testing.assert_close(log_prob, sampled, rtol=0, atol=1e-4)
        shifted = chain.latents.clone()
        shifted[known] += torch.randn(int(known.sum()), generator=torch.Generator().manual_seed(4))
        moved = DenoisingChain(shifted, chain.std, chain.known, chain.eta)
        torch.testing.assert_close(policy.log_prob(obs, moved), log_prob, rtol=0, atol=1e-6)
        # An unknown element does count.
        other = chain.latents.clone()
        other[0, 4, 5, 0] += 0.5
        assert (policy.log_prob(obs, DenoisingChain(other, chain.std, chain.known, chain.eta)) - log_prob).abs()[
            0
        ] > 1e-2
    # The chain's known steps need the observation's.
    with pytest.raises(ValueError, match="committed"):
        policy.log_prob(observation(), chain)


# -- 6: no density without noise --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_log_prob_refuses_a_zero_std(kind):
    policy = make_policy(kind)
    obs = observation()
    _, chain, _ = sample(policy, obs, ExplorationNoise(eta=1.0, min_std=0.1))
    std = chain.std.clone()
    std[3] = 0.0
    with pytest.raises(ValueError, match="min_std > 0"):
        policy.log_prob(obs, DenoisingChain(chain.latents, std, chain.known, chain.eta))
    if kind not in FLOW_KINDS:  # DDIM's last step has variance 0: eta alone leaves it without density
        _, chain, log_prob = sample(policy, obs, ExplorationNoise(eta=1.0, min_std=0.0))
        assert chain.std[-1] == 0 and torch.isnan(log_prob).all()
        with pytest.raises(ValueError, match="min_std > 0"):
            policy.log_prob(obs, chain)


def test_exploration_noise_validation_and_gaussian():
    for bad in ({"eta": -0.1}, {"min_std": -1.0}, {"eta": math.nan}, {"min_std": math.inf}):
        with pytest.raises(ValueError, match=">= 0"):
            ExplorationNoise(**bad).validate()
    ExplorationNoise(eta=0.0, min_std=0.0).validate()
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    std = torch.rand(4, 1, generator=g) + 0.1
    mask = torch.rand(3, 4, 5, generator=g) > 0.5
    expected = (Normal(mean, std).log_prob(x) * mask).sum((1, 2))
    torch.testing.assert_close(gaussian_log_prob(x, mean, std, mask), expected)
    torch.testing.assert_close(gaussian_log_prob(x, mean, 0.3), Normal(mean, 0.3).log_prob(x).sum((1, 2)))


def test_rl_refuses_a_vla_whose_sampler_or_noise_it_would_not_train():
    """RL scores DDIM-with-eta chains: a ddpm VLA that evaluates with the DDPM sampler would run another
    policy than the one RL trains, and eta means nothing to a flow policy's Euler steps."""
    with pytest.raises(ValueError, match="RL scores DDIM-with-eta chains, but this policy samples with DDPM"):
        make_policy("ddpm-sampler").rl_actor(ExplorationNoise(eta=0.0, min_std=0.1))
    for kind in FLOW_KINDS:
        with pytest.raises(ValueError, match=r"--noise.eta=0.5 does nothing for a flow policy"):
            make_policy(kind).rl_actor(ExplorationNoise(eta=0.5, min_std=0.1))
        assert make_policy(kind).rl_actor(ExplorationNoise(eta=0.0, min_std=0.1)).num_factors == 10  # K Euler steps
    assert make_policy("ddpm").rl_actor(ExplorationNoise(eta=1.0, min_std=0.1)).noise.eta == 1.0
