"""LeRobot's flow VLAs (pi0, pi05, SmolVLA) as denoising chains: RL's exact log-probabilities and RTC.

LeRobot samples these policies with one loop, ``lerobot.policies.common.flow_matching.euler_integrate``:
from noise x_0 at t = 1, K Euler steps x_{k+1} = x_k + dt * v(x_k, t_k), dt = -1/K, t_k = 1 + k dt,
where v is the policy's ``denoise_step`` on the observation's cached prefix. The integrator is the one
place vla-rl changes, for the length of one call of LeRobot's own ``predict_action_chunk`` (its
preprocessing, prefix and velocity untouched):

- RL sampling (`LeRobotFlowChains.sample`): each step's mean is exactly LeRobot's Euler step and
  Gaussian noise of a fixed std is added around it (ReinFlow, as this project's own flow policies do),
  so the chain has an exact density; with std 0 it is LeRobot's sampler.
- Scoring (``score``): the K step means of a stored chain, with autograd through the whole network
  (LeRobot's ``@torch.no_grad`` on its sampler is lifted for the call).
- Real-time chunking (``sample`` with guidance): each velocity is corrected by
  `policies.flow_guidance.guided_velocity`, the same guidance vla-rl's own flow policy uses.
- Steering (``Sampler`` with ``steer``, `vla_core.types.Steer`): each velocity gets the steer's extra
  velocity added, read with the action expert's hidden state of that step (`ExpertLatents`); the
  hooks ``velocity`` and ``latents`` evaluate one step (`Probe`).

The action expert's hidden state is read without touching LeRobot's code: pi0, pi05 and SmolVLA all
write the velocity as ``action_out_proj(suffix_out)``, suffix_out the expert's last hidden state of the
chunk's rows (after its final norm, float32, (B, chunk_size, width)), so a forward pre-hook on that
layer sees it at every velocity call (a LoRA-wrapped layer too: it is called with the same input).

The chain lives where LeRobot's sampler does: normalized actions (LeRobot's normalization of the
checkpoint, e.g. mean/std), padded to the model's ``max_action_dim``. The padded dimensions are sampled
and scored like the others (they are inputs of the next step's velocity, so the chain's density needs
them).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import types
from collections.abc import Callable
from typing import Self

import torch
from torch.utils.checkpoint import checkpoint

from policies.denoising_chain import DenoisingChain, check_chain_shape, sample_chain
from policies.flow_guidance import DEFAULT_MAX_GUIDANCE, guided_velocity
from policies.flow_matching import steering
from vla_core.types import Steer

# LeRobot's policy types whose sampler is `euler_integrate` over a `denoise_step` (LeRobot 0.6).
FLOW_TYPES = ("pi0", "pi05", "smolvla")

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x (B, H, A_max), time (B,)) -> v
# The integrator is a module global of LeRobot's: one replacement at a time in this process.
_PATCHING = threading.Lock()


def euler_times(num_steps: int) -> tuple[float, list[float]]:
    """LeRobot's dt and the time of each Euler step, computed as `euler_integrate` computes them."""
    dt = -1.0 / num_steps
    return dt, [1.0 + k * dt for k in range(num_steps)]


def time_tensor(t: float, x: torch.Tensor) -> torch.Tensor:
    """(B,) the time LeRobot passes its velocity: a float32 scalar expanded over the batch."""
    return torch.tensor(t, dtype=torch.float32, device=x.device).expand(x.shape[0])


@contextlib.contextmanager
def integrator(model, integrate: Callable, grad: bool = False):
    """Within the block, LeRobot's sampler of ``model`` (a LeRobot pi0/pi05/SmolVLA policy) integrates with
    ``integrate(velocity, noise, num_steps) -> x`` instead of its Euler loop. Yields the
    ``predict_action_chunk`` to call: LeRobot's own, or with ``grad`` the same function with its
    ``torch.no_grad`` (and its model's ``sample_actions``') lifted, so scores carry gradients."""
    module = sys.modules[type(model.model).__module__]

    def patched(denoise_fn, noise, num_steps, **_rtc):  # LeRobot's own RTC arguments: unused here
        return integrate(denoise_fn, noise, num_steps)

    inner, was_training = model.model, model.training
    with _PATCHING:
        original = module.euler_integrate
        module.euler_integrate = patched
        if grad:
            inner.sample_actions = types.MethodType(inspect.unwrap(type(inner).sample_actions), inner)
        try:
            yield (
                types.MethodType(inspect.unwrap(type(model).predict_action_chunk), model)
                if grad
                else (model.predict_action_chunk)
            )
        finally:
            module.euler_integrate = original
            if grad:
                del inner.sample_actions
            model.train(was_training)  # LeRobot's predict_action_chunk switched it to eval mode


class ExpertLatents:
    """Within the block, ``latest`` is the action expert's hidden state of the last velocity call, pooled:
    the input of LeRobot's ``action_out_proj`` (B, chunk_size, width), mean over the chunk's rows ->
    (B, width) (see the module docstring)."""

    def __init__(self, model):
        self.layer = model.model.action_out_proj
        self.latest: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.layer.in_features

    def _read(self, _layer, inputs) -> None:
        self.latest = inputs[0].mean(1)

    def __enter__(self) -> Self:
        self._handle = self.layer.register_forward_pre_hook(self._read)
        return self

    def __exit__(self, *_) -> None:
        self._handle.remove()


class Sampler:
    """An integrator that samples a chain: x_{k+1} = x_k + dt * v_k + std[k] * z (std 0: LeRobot's Euler
    steps), v_k guided toward ``guidance`` = (target (B, H, A_max) normalized, weights (B, H, A_max)) when
    given, then steered: v_k + steer(x_k, t_k, latents) with ``latents`` (an active `ExpertLatents`) read
    at that velocity call. After the call, ``chain`` and ``log_prob`` (B,) hold what it drew."""

    def __init__(self, std: torch.Tensor, guidance: tuple[torch.Tensor, torch.Tensor] | None = None,
                 max_guidance: float = DEFAULT_MAX_GUIDANCE, steer: Steer | None = None,
                 latents: ExpertLatents | None = None):  # fmt: skip
        if (steer is None) != (latents is None):
            raise ValueError("a steered Sampler reads the expert's latents: pass steer and latents together")
        self.std, self.guidance, self.max_guidance = std, guidance, max_guidance
        self.steer, self.latents = steer, latents
        self.chain: DenoisingChain | None = None
        self.log_prob: torch.Tensor | None = None

    def __call__(self, velocity: Velocity, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        if len(self.std) != num_steps:
            raise ValueError(
                f"the chain has {len(self.std)} step stds but LeRobot's sampler takes {num_steps} Euler steps; "
                f"the policy's num_inference_steps must be its LeRobot config's"
            )
        dt, times = euler_times(num_steps)

        def step_mean(x: torch.Tensor, k: int) -> torch.Tensor:
            t = time_tensor(times[k], x)
            if self.guidance is None:
                v = velocity(x, t)
            else:
                target, weights = self.guidance
                v = guided_velocity(lambda z: velocity(z, t), x, times[k], target, weights, self.max_guidance)
            if self.steer is not None:
                v = v + steering(self.steer, x, t, self.latents.latest.detach(), v)
            return x + dt * v

        std = self.std.to(noise)
        if (std > 0).any():
            self.chain, self.log_prob = sample_chain(step_mean, noise, std, eta=None)
        else:  # LeRobot's own steps (RTC guidance): no draws, so the random stream is the unguided one's
            latents = [noise]
            with torch.no_grad():
                for k in range(num_steps):
                    latents.append(step_mean(latents[-1], k))
            self.chain, self.log_prob = DenoisingChain(torch.stack(latents, 1), std, None, None), None
        return self.chain.latents[:, -1]


class Scorer:
    """An integrator that evaluates the K step means of a stored chain under the current weights, with
    autograd (the sampler's output is the chain's last latent, unchanged). ``means`` (B, K, H, A_max).

    checkpointed: each step's velocity pass keeps only its inputs and runs again in the backward pass
    (activation checkpointing; LeRobot's velocity clones the prefix's key-value cache on every call, so
    the recomputation sees what the first pass saw)."""

    def __init__(self, chain: DenoisingChain, checkpointed: bool = False):
        self.chain, self.checkpointed = chain, checkpointed
        self.means: torch.Tensor | None = None

    def __call__(self, velocity: Velocity, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        check_chain_shape(self.chain, noise.shape[0], num_steps, noise.shape[1], noise.shape[2])
        dt, times = euler_times(num_steps)
        inputs = self.chain.inputs().to(noise.device)
        means = []
        for k in range(num_steps):
            x, t = inputs[:, k], time_tensor(times[k], noise)
            v = checkpoint(velocity, x, t, use_reentrant=False) if self.checkpointed else velocity(x, t)
            means.append(x + dt * v)
        self.means = torch.stack(means, 1)
        return self.chain.latents[:, -1].to(noise)


class Probe:
    """An integrator that evaluates the velocity once, at ``x_t`` (B, chunk_size, max_action_dim) and ``t``
    (B,), into ``velocity``, and returns x_t (LeRobot's output of the call is not read)."""

    def __init__(self, x_t: torch.Tensor, t: torch.Tensor):
        self.x_t, self.t = x_t, t
        self.velocity: torch.Tensor | None = None

    def __call__(self, velocity: Velocity, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        self.velocity = velocity(self.x_t, self.t)
        return self.x_t


class CleanChunk:
    """An integrator that returns the chunk the policy predicts from zero noise at t = 1 (x - t v = -v):
    its one-step estimate of the clean actions, what a value head reads (no sampling)."""

    def __call__(self, velocity: Velocity, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        x = torch.zeros_like(noise)
        return -velocity(x, time_tensor(1.0, x))
