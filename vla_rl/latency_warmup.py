"""Fitting a latency-aware policy's fast head on demonstrations before RL (``vla-rl finetune
--latency_aware --latency_warmup.steps=N --latency_warmup.dataset=DIR``).

The fast head (`policies.latency_head`) starts at zero, so with RL alone it must find out from the
reward what the committed actions and the mid-inference observation say. In a short RL budget it
barely moves (``vla-rl bench latency-rl``). The demonstrations already show what it should do.
Take a chunk requested at frame t of a demonstration, under delay d, as the simulation's shell
(`vla_core.runtime.delayed_env.DelayedChunkEnv`) lays it out:

- chunk row j is the action for step t + j; rows j < d are past when the chunk arrives and never
  run, so they are not trained;
- the actions that run meanwhile are the demonstration's own, at t .. t + d - 1: the committed
  actions (``committed_prefix``, as in training-time RTC);
- the world m = floor(mid_fraction * d) steps into the window (`vla_core.runtime.mid_inference_steps`)
  is frame t + m. Where the episode ends before it, the shell drops the request; every row such a
  frame could train (j >= d > m) is past the episode's end, so it trains nothing.

With a lead (``--chunking.lead_steps=L``: a chunk's first action runs L steps after it arrives), the
delay the shell announces, and lays the chunk out by, is D = d + L (capped at H - 1, as the
protocol caps it): rows j < D never run and D actions are committed; the mid-inference observation
stays in the inference's window, m = floor(mid_fraction * (D - L)).

So the warm-up trains the head alone with the policy's own denoising loss. The inputs are the
request's observation (frame t), the delay augmentation and the mid-inference observation of
frame t + m. The target is the demonstrated chunk t .. t + H - 1, its rows d .. H - 1 in the loss.
The slow encoder and the denoiser stay the imitation policy's: only what the fast part reads is
learned here, and RL then starts from a head that already means something.

Not reproduced from demonstrations: an episode's first request, whose queue is empty at rollout
(nothing committed, the robot holds), and a measured delay estimate that differs from the true
delay (``--delay.estimate=measured``): here the announced delay is the true one.

Delays come from the run's own delay model (``--delay``), drawn from a generator of their own
(seeded by the run's seed), so the warm-up never moves the rollouts' stream of delays.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from vla_core.runtime import DelayConfig, DelayModel, committed_prefix, mid_inference_steps, mid_observation
from vla_core.types import ACTION


@dataclass
class LatencyWarmupConfig:
    """Supervised steps of the fast head on demonstrations, before RL (0 = none: RL starts it from zero)."""

    steps: int = 0  # supervised steps of the head before RL (0 = none)
    # The LeRobotDataset to read (usually the one the imitation checkpoint was trained on); needed when steps > 0
    dataset: str = ""
    batch_size: int = 64  # demonstration frames per step, each with a delay drawn from --delay
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
    max_delay: int, lead_steps: int = 0,
) -> dict:  # fmt: skip
    """Frames ``idx`` (B,) as a latency-aware policy sees them under announced delays ``delays`` (B,) long (the
    inference's steps plus ``lead_steps``): the request's observation (frame t), the delay augmentation (actions
    t .. t + D - 1), the mid-inference observation (frame t + m, m = floor(mid_fraction * (D - lead_steps)),
    clamped to the episode's last), and as ``action`` (B, horizon, A) the demonstrated chunk t .. t + horizon - 1,
    whose ``action_is_pad`` (B, horizon) marks the rows past the episode's end and the rows j < D, which never run."""
    batch = demos.batch(idx, horizon)
    batch.update(committed_prefix(batch[ACTION], batch["action_is_pad"], delays, max_delay))
    past = torch.arange(horizon)[None] < delays[:, None]  # (B, H): over before the chunk's first action
    batch["action_is_pad"] = batch["action_is_pad"] | past
    # The mid point is in the inference's window, which the lead (after the chunk arrives) is not part of.
    steps = mid_inference_steps((delays - lead_steps).clamp(min=0), mid_fraction)
    # A frame whose episode ends before t + m has nothing left to train (see the module docstring);
    # its mid frame is clamped only to stay inside the episode.
    mid_frames = torch.minimum(idx + steps, demos.episode_end[idx] - 1)
    batch.update(mid_observation(demos.batch(mid_frames, 1), mid_cameras, steps))
    return batch


def warm_up_latency_head(
    policy, demos, delay: DelayConfig, control_dt: float, cfg: LatencyWarmupConfig, seed: int, lead_steps: int = 0
) -> list[float]:
    """Train ``policy.latency_head`` alone for ``cfg.steps`` steps (see the module docstring); every other
    parameter is left as it was. delay: the run's delay model, control_dt: its control period, lead_steps: the
    run's ``chunking.lead_steps``. Returns the loss of every step."""
    pcfg = policy.config
    if policy.latency_head is None:
        raise ValueError("the policy has no fast head to warm up; add it first (add_latency_head)")
    # The run's delay model with a stream of its own, from the run's seed: the rollouts' delays are untouched.
    delays = DelayModel(dataclasses.replace(delay, seed=seed), control_dt)
    generator = torch.Generator().manual_seed(seed)  # frames
    device = policy.device
    noise = torch.Generator(device=device).manual_seed(seed)  # the denoising loss's noise and timesteps
    trainable = {name: p.requires_grad for name, p in policy.named_parameters()}
    head = [p for name, p in policy.named_parameters() if name.startswith("latency_head.")]
    for name, p in policy.named_parameters():
        p.requires_grad_(name.startswith("latency_head."))
    opt = torch.optim.AdamW(head, lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, cfg.steps))))
    losses = []
    try:
        for _ in tqdm(range(cfg.steps), desc="fast head on demonstrations", unit="step", leave=False):
            idx = torch.randint(0, len(demos), (cfg.batch_size,), generator=generator)
            # announced as the protocol does: the drawn delay plus the lead, capped at the chunk's last index
            d = (delays.sample(cfg.batch_size) + lead_steps).clamp(max=pcfg.horizon - 1)
            batch = delayed_sample(demos, idx, d, pcfg.mid_fraction, pcfg.mid_cameras, pcfg.horizon,
                                   pcfg.latency_max_delay, lead_steps)  # fmt: skip
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            loss = policy(batch, generator=noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if not (torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in head if p.grad is not None)):
                raise ValueError(
                    f"the fast head's warm-up loss or gradient became {loss.item()} at step {len(losses)}; lower "
                    f"--latency_warmup.lr (now {cfg.lr})"
                )
            opt.step()
            schedule.step()
            losses.append(loss.item())
    finally:
        for name, p in policy.named_parameters():
            p.requires_grad_(trainable[name])
    return losses
