"""Fitting a new low-latency part (`policies.low_latency`) on demonstrations before RL (``vla-rl finetune
--low_latency --latency_warmup.steps=N --latency_warmup.dataset=DIR``).

The part starts at zero: with RL alone it must find out from the reward what the fresh frame says that the
plan does not. The demonstrations show it: the demonstrator acted on each frame as it was. Under a fixed delay
d with s steps a chunk, the simulation's shell (`vla_core.runtime.delayed_env.DelayedChunkEnv`) lays an episode
out from its first step (`window_layout`): a request every P = max(s, d) steps (one inference at a time), the
chunk of the request at step iP runs steps iP + d .. iP + d + P - 1, its rows d .. d + P - 1, and before step d
nothing is planned and the arm holds. So at in-episode step tau >= d:

- the plan is the slow policy's chunk made from frame iP (i = floor((tau - d) / P)) from its row k = tau - iP on
  (the plan's age k), the steps since the latest request tau mod P;
- the demonstrator's action at tau, a_tau, is what the part should make of it from frame tau: its target
  correction is normalize(a_tau) - normalize(plan row k), the loss the squared error of its mean correction.

Before step d the base is the hold action, the arm's last target: the demonstration's previous action (frame 0
has none and is not trained). The slow policy is frozen and its chunks are computed once, deterministically,
for every frame that starts a window. The part's sigma is RL's and is left as it is.
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from vla_core.runtime.delayed_env import window_layout
from vla_core.runtime.protocol import StepContext


@torch.no_grad()
def slow_chunks(policy, demos, frames: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """(F, H, A) the slow policy's chunk of each of ``frames`` as it makes them in rollouts, in dataset units, on
    the CPU."""
    out = []
    for start in range(0, len(frames), batch_size):
        idx = frames[start : start + batch_size]
        batch = {k: v.to(policy.device) if torch.is_tensor(v) else v for k, v in demos.batch(idx, 1).items()}
        out.append(policy.predict_chunk(batch).actions.cpu())
    return torch.cat(out)


def warmup_batch(policy, demos, chunks: dict[int, torch.Tensor], idx: torch.Tensor, delay: int, steps_per_chunk: int):
    """The part's inputs and target corrections for frames ``idx`` (B,) (see the module docstring): (inputs, target
    (B, A) in normalized action units). chunks: window-start frame -> its slow chunk (H, A)."""
    rows = policy.config.low_latency_rows
    tau = idx - _episode_start(demos, idx)  # the in-episode step
    request, age, since = window_layout(tau, delay, steps_per_chunk)
    horizon, action_dim = policy.config.horizon, policy.config.action_dim
    plan, queued = torch.zeros(len(idx), rows, action_dim), torch.zeros(len(idx), rows, dtype=torch.bool)
    base = demos.action[(idx - 1).clamp(min=0)].clone()  # the hold action before the first chunk: the last target
    for b, (frame, t, r, k) in enumerate(zip(idx.tolist(), tau.tolist(), request.tolist(), age.tolist(), strict=True)):
        if r < 0:
            continue
        chunk = chunks[frame - t + r]  # made from the frame of the window's request
        take = min(rows, horizon - k)
        plan[b, :take], queued[b, :take] = chunk[k : k + take], True
        base[b] = chunk[k]
    batch = {key: v.to(policy.device) if torch.is_tensor(v) else v for key, v in demos.batch(idx, 1).items()}
    context = StepContext(plan, queued, age, since)
    inputs = policy.low_latency_inputs(batch, base, context)
    target = policy.normalize_action(demos.action[idx].to(policy.device)) - policy.normalize_action(
        base.to(policy.device)
    )
    return inputs, target


def _episode_start(demos, idx: torch.Tensor) -> torch.Tensor:
    """(B,) the first frame of each frame's episode."""
    first = torch.ones(len(demos), dtype=torch.bool)
    first[1:] = demos.episode[1:] != demos.episode[:-1]
    starts = torch.nonzero(first).flatten()
    return starts[torch.bucketize(idx, starts, right=True) - 1]


def warm_up_low_latency(policy, demos, delay: int, steps_per_chunk: int, cfg, seed: int) -> list[float]:
    """Train ``policy.low_latency``'s mean alone for ``cfg.steps`` steps of ``cfg.batch_size`` frames (every frame
    but its episode's first), AdamW at ``cfg.lr`` cosine-decayed; returns every step's loss."""
    if policy.low_latency is None:
        raise ValueError("the policy has no low-latency part to warm up; add it first (add_low_latency)")
    start = _episode_start(demos, torch.arange(len(demos)))
    request, _, _ = window_layout(torch.arange(len(demos)) - start, delay, steps_per_chunk)
    windows = torch.unique((start + request)[request >= 0])
    chunks = dict(zip(windows.tolist(), slow_chunks(policy, demos, windows), strict=True))
    trainable = torch.nonzero(torch.arange(len(demos)) != start).flatten()
    generator = torch.Generator().manual_seed(seed)
    part = policy.low_latency
    params = [p for name, p in part.named_parameters() if name != "log_std"]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, cfg.steps))))
    losses = []
    for _ in tqdm(range(cfg.steps), desc="low-latency part on demonstrations", unit="step", leave=False):
        idx = trainable[torch.randint(0, len(trainable), (cfg.batch_size,), generator=generator)]
        inputs, target = warmup_batch(policy, demos, chunks, idx, delay, steps_per_chunk)
        loss = (part(inputs)[0] - target).square().sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not torch.isfinite(loss):
            raise ValueError(f"the low-latency warm-up's loss became {loss.item()}; lower --latency_warmup.lr")
        opt.step()
        schedule.step()
        losses.append(loss.item())
    return losses
