"""Denoising chains as Gaussian policies: exact log-probabilities for RL fine-tuning.

A denoising sampler turns initial noise x_0 into a chunk x_K in K steps. RL sampling injects Gaussian
noise into every step, so step k is x_{k+1} ~ N(mean_theta(x_k, k), std_k^2) and the whole chain
(x_0, ..., x_K) has an exact density: the product of its K step densities (the density of x_0 does not
depend on the weights and is left out). The chain is the RL action and its log-probability the sum of
K Gaussian log-densities, as in DPPO (epsilon objective: DDIM with eta) and ReinFlow (flow objective:
Euler steps with a fixed std).

A chain is one kind of RL decision (`vla_core.rl.Decision`): `DenoisingActor` is the RL actor of any
denoising policy (`vla_core.rl.RLPolicy`), its factors the K denoising steps.

Everything here is in normalized action units ([-1, 1] is the dataset's action range).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vla_core.rl import FactorLogProb
from vla_core.runtime.delay import augmentation_features, augmentation_features_dim
from vla_core.types import OBS_MID_STATE, OBS_MID_STEPS


@dataclass
class ExplorationNoise:
    """How much noise RL sampling injects into each denoising step (normalized action units); for a token
    policy, the temperature its action tokens are sampled at (`policies.token_actor`)."""

    eta: float = 1.0  # epsilon objective: DDIM's eta (0 = deterministic DDIM, 1 = DDPM's posterior variance)
    min_std: float = 0.1  # every step's std is at least this; the flow objective's Euler steps get exactly this std
    temperature: float = 1.0  # token policies (autoregressive_vla) sample their action tokens at this temperature

    def validate(self) -> None:
        """Raise ValueError naming the fix for a negative or non-finite setting."""
        for name in ("eta", "min_std", "temperature"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"exploration noise {name}={value} must be a finite number >= 0; set {name} >= 0")

    def check_density(self) -> None:
        """Raise ValueError unless a chain sampled with this noise has a density, which RL needs."""
        self.validate()
        if self.min_std <= 0:
            raise ValueError("--noise.min_std must be > 0: with no noise the chain has no log-probability")


@dataclass
class DenoisingChain:
    """One batch of sampled chains, normalized action units.

    eta is an addition for the epsilon objective: DDIM's step mean depends on it (the std alone does
    not tell it once the ``min_std`` floor applies), so the chain records the eta it was sampled with.
    None: not recorded (the flow objective does not need it; the epsilon objective refuses the chain).

    executed: which rows of the chunk ran, set by the learner from the rollout (`with_executed`): the final
    step's samples of the other rows change no executed action, so its density leaves them out (every
    earlier step keeps every row: they feed the later steps through the network). None: every row.
    executed_dims: the action dimensions the robot runs, the first ones (a LeRobot VLA's sampler pads its
    actions to max_action_dim; the final step's padding runs nowhere either); None: every dimension.
    """

    # (B, K+1, H, A): latents[:, 0] the initial noise, latents[:, k+1] the sample of step k; latents[:, K]
    # is the chunk before clamping to [-1, 1]. Known steps hold their clean committed action in every latent.
    latents: torch.Tensor
    std: torch.Tensor  # (K,) the std of each step's Gaussian
    # (B, H) bool, committed (delay-augmentation) steps: written clean, not sampled, left out of the
    # log-prob; None when none
    known: torch.Tensor | None = None
    eta: float | None = None  # the DDIM eta of the epsilon objective's step means (see above)
    executed: torch.Tensor | None = None  # (B, H) bool, the rows that ran (see above); None: all
    executed_dims: int | None = None  # the first A' dimensions run (see above); None: all

    def __len__(self) -> int:
        return self.latents.shape[0]

    def select(self, rows: torch.Tensor) -> DenoisingChain:
        """The chains of ``rows``: a long index or a bool mask over B."""
        rows = rows.to(self.latents.device)
        known = None if self.known is None else self.known[rows]
        executed = None if self.executed is None else self.executed[rows]
        return DenoisingChain(self.latents[rows], self.std, known, self.eta, executed, self.executed_dims)

    def with_executed(self, executed: torch.Tensor | None, dims: int | None = None) -> DenoisingChain:
        """The chain with what of its final step ran: rows (B, H') bool, H' <= H rows of the chunk from its
        first (rows past H' never run: a LeRobot VLA's sampler integrates more rows than its horizon), and the
        first ``dims`` action dimensions; None: every row, every dimension."""
        a = self.latents.shape[3]
        if dims is not None and not 1 <= dims <= a:
            raise ValueError(f"executed dims must be in [1, {a}] for this chain, got {dims}")
        dims = None if dims == a else dims
        if executed is None:
            return DenoisingChain(self.latents, self.std, self.known, self.eta, None, dims)
        b, h = self.latents.shape[0], self.latents.shape[2]
        if executed.ndim != 2 or executed.shape[0] != b or executed.shape[1] > h or executed.dtype != torch.bool:
            raise ValueError(
                f"executed rows must be (B, <= H) = ({b}, <= {h}) bool for this chain, got {executed.dtype} "
                f"{tuple(executed.shape)}"
            )
        padded = torch.zeros(b, h, dtype=torch.bool, device=self.latents.device)
        padded[:, : executed.shape[1]] = executed.to(padded.device)
        return DenoisingChain(self.latents, self.std, self.known, self.eta, padded, dims)

    @staticmethod
    def cat(chains: list[DenoisingChain]) -> DenoisingChain:
        """Concatenate along B. They must share std and eta; known is None only if it is None in all of them."""
        if not chains:
            raise ValueError("DenoisingChain.cat needs at least one chain")
        first = chains[0]
        for c in chains[1:]:
            if c.std.shape != first.std.shape or not torch.equal(c.std.to(first.std.device), first.std):
                raise ValueError("chains sampled with different step stds cannot be concatenated; use one noise")
            if c.eta != first.eta:
                raise ValueError(f"chains sampled with different eta ({first.eta}, {c.eta}) cannot be concatenated")
        device = first.latents.device
        if any(c.executed is not None or c.executed_dims is not None for c in chains):
            raise ValueError("chains with executed rows are scored, not concatenated; concatenate them before")
        latents = torch.cat([c.latents.to(device) for c in chains])
        known = None
        if any(c.known is not None for c in chains):
            known = torch.cat([
                c.known.to(device) if c.known is not None
                else torch.zeros(c.latents.shape[0], c.latents.shape[2], dtype=torch.bool, device=device)
                for c in chains
            ])  # fmt: skip
        return DenoisingChain(latents, first.std, known, first.eta)

    def to(self, device) -> DenoisingChain:
        known = None if self.known is None else self.known.to(device)
        executed = None if self.executed is None else self.executed.to(device)
        return DenoisingChain(self.latents.to(device), self.std.to(device), known, self.eta, executed,
                              self.executed_dims)  # fmt: skip

    def check_density(self) -> None:
        """Raise ValueError unless every step's std is > 0 (a step with std 0 is a point mass: no density)."""
        if not (torch.isfinite(self.std).all() and (self.std > 0).all()):
            raise ValueError(
                f"the chain's step stds {self.std.tolist()} are not all > 0, so it has no log-probability; "
                f"sample it with ExplorationNoise(min_std > 0)"
            )

    def inputs(self, committed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """(B, K, H, A) the input of each step, latents[:, :K], with the known steps of ``committed``
        (normalized actions (B, H, A), known (B, H)) set to their clean actions (as stored when None)."""
        x = self.latents[:, :-1]
        if committed is None:
            return x
        clean, known = committed
        return torch.where(known[:, None, :, None], clean[:, None].to(x), x)

    def step_log_prob(self, means: torch.Tensor) -> torch.Tensor:
        """(B, K) log-density of each step's sample latents[:, k+1] under N(means[:, k], std[k]^2),
        summed over the chunk elements that are not known and, in the final step, over the executed rows
        and dimensions only. means: (B, K, H, A)."""
        b, k, h, a = means.shape[:4]
        mask = None
        if self.known is not None or self.executed is not None or self.executed_dims is not None:
            dev = means.device
            mask = torch.ones(b, k, h, a, dtype=torch.bool, device=dev)  # the elements each step's density covers
            if self.known is not None:
                mask = mask & ~self.known.to(dev)[:, None, :, None]
            last = torch.arange(k, device=dev)[None, :, None, None] == k - 1
            if self.executed is not None:
                mask = mask & (~last | self.executed.to(dev)[:, None, :, None])
            if self.executed_dims is not None:
                mask = mask & (~last | (torch.arange(a, device=dev) < self.executed_dims))
            mask = mask.flatten(0, 1)
        std = self.std.to(means).repeat(b).view(b * k, *(1,) * (means.ndim - 2))  # row b * K + k: std[k]
        x = self.latents[:, 1:].to(means).flatten(0, 1)
        return gaussian_log_prob(x, means.flatten(0, 1), std, mask).view(b, k)


def gaussian_log_prob(
    x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum over all dims but the first of log N(x; mean, std^2); x, mean (B, ...); std broadcastable;
    mask (B, ...) bool selects the summed elements."""
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device)
    z = (x - mean) / std
    log_density = -0.5 * z.square() - std.log() - 0.5 * math.log(2 * math.pi)
    if mask is not None:
        log_density = torch.where(mask, log_density, torch.zeros((), dtype=x.dtype, device=x.device))
    return log_density.flatten(1).sum(1)


# -- the epsilon objective: DDIM with eta ------------------------------------------------------------


@dataclass
class DDIMSteps:
    """The K Gaussian steps of DDIM with eta (Song et al. 2021, eq. 12 and 16), as diffusers'
    ``DDIMScheduler.step`` takes them, on ``num_inference_steps`` timesteps.

    Built from any diffusers scheduler's config (a DDPMScheduler's too: RL sampling always takes the
    DDIM-with-eta steps on DDIM's timesteps; with eta = 1 their variance is DDPM's posterior variance,
    and their mean is DDPM's posterior mean up to the clipping of the predicted clean chunk).
    """

    timesteps: torch.Tensor  # (K,) long, descending
    alpha: torch.Tensor  # (K,) alphas_cumprod at each step's timestep
    alpha_prev: torch.Tensor  # (K,) at the step's target timestep (final_alpha_cumprod past 0)
    variance: torch.Tensor  # (K,) DDIM's sigma^2 at eta = 1 (DDPM's posterior variance)
    clip: float | None  # clip range of the predicted clean chunk; None: no clipping

    @classmethod
    def from_scheduler(cls, scheduler, num_inference_steps: int) -> DDIMSteps:
        from diffusers import DDIMScheduler

        ddim = DDIMScheduler.from_config(scheduler.config)  # a copy: the policy's scheduler is left as it is
        if ddim.config.prediction_type != "epsilon" or ddim.config.thresholding:
            raise ValueError("DDIM log-probabilities need an epsilon-prediction scheduler without thresholding")
        ddim.set_timesteps(num_inference_steps)
        timesteps = ddim.timesteps.long()
        prev = timesteps - ddim.config.num_train_timesteps // num_inference_steps
        cumprod = ddim.alphas_cumprod.float()
        alpha = cumprod[timesteps]
        final = torch.as_tensor(ddim.final_alpha_cumprod, dtype=torch.float32)
        alpha_prev = torch.where(prev >= 0, cumprod[prev.clamp_min(0)], final)
        variance = (1 - alpha_prev) / (1 - alpha) * (1 - alpha / alpha_prev)
        clip = float(ddim.config.clip_sample_range) if ddim.config.clip_sample else None
        return cls(timesteps, alpha, alpha_prev, variance, clip)

    def to(self, device) -> DDIMSteps:
        moved = (t.to(device) for t in (self.timesteps, self.alpha, self.alpha_prev, self.variance))
        return DDIMSteps(*moved, clip=self.clip)

    def stds(self, noise: ExplorationNoise) -> torch.Tensor:
        """(K,) each step's std: eta * sqrt(variance) as DDIM's, floored at ``noise.min_std``."""
        return (noise.eta * self.variance.sqrt()).clamp_min(noise.min_std)

    def mean(self, x: torch.Tensor, eps: torch.Tensor, eta: float, k: int | None = None) -> torch.Tensor:
        """The mean of DDIM's step from x given the predicted noise eps (diffusers' ``prev_sample``
        without its noise term). k: the step, with x and eps (B, ...); None: every step, with x and eps
        (B, K, ...). The mean uses eta's sigma, not the floored std (the floor only widens the step)."""
        coefficients = (self.alpha, self.alpha_prev, self.variance)
        if k is None:
            shape = (1, len(self.alpha)) + (1,) * (x.ndim - 2)
            alpha, alpha_prev, variance = (c.to(x).view(shape) for c in coefficients)
        else:
            alpha, alpha_prev, variance = (c[k].to(x) for c in coefficients)
        x0 = (x - (1 - alpha) ** 0.5 * eps) / alpha**0.5
        if self.clip is not None:
            x0 = x0.clamp(-self.clip, self.clip)
        # eta > 1 would make the direction's coefficient imaginary (diffusers gives NaN): it is cut at 0.
        direction = (1 - alpha_prev - eta**2 * variance).clamp_min(0) ** 0.5 * eps
        return alpha_prev**0.5 * x0 + direction


# -- sampling ----------------------------------------------------------------------------------------


def known_for_chain(
    committed: tuple[torch.Tensor, torch.Tensor] | None, chain: DenoisingChain
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The observation's committed steps, checked against the chain's known steps, as they were given.

    committed: (normalized actions (B, H, A), known (B, H)) of the observation, or None. Raises
    ValueError when the observation's known steps are not the chain's (None and all-False agree).
    """
    obs_known = None if committed is None else committed[1]
    if obs_known is None and chain.known is None:
        return committed
    a = obs_known if obs_known is not None else torch.zeros_like(chain.known)
    b = chain.known.to(a.device) if chain.known is not None else torch.zeros_like(obs_known)
    if not torch.equal(a, b):
        raise ValueError(
            "the observation's committed steps (observation.committed_mask) are not the chain's known steps; "
            "pass the observation the chain was sampled from, with its delay augmentation"
        )
    return committed


@torch.no_grad()
def sample_chain(
    step_mean: Callable[[torch.Tensor, int], torch.Tensor],
    initial: torch.Tensor,
    std: torch.Tensor,
    eta: float | None,
    committed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[DenoisingChain, torch.Tensor]:
    """Run a stochastic denoising chain: x_{k+1} = step_mean(x_k, k) + std[k] * z, z ~ N(0, I).

    initial: (B, H, A) noise; std: (K,); committed: (normalized actions (B, H, A), known (B, H)) or
    None: the known steps are written clean into every latent (the initial one too), never sampled.
    Returns the chain and its log-probability (B,); NaN when some std is 0 (no density).
    """
    clean, known = committed if committed is not None else (None, None)

    def insert(x: torch.Tensor) -> torch.Tensor:
        return x if known is None else torch.where(known[..., None], clean, x)

    x = insert(initial)
    latents, means = [x], []
    for k in range(len(std)):
        mean = step_mean(x, k)
        x = insert(mean + std[k] * torch.randn_like(mean))
        latents.append(x)
        means.append(mean)
    chain = DenoisingChain(torch.stack(latents, 1), std, known, eta)
    if (std > 0).all():
        log_prob = chain.step_log_prob(torch.stack(means, 1)).sum(1)
    else:
        log_prob = torch.full((initial.shape[0],), math.nan, device=initial.device)
    return chain, log_prob


def check_chain_shape(chain: DenoisingChain, batch: int, steps: int, horizon: int, action_dim: int) -> None:
    """Raise ValueError unless the chain is (batch, steps + 1, horizon, action_dim) with (steps,) stds."""
    expected = (batch, steps + 1, horizon, action_dim)
    if tuple(chain.latents.shape) != expected or tuple(chain.std.shape) != (steps,):
        raise ValueError(
            f"the chain's latents must be (B, K+1, H, A) = {expected} with (K,) = ({steps},) stds for this policy "
            f"and observation batch, got {tuple(chain.latents.shape)} and {tuple(chain.std.shape)}"
        )


# -- the RL actor ------------------------------------------------------------------------------------


class DenoisingActor:
    """The RL actor (`vla_core.rl.RLPolicy`) of a denoising policy: a decision is the denoising chain
    sampled with ``noise`` injected into every step (``sample_with_log_prob``), its factors the K steps
    (``log_prob(per_step=True)``), its value features the denoiser's condition (``condition_features``).
    The policy itself trains; noise -> 0 is ``predict_chunk``, what evaluation and serving run.

    augmentation_width: the width of the delay augmentation the rollouts carry (their latency protocol's;
    0: none). The value features then read it too, and a latency-aware policy's the mid observation's
    state and steps: a plain or training-time-RTC policy reads the committed actions in its denoiser,
    not its condition, so a value head on the condition alone would not see them.
    """

    def __init__(self, policy, noise: ExplorationNoise, augmentation_width: int = 0):
        noise.check_density()
        if noise.temperature != ExplorationNoise().temperature:
            raise ValueError(
                f"--noise.temperature={noise.temperature} is a token policy's; a denoising chain explores by "
                f"--noise.min_std (and --noise.eta): drop --noise.temperature"
            )
        self.policy = self.module = policy
        self.noise = noise
        self.num_factors = policy.config.num_inference_steps
        self.augmentation_width = augmentation_width

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def value_dim(self) -> int:
        c, w = self.policy.config, self.augmentation_width
        return (
            self.policy.condition_dim
            + augmentation_features_dim(w, c.action_dim)
            + (c.state_dim + 1 if c.latency_aware else 0)
        )

    @torch.no_grad()
    def act(self, obs: dict, obs_step: torch.Tensor):
        chunk, chain, _ = self.policy.sample_with_log_prob(obs, obs_step, noise=self.noise)
        return chunk, chain

    def score(self, obs: dict, chain: DenoisingChain, executed: torch.Tensor | None = None) -> FactorLogProb:
        """(B, K) per denoising step; the final step over the ``executed`` rows and the policy's action dimensions
        only (`DenoisingChain.executed`)."""
        chain = chain.with_executed(executed, self.policy.config.action_dim)
        return FactorLogProb(self.policy.log_prob(obs, chain, per_step=True))

    def value_features(self, obs: dict) -> torch.Tensor:
        """(B, value_dim): the condition, then the delay augmentation, then the mid observation's state and
        steps (see the class docstring); the condition alone without an augmentation and a fast head."""
        policy, w, features = self.policy, self.augmentation_width, [self.policy.condition_features(obs)]
        if w:
            features.append(augmentation_features(obs, w, policy.normalize_action))
        if policy.config.latency_aware:
            mid_steps = obs[OBS_MID_STEPS].to(features[0]).float()[:, None] / max(w, 1)
            features += [policy.normalize_state(obs[OBS_MID_STATE].to(features[0])), mid_steps]
        return torch.cat(features, -1)


class DenoisingRL:
    """What a denoising policy implements for RL (mixed into `PreTrainedPolicy` subclasses): sampling with
    exploration noise and the exact log-probability of a chain; ``rl_actor`` wraps them as the RL contract.

    - ``sample_with_log_prob(obs, obs_step=None, *, noise)`` -> (ActionChunk in dataset units, the chain,
      log-prob (B,)), no autograd: every denoising step is a Gaussian around the sampler's own step; the
      chunk's known (committed) steps are the committed actions exactly, as in ``predict_chunk``. NaN
      log-prob when some step's std is 0 (no density).
    - ``log_prob(obs, chain, *, per_step=False)`` -> (B,) (or (B, K) per step), with autograd: the sum over
      the K steps and the unknown chunk elements of log N(latents[k+1]; mean_theta(latents[k], k), std[k]^2),
      the initial noise's density left out. ``obs`` is the batch the chain was sampled from. A chain with a
      step std of 0 is refused.
    - ``condition_features(obs)`` (B, ``condition_dim``): the denoiser's condition, for a value head.
    """

    def rl_actor(self, noise: ExplorationNoise, augmentation_width: int = 0) -> DenoisingActor:
        return DenoisingActor(self, noise, augmentation_width)
