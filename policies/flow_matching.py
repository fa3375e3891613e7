"""Flow matching in vla-rl's own policies (``diffusion`` and ``diffusion_vla`` with ``--policy.objective=flow``):
the one definition of the objective's training pair, its Euler sampler (with real-time-chunking guidance,
committed rows and steering), its RL chain, and the steering hooks (`vla_core.types.FlowSteerable`).

Time runs as in openpi and LeRobot (and `policies.flow_guidance`): t = 1 is noise, t = 0 the actions.
Training draws t ~ U(0, 1) and regresses the velocity noise - x_0 at x_t = t * noise + (1 - t) * x_0;
sampling integrates from t = 1 to 0 in n Euler steps of 1/n, x <- x - v(x, t_k) / n at t_k = 1 - k / n.
RL (ReinFlow) makes each Euler step a Gaussian of std ``noise.min_std`` around that step
(`policies.denoising_chain`). Everything is in normalized action units ([-1, 1] is the dataset's range).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

from policies.denoising_chain import DenoisingChain, ExplorationNoise, sample_chain
from policies.flow_guidance import guided_velocity
from vla_core.types import OBS_STATE, Steer

Objective = Literal["flow", "ddpm"]  # flow matching (Euler sampling) or epsilon prediction (DDPM noise)
FLOW_FIX = "train with --policy.objective=flow"

# One network pass of a flow policy: (x (B, H, A), t (B,), want_latents) -> (velocity (B, H, A), latents
# (B, latent_dim), or None when not asked for). The observation is already encoded (closed over).
FlowPass = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]


def check_objective(objective: str) -> None:
    """Raise ValueError naming the choices unless ``objective`` is one."""
    if objective not in get_args(Objective):
        raise ValueError(f"policy.objective must be one of {get_args(Objective)}, got {objective!r}")


def flow_times(num_steps: int) -> list[float]:
    """The time of each Euler step, 1 - k / n for k = 0 .. n - 1 (from noise toward the actions)."""
    return [1.0 - k / num_steps for k in range(num_steps)]


def flow_training_pair(target: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, the velocity to regress): x_t = t * noise + (1 - t) * target and noise - target. target, noise
    (..., H, A) normalized; t broadcastable to them (one time per chunk: shaped (..., 1, 1))."""
    return t * noise + (1 - t) * target, noise - target


def time_batch(t: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """(B,) float32 times from a float or a tensor of shape () or (B,)."""
    t = torch.as_tensor(t, dtype=torch.float32, device=device)
    if t.ndim > 1 or (t.ndim == 1 and len(t) != batch):
        raise ValueError(f"t must be a float or a (B,) = ({batch},) tensor of times in [0, 1], got {tuple(t.shape)}")
    return t.expand(batch)


def steering(steer: Steer, x: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``steer(x, t, latents)`` (``steer(x, t, latents, v)`` for a steer that ``reads_velocity``: v the policy's
    velocity at this step), checked: the extra velocity (B, *noise_shape) added to the policy's."""
    extra = steer(x, t, latents, v) if getattr(steer, "reads_velocity", False) else steer(x, t, latents)
    if not torch.is_tensor(extra) or extra.shape != x.shape:
        shape = tuple(extra.shape) if torch.is_tensor(extra) else type(extra).__name__
        raise ValueError(f"steer must return an extra velocity shaped like x_t, (B, *noise_shape) = {tuple(x.shape)}, "
                         f"got {shape}")  # fmt: skip
    return extra.to(x)


def euler_sample(
    flow_pass: FlowPass,
    x: torch.Tensor,
    num_steps: int,
    *,
    committed: tuple[torch.Tensor, torch.Tensor] | None = None,
    guidance: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    steer: Steer | None = None,
) -> torch.Tensor:
    """Euler integration from t = 1 (x, the initial noise (B, H, A)) to t = 0: the chunk, unclamped.

    committed: (clean (B, H, A), known (B, H)): the known rows of x are set to their clean actions before
    every step (training-time RTC). guidance: (target (B, H, A), weights broadcastable to x, max_guidance):
    real-time-chunking guidance of each velocity (`policies.flow_guidance`; a known row is clean, its
    time 0). steer: each step's velocity gets ``steer(x, t, latents)`` added, after any guidance.
    """
    known = None if committed is None else committed[1]
    for t in flow_times(num_steps):
        if committed is not None:
            x = torch.where(known[..., None], committed[0], x)
        time = torch.full((x.shape[0],), t, device=x.device)
        want = steer is not None
        if guidance is None:
            v, latents = flow_pass(x, time, want)
        else:
            v, latents = _guided(flow_pass, x, t, time, known, guidance, want)
        if steer is not None:
            v = v + steering(steer, x, time, latents, v)
        x = x - v / num_steps
    return x


def _guided(flow_pass: FlowPass, x, t: float, time, known, guidance, want_latents: bool):
    """The guided velocity at x and the latents of the pass that computed it (detached)."""
    target, weights, max_guidance = guidance
    seen = {}

    def velocity(z: torch.Tensor) -> torch.Tensor:
        v, seen["latents"] = flow_pass(z, time, want_latents)
        return v

    per_row = None if known is None else torch.where(known[..., None], 0.0, t)  # a known row is clean: time 0
    v = guided_velocity(velocity, x, t, target, weights, max_guidance, per_row)
    latents = seen["latents"]
    return v, None if latents is None else latents.detach()


def sample_flow_chain(
    flow_pass: FlowPass,
    initial: torch.Tensor,
    num_steps: int,
    noise: ExplorationNoise,
    committed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[DenoisingChain, torch.Tensor]:
    """RL sampling (ReinFlow): each Euler step x - v / n plus Gaussian noise of std ``noise.min_std``, the
    known rows of ``committed`` clean in every latent. Returns the chain and its log-probability (B,)."""
    times = flow_times(num_steps)

    def step_mean(x: torch.Tensor, k: int) -> torch.Tensor:
        v, _ = flow_pass(x, torch.full((x.shape[0],), times[k], device=x.device), False)
        return x - v / num_steps

    std = torch.full((num_steps,), float(noise.min_std), device=initial.device)
    return sample_chain(step_mean, initial, std, None, committed)


class FlowHooks:
    """The steering hooks (`vla_core.types.FlowSteerable`) of vla-rl's own denoising policies, and what their
    flow objective shares: offered under ``objective=flow``, refused under ``ddpm`` with the fix.

    A policy (a `policies.pretrained.PreTrainedPolicy` whose config has ``objective``) implements
    - ``_flow_inputs(obs, prepared=None)`` -> (condition, committed): the observation encoded once, and
      the delay augmentation's committed actions normalized (clean (B, H, A), known (B, H)), or None;
    - ``_flow_pass(x, t, condition, committed, want_latents)`` -> (velocity (B, H, A), latents
      (B, latent_dim) or None): one network pass at x (B, H, A) and t (B,), the known rows held clean;
    - ``_latent_width``: latent_dim.
    """

    @property
    def noise_shape(self) -> tuple[int, int]:
        """(horizon, action_dim): one sample's initial noise (`vla_core.types.FlowSteerable`), either objective."""
        return self.config.horizon, self.config.action_dim

    @property
    def supports_inpainting(self) -> bool:
        """Whether ``predict_chunk`` accepts ``inpaint`` (real-time chunking guidance): flow sampling only."""
        return self.config.objective == "flow"

    def require_flow(self, what: str) -> None:
        """Raise ValueError naming the fix unless the policy has a flow velocity."""
        if self.config.objective != "flow":
            raise ValueError(
                f"{what} needs a flow velocity, but this {self.config.type} policy has "
                f"objective={self.config.objective}; {FLOW_FIX}"
            )

    @property
    def latent_dim(self) -> int:
        """The width of ``latents``."""
        self.require_flow("latent_dim")
        return self._latent_width

    def velocity(self, obs: dict, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """(B, horizon, action_dim) the flow velocity at x_t (B, horizon, action_dim, normalized) and time t
        (a float or (B,), 1 = noise); the observation's committed rows held clean as ``predict_chunk`` holds
        them. Autograd follows the caller."""
        self.require_flow("velocity")
        return self._probe(obs, x_t, t, want_latents=False)[0]

    def latents(self, obs: dict, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """(B, latent_dim) the action expert's last hidden state at x_t and t (see ``velocity``), as the
        velocity's output layer reads it, pooled over the chunk (see the policy's ``_latent_width``)."""
        self.require_flow("latents")
        return self._probe(obs, x_t, t, want_latents=True)[1]

    def _probe(self, obs: dict, x_t: torch.Tensor, t, want_latents: bool):
        condition, committed = self._flow_inputs(obs)
        b = obs[OBS_STATE].shape[0]
        shape = (b, *self.noise_shape)
        if tuple(x_t.shape) != shape:
            raise ValueError(f"x_t must be (B, horizon, action_dim) = {shape}, got {tuple(x_t.shape)}")
        x = x_t.to(self.device, torch.float32)
        return self._flow_pass(x, time_batch(t, b, x.device), condition, committed, want_latents)

    def _sample_flow(self, x, condition, committed, inpaint, steer: Steer | None) -> torch.Tensor:
        """``predict_chunk``'s flow sampler: x (B, H, A) the initial noise -> the chunk, normalized and
        unclamped. inpaint: (target (B, H, A) in dataset units, weights (B, H)) or None."""
        guidance = None
        if inpaint is not None:
            target = self.normalize_action(inpaint[0].to(x))
            guidance = (target, inpaint[1].to(x)[..., None], self.config.rtc_max_guidance)

        def flow_pass(z: torch.Tensor, t: torch.Tensor, want_latents: bool):
            return self._flow_pass(z, t, condition, committed, want_latents)

        return euler_sample(flow_pass, x, self.config.num_inference_steps, committed=committed, guidance=guidance,
                            steer=steer)  # fmt: skip

    def _sample_flow_chain(self, initial, condition, committed, noise: ExplorationNoise):
        """``sample_with_log_prob``'s flow chain: see `sample_flow_chain`."""

        def flow_pass(z: torch.Tensor, t: torch.Tensor, want_latents: bool):
            return self._flow_pass(z, t, condition, committed, want_latents)

        return sample_flow_chain(flow_pass, initial, self.config.num_inference_steps, noise, committed)

    def rl_actor(self, noise: ExplorationNoise, augmentation_width: int = 0):
        """The denoising actor (`policies.denoising_chain.DenoisingRL`); a flow policy refuses an eta, which
        would do nothing (its Euler steps' std is ``noise.min_std``)."""
        if self.config.objective == "flow" and noise.eta != 0:
            raise ValueError(
                f"--noise.eta={noise.eta} does nothing for a flow policy (its Euler steps' std is --noise.min_std); "
                f"drop --noise.eta"
            )
        return super().rl_actor(noise, augmentation_width)
