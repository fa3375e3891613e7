"""Fitting a latency-aware policy's fast head on demonstrations before RL (``vla-rl finetune
--latency_aware --latency_warmup.steps=N --latency_warmup.dataset=DIR``).

The fast head (`policies.latency_head`) starts at zero, so with RL alone it must find out from the
reward what the committed actions and the mid-inference observation say. In a short RL budget it
barely moves (``vla-rl bench latency-rl``). The demonstrations already show what it should do.
Take a chunk requested at frame t of a demonstration, under delay d:

- the chunk starts at t + d;
- the actions that run before it are the demonstration's own, at t .. t + d - 1: the committed
  actions (``committed_prefix``, as in training-time RTC);
- the world m = floor(mid_fraction * d) steps into the window (`vla_rl.runtime.mid_inference_steps`)
  is frame t + m, clamped to the episode's last frame, as the simulation's shell clamps it at an
  episode's end.

So the warm-up trains the head alone with the policy's own denoising loss. The inputs are the
request's observation (frame t), the delay augmentation and the mid-inference observation of
frame t + m. The target is the demonstrated chunk at t + d .. t + d + H - 1. The slow encoder and
the denoiser stay the imitation policy's: only what the fast part reads is learned here, and RL
then starts from a head that already means something.

Delays come from the run's own delay model (``--delay``), drawn from a generator of their own
(seeded by the run's seed), so the warm-up is the same in every process of a run and never moves
the rollouts' stream of delays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from vla_rl.runtime import DelayConfig, DelayModel, committed_prefix, mid_inference_steps, mid_observation
from vla_rl.types import ACTION


@dataclass
class LatencyWarmupConfig:
    """Supervised steps of the fast head on demonstrations, before RL (0 = none: RL starts it from zero)."""

    steps: int = 0
    # The LeRobotDataset to read (usually the one the imitation checkpoint was trained on); needed when steps > 0
    dataset: str = ""
    batch_size: int = 64
    lr: float = 1e-3  # AdamW, cosine-decayed to 0 over the steps (the imitation policy's peak rate)

    def validate(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(
                f"--latency_warmup.steps={self.steps} must be >= 0, --latency_warmup.batch_size={self.batch_size} "
                f">= 1 and --latency_warmup.lr={self.lr} > 0"
            )
        if self.steps and not self.dataset:
            raise ValueError(
                "--latency_warmup.steps > 0 fits the fast head on demonstrations; give them with "
                "--latency_warmup.dataset=<LeRobotDataset dir> (the imitation checkpoint's own dataset)"
            )


def delayed_sample(
    demos, idx: torch.Tensor, delays: torch.Tensor, mid_fraction: float, mid_cameras: list[str], horizon: int,
    max_delay: int,
) -> dict:  # fmt: skip
    """Frames ``idx`` (B,) as a latency-aware policy sees them under ``delays`` (B,) long: the request's
    observation (frame t), the delay augmentation (actions t .. t + d - 1), the mid-inference
    observation (frame min(t + m, episode's last)), and as ``action`` (B, horizon, A) /
    ``action_is_pad`` (B, horizon) the chunk that starts at t + d."""
    full = demos.batch(idx, horizon + max_delay)  # actions t .. t + D + H - 1, padded past the episode
    batch = {k: v for k, v in full.items() if k not in (ACTION, "action_is_pad")}
    batch.update(committed_prefix(full[ACTION], full["action_is_pad"], delays, max_delay))
    rows = delays[:, None] + torch.arange(horizon)[None]  # (B, H): chunk step j runs at t + d + j
    batch[ACTION] = full[ACTION].gather(1, rows[..., None].expand(-1, -1, full[ACTION].shape[-1]))
    batch["action_is_pad"] = full["action_is_pad"].gather(1, rows)
    steps = mid_inference_steps(delays, mid_fraction)
    mid_frames = torch.minimum(idx + steps, demos.episode_end[idx] - 1)
    batch.update(mid_observation(demos.batch(mid_frames, 1), mid_cameras, mid_frames - idx))
    return batch


def warm_up_latency_head(
    policy, demos, delay: DelayConfig, control_dt: float, cfg: LatencyWarmupConfig, seed: int
) -> list[float]:
    """Train ``policy.latency_head`` alone for ``cfg.steps`` steps (see the module docstring); every other
    parameter is left as it was. delay: the run's delay model, control_dt: its control period.
    Returns the loss of every step."""
    pcfg = policy.config
    if policy.latency_head is None:
        raise ValueError("the policy has no fast head to warm up; add it first (add_latency_head)")
    missing = [cam for cam in pcfg.cameras if cam not in demos.cameras]
    if missing:
        raise ValueError(
            f"--latency_warmup.dataset has no camera {missing} that the policy reads; give the dataset it was "
            f"trained on"
        )
    delays = DelayModel(delay, control_dt)
    delays.generator.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)  # frames
    device = policy.device
    noise = torch.Generator(device=device).manual_seed(seed)  # the denoising loss's noise and timesteps
    trainable = {name: p.requires_grad for name, p in policy.named_parameters()}
    head = [p for name, p in policy.named_parameters() if name.startswith("latency_head.")]
    for name, p in policy.named_parameters():
        p.requires_grad_(name.startswith("latency_head."))
    opt = torch.optim.AdamW(head, lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    losses = []
    try:
        for _ in tqdm(range(cfg.steps), desc="fast head on demonstrations", unit="step", leave=False):
            idx = torch.randint(0, len(demos), (cfg.batch_size,), generator=generator)
            d = delays.sample(cfg.batch_size)
            batch = delayed_sample(demos, idx, d, pcfg.mid_fraction, pcfg.mid_cameras, pcfg.horizon,
                                   pcfg.latency_max_delay)  # fmt: skip
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            loss = policy(batch, generator=noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            losses.append(loss.item())
    finally:
        for name, p in policy.named_parameters():
            p.requires_grad_(trainable[name])
    return losses
