"""What PPO and GRPO share in an update: the clipped surrogate over denoising steps, minibatches, and a
gradient step that skips non-finite losses and gradients.

Why the ratio is per denoising step: a chain's log-probability sums K steps x H x A Gaussian
dimensions (10 x 16 x 4 = 640 for the default diffusion policy), so the ratio of whole chains
leaves PPO's clip range after the smallest update and the clipped objective goes flat. DPPO's
answer, taken here: each denoising step is its own action with its own ratio r_k, clipped on its
own, and every step of a chunk gets the chunk's advantage. The chain's log-probability is still
the sum of the per-step terms (``PreTrainedPolicy.log_prob``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def clipped_surrogate(
    new_log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantage: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped objective, as a loss to minimize, over per-denoising-step ratios.

    new_log_prob, old_log_prob: (B, K) per-step log-probabilities; advantage: (B,), shared by the
    chunk's K steps. Asymmetric clip ("clip-higher"): r is kept in [1 - clip_low, 1 + clip_high].

        r_bk = exp(new_bk - old_bk)
        loss = -mean_bk min(r_bk A_b, clip(r_bk, 1 - clip_low, 1 + clip_high) A_b)
    """
    log_ratio = new_log_prob - old_log_prob
    ratio = log_ratio.exp()
    adv = advantage[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = {
            "clip_fraction": float(((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float().mean()),
            # k3 estimator of KL(old || new) per denoising step (Schulman's approximation)
            "approx_kl": float(((ratio - 1) - log_ratio).mean()),
        }
    return loss, stats


def kl_to_reference(new_log_prob: torch.Tensor, reference_log_prob: torch.Tensor) -> torch.Tensor:
    """Mean per-step KL(new || reference), k3 estimator on the sampled chains: e^(ref - new) - 1 - (ref - new)."""
    diff = reference_log_prob - new_log_prob
    return (diff.exp() - 1 - diff).mean()


def minibatches(count: int, size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """A random permutation of ``range(count)`` cut into index tensors of at most ``size``."""
    order = torch.randperm(count, generator=generator)
    for start in range(0, count, size):
        yield order[start : start + size]


@torch.no_grad()
def batched_log_prob(policy, obs: dict, chain, batch_size: int) -> torch.Tensor:
    """(M, K) per-step log-probabilities of M chains under ``policy``'s weights now, in batches."""
    from vla_rl.rl.rollout import select_rows, to_device

    out = []
    for start in range(0, len(chain), batch_size):
        rows = torch.arange(start, min(start + batch_size, len(chain)))
        sub = to_device(select_rows(obs, rows), policy.device)
        out.append(policy.log_prob(sub, chain.select(rows).to(policy.device), per_step=True).cpu())
    return torch.cat(out)


def actor_loss(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    clip_low: float,
    clip_high: float,
    reference_log_prob: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate, plus kl_coef * KL(pi || reference) when a reference is given."""
    loss, stats = clipped_surrogate(new_log_prob, old_log_prob, advantage, clip_low, clip_high)
    if reference_log_prob is not None and kl_coef > 0:
        kl = kl_to_reference(new_log_prob, reference_log_prob)
        loss = loss + kl_coef * kl
        stats["kl_to_imitation"] = kl.item()
    return loss, stats


def actor_loss_per_task(tasks: torch.Tensor, all_tasks: torch.Tensor, new_log_prob, old_log_prob, advantage,
                        clip_low, clip_high, reference_log_prob=None, kl_coef=0.0) -> list[torch.Tensor | None]:  # fmt: skip
    """`actor_loss` of each task of a minibatch, for PCGrad: one entry per task in ``all_tasks`` (the
    whole minibatch's (R,) task ids), over this process's rows (``tasks``, with the other tensors),
    weighted by their share of the task's rows; None where this process holds none of them."""
    losses: list[torch.Tensor | None] = []
    for t in all_tasks.unique().tolist():
        m = tasks == t
        if not m.any():
            losses.append(None)
            continue
        reference = None if reference_log_prob is None else reference_log_prob[m]
        loss = actor_loss(new_log_prob[m], old_log_prob[m], advantage[m], clip_low, clip_high, reference, kl_coef)[0]
        losses.append(loss * (m.sum() / (all_tasks == t).sum()))
    return losses


class Processes:
    """The processes of a data-parallel run (``accelerate launch``), or the one process of a plain run.

    Every process holds the same union of the rollouts (``gather``) and draws the same minibatches;
    each computes the loss on its shard of a minibatch (``shard``), weighted by the shard's share,
    and the gradients are summed across processes (``sum``): the gradient of the whole minibatch's
    loss, the same in every process, so the weights stay identical.
    """

    def __init__(self, accelerator=None):
        self.accelerator = accelerator
        self.index = accelerator.process_index if accelerator is not None else 0
        self.count = accelerator.num_processes if accelerator is not None else 1

    def shard(self, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        """This process's rows of a minibatch and their share of it."""
        mine = rows[self.index :: self.count]
        return mine, len(mine) / max(1, len(rows))

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum") if self.count > 1 else tensor

    def gather(self, obj) -> list:
        """Every process's ``obj``, in process order (pickled through the process group)."""
        if self.count == 1:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])


class GradientStep:
    """optimizer.step() guarded against non-finite values: a NaN or inf loss or gradient skips the
    update (the weights stay the last good ones) and is counted in ``skipped``.

    With ``per_task`` losses (multi-task runs with PCGrad), the gradient is PCGrad's projection of
    the per-task gradients, averaged over the tasks (`vla_rl.rl.pcgrad`), instead of ``loss``'s. In
    a data-parallel run the gradients (each task's, before PCGrad) are summed across ``processes``
    first, so every process takes the same step or skips the same one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, max_grad_norm: float, seed: int = 0,
                 processes: Processes | None = None):  # fmt: skip
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.processes = processes or Processes()
        self.skipped = 0
        self.generator = torch.Generator().manual_seed(seed)  # PCGrad's order of the other tasks

    def __call__(self, loss: torch.Tensor | None, per_task: list[torch.Tensor | None] | None = None) -> bool:
        """Step along the gradient of ``loss`` (or PCGrad over ``per_task``); returns whether the step was
        taken. None: this process holds no rows of the minibatch (it adds a zero gradient)."""
        from vla_rl.rl.pcgrad import flat_grad, pcgrad, set_flat_grad

        self.optimizer.zero_grad(set_to_none=True)
        trainable = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

        size = sum(p.numel() for p in trainable)

        def gradient(term: torch.Tensor | None) -> torch.Tensor:
            if term is None:
                local = torch.zeros(size)
            elif not torch.isfinite(term):  # skipped everywhere: the sum of a NaN is NaN in every process
                local = torch.full((size,), float("nan"))
            else:
                local = flat_grad(term, trainable)
            return self.processes.sum(local.to(trainable[0].device))

        if per_task is not None and len(per_task) > 1:
            flat = pcgrad([gradient(term) for term in per_task], self.generator) / len(per_task)
        else:
            flat = gradient(loss)
        if not torch.isfinite(flat).all():
            self.skipped += 1
            return False
        set_flat_grad(trainable, flat)
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(trainable, self.max_grad_norm)
        self.optimizer.step()
        return True
