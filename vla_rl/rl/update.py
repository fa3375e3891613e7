"""What PPO and GRPO share in an update: the clipped surrogate over a decision's factors, minibatches,
and a gradient step that skips non-finite losses and gradients.

Why the ratio is per factor: a decision's log-probability is a sum of factors (`vla_core.rl.FactorLogProb`),
and for a denoising chain it sums K steps x H x A Gaussian dimensions (10 x 16 x 4 = 640 for the
default diffusion policy), so the ratio of whole chains leaves PPO's clip range after the smallest
update and the clipped objective goes flat. DPPO's answer, taken here for every kind of decision:
each factor (a denoising step, a token) is its own action with its own ratio r_k, clipped on its
own, and every factor of a decision gets the decision's advantage. Factors a decision lacks (the
mask) are left out of every mean.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from vla_core.rl import FactorLogProb, RLPolicy, masked_mean


def clipped_surrogate(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    clip_low: float,
    clip_high: float,
    mask: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped objective, as a loss to minimize, over per-factor ratios.

    new_log_prob, old_log_prob: (B, F) per-factor log-probabilities, ``old`` the proximal policy's (the
    weights at the start of the update); advantage: (B,), shared by the decision's F factors; mask:
    (B, F) the factors that exist (None: all); weight: (B, F) a stale sample's truncated importance
    weight w = min(pi_prox / pi_behaviour, rho_bar) (decoupled PPO, `Anchors`; None: on-policy, 1).
    Asymmetric clip ("clip-higher"): r is kept in [1 - clip_low, 1 + clip_high].

        r_bk = exp(new_bk - old_bk)
        loss = -mean_bk w_bk min(r_bk A_b, clip(r_bk, 1 - clip_low, 1 + clip_high) A_b)
    """
    log_ratio = new_log_prob - old_log_prob
    ratio = log_ratio.exp()
    adv = advantage[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    objective = torch.minimum(unclipped, clipped)
    loss = -masked_mean(objective if weight is None else weight * objective, mask)
    with torch.no_grad():
        stats = {
            "clip_fraction": float(masked_mean(((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float(), mask)),
            # k3 estimator of KL(old || new) per factor (Schulman's approximation)
            "approx_kl": float(masked_mean((ratio - 1) - log_ratio, mask)),
        }
    return loss, stats


def kl_to_reference(
    new_log_prob: torch.Tensor, reference_log_prob: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean per-factor KL(new || reference), k3 estimator on the sampled decisions: e^(ref - new) - 1 - (ref - new)."""
    diff = reference_log_prob - new_log_prob
    return masked_mean(diff.exp() - 1 - diff, mask)


@dataclass
class UpdateSettings:
    """What PPO's and GRPO's updates share (``vla-rl finetune``'s flags of the same names).

    factors: the factors of each decision the actor loss covers (``--train_last_steps``: the last k).
    generator: the minibatch order, the same stream in every process (saved with every checkpoint).
    head_lr: the latency head's learning rate (it starts at zero, or from its warm-up).
    """

    epochs: int
    minibatch_size: int
    clip_low: float
    clip_high: float
    factors: slice
    pcgrad: bool
    max_grad_norm: float
    lr: float
    head_lr: float
    generator: torch.Generator
    seed: int = 0  # PCGrad's order of the other tasks
    rho_bar: float = 1.0  # the largest importance weight a stale sample gets (`Anchors`)

    def actor_step(self, actor: RLPolicy, processes: Processes) -> GradientStep:
        """AdamW over the actor's trainable weights, the latency head (``latency_head.*``) in its own group
        at ``head_lr``, guarded by `GradientStep`."""
        named = [(name, p) for name, p in actor.module.named_parameters() if p.requires_grad]
        head = [p for name, p in named if name.startswith("latency_head.")]
        rest = [p for name, p in named if not name.startswith("latency_head.")]
        groups = [{"params": rest, "lr": self.lr}] + ([{"params": head, "lr": self.head_lr}] if head else [])
        optimizer = torch.optim.AdamW(groups, lr=self.lr, weight_decay=0.0)
        return GradientStep(optimizer, self.max_grad_norm, seed=self.seed, processes=processes)


def scored(actor: RLPolicy, rollout, settings: UpdateSettings) -> FactorLogProb:
    """(M, F') the log-probabilities of the rollout's decisions under ``actor``'s weights now, on
    ``settings.factors`` (e.g. the frozen imitation policy of the KL term)."""
    return batched_score(actor, rollout, settings.minibatch_size).columns(settings.factors)


@dataclass
class Anchors:
    """What an update's ratios are taken against (decoupled PPO, Hilton et al. 2021).

    proximal: (M, F') the learner's weights at the start of the update: the clip's centre, so PPO bounds
        how far the update moves the policy from where it is, however old the data.
    weight: (M, F') min(pi_prox / pi_behaviour, rho_bar) per factor, the truncated importance weight of
        a sample drawn by older weights (asynchronous rollouts; None: on-policy, every weight 1). The
        truncation bounds a stale sample's weight, for positive and negative advantages alike.
    decision_ratio: (M,) min(prod_k pi_prox / pi_behaviour, rho_bar) over a decision's factors (all of
        them, not only ``settings.factors``), the V-trace weight of its step in GAE (`vla_rl.rl.ppo.gae`);
        None on-policy.
    stats: ``staleness_kl`` (k3 KL(behaviour || proximal) per factor) and ``staleness_truncated`` (the
        fraction of factors whose weight was truncated), apart from the update's own approx_kl and
        clip_fraction.
    """

    proximal: FactorLogProb
    weight: torch.Tensor | None = None
    decision_ratio: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)


def anchors(actor: RLPolicy, rollout, settings: UpdateSettings, rho_bar: float = 1.0) -> Anchors:
    """The `Anchors` of an update on ``rollout``: the actor scores it now (the proximal policy); a rollout
    that recorded its behaviour log-probabilities (asynchronous workers) adds the truncated weights."""
    now = batched_score(actor, rollout, settings.minibatch_size)
    proximal = now.columns(settings.factors)
    if rollout.behaviour_log_prob is None:
        return Anchors(proximal)
    log_w = now.values - rollout.behaviour_log_prob.values  # (M, F) log pi_prox / pi_behaviour
    trained = log_w[:, settings.factors]
    weight = trained.exp().clamp(max=rho_bar)
    decision = log_w if now.mask is None else torch.where(now.mask, log_w, 0.0)
    mask = proximal.mask
    stats = {
        "staleness_kl": float(masked_mean(trained.exp() - 1 - trained, mask)),  # k3 of KL(behaviour || proximal)
        "staleness_truncated": float(masked_mean((trained.exp() > rho_bar).float(), mask)),
    }
    return Anchors(proximal, weight, decision.sum(1).exp().clamp(max=rho_bar), stats)


def minibatches(count: int, size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """A random permutation of ``range(count)`` cut into index tensors of at most ``size``."""
    order = torch.randperm(count, generator=generator)
    for start in range(0, count, size):
        yield order[start : start + size]


@torch.no_grad()
def batched_score(actor: RLPolicy, rollout, batch_size: int) -> FactorLogProb:
    """Per-factor log-probabilities of a rollout's M decisions (of the rows that ran) under ``actor``'s weights
    now, in batches, on the CPU."""
    from vla_rl.rl.rollout import select_rows, to_device

    out = []
    for start in range(0, len(rollout), batch_size):
        rows = torch.arange(start, min(start + batch_size, len(rollout)))
        sub = to_device(select_rows(rollout.obs, rows), actor.device)
        decision, executed = rollout.decision.select(rows).to(actor.device), rollout.executed[rows].to(actor.device)
        out.append(actor.score(sub, decision, executed).to("cpu"))
    return FactorLogProb.cat(out)


def actor_loss(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    clip_low: float,
    clip_high: float,
    reference_log_prob: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    mask: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate (with a stale sample's ``weight``), plus kl_coef * KL(pi || reference) when a
    reference is given."""
    loss, stats = clipped_surrogate(new_log_prob, old_log_prob, advantage, clip_low, clip_high, mask, weight)
    if reference_log_prob is not None and kl_coef > 0:
        kl = kl_to_reference(new_log_prob, reference_log_prob, mask)
        loss = loss + kl_coef * kl
        stats["kl_to_imitation"] = kl.item()
    return loss, stats


def actor_loss_per_task(tasks: torch.Tensor, task_rows: torch.Tensor, new_log_prob, old_log_prob, advantage,
                        clip_low, clip_high, reference_log_prob=None, kl_coef=0.0, mask=None,
                        weight=None) -> list[torch.Tensor | None]:  # fmt: skip
    """`actor_loss` of each task of a minibatch, for PCGrad: one entry per task the minibatch holds
    (``task_rows``: (T,) its rows of each task over every process, `Processes.task_rows`), over this
    process's rows (``tasks``, with the other tensors), weighted by their share of the task's rows; None
    where this process holds none of them."""
    losses: list[torch.Tensor | None] = []
    for t in task_rows.nonzero().flatten().tolist():
        m = tasks == t
        if not m.any():
            losses.append(None)
            continue
        reference = None if reference_log_prob is None else reference_log_prob[m]
        rows_mask = None if mask is None else mask[m]
        rows_weight = None if weight is None else weight[m]
        terms = (new_log_prob[m], old_log_prob[m], advantage[m], clip_low, clip_high, reference, kl_coef, rows_mask,
                 rows_weight)  # fmt: skip
        losses.append(actor_loss(*terms)[0] * (m.sum() / task_rows[t]))
    return losses


class Processes:
    """The processes of a data-parallel run (``accelerate launch``), or the one process of a plain run.

    Each process keeps its own rollouts: it scores them, takes their values and advantages, and cuts them
    into its part of every minibatch (``minibatches``); no image crosses processes. Advantages are
    normalized with the statistics of every process's (``mean_std``). Each process's loss on its part is
    weighted by its share of the minibatch's rows, and the gradients are summed across processes
    (``sum``): the gradient of the whole minibatch's loss, the same in every process, so the weights stay
    identical. Only small numbers are exchanged: row counts, two moments, rollout statistics (``gather``).
    """

    def __init__(self, accelerator=None):
        self.accelerator = accelerator
        self.index = accelerator.process_index if accelerator is not None else 0
        self.count = accelerator.num_processes if accelerator is not None else 1

    def minibatches(self, count: int, size: int, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, int]]:
        """This process's rows (of its ``count``) in each minibatch of one epoch, and the minibatch's rows
        over every process.

        One process: a random permutation of ``range(count)`` from ``generator``, cut into pieces of
        ``size``. Several: the epoch has K = ceil(total / size) minibatches in every process; each process
        permutes its own rows (from a seed drawn from ``generator``, so the stream advances alike in every
        process) and cuts them into K pieces of ceil(size * count / total), the last ones shorter or empty.
        """
        if self.count == 1:
            for rows in minibatches(count, size, generator):
                yield rows, len(rows)
            return
        total = int(self.sum_ints([count])[0])
        seed = int(torch.randint(2**62, (1,), generator=generator))
        if total == 0:
            return
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed + self.index))
        piece = -(-size * count // total)
        for k in range(-(-total // size)):
            rows = order[k * piece : (k + 1) * piece]
            rows_everywhere = int(self.sum_ints([len(rows)])[0])
            if rows_everywhere:  # every process's pieces ran out (the rounding up): no step, in every process
                yield rows, rows_everywhere

    def mean_std(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and population standard deviation of every process's ``x`` (1-D) together."""
        if self.count == 1:
            return x.mean(), x.std(unbiased=False)
        x64 = x.double()
        n, total, squares = self.sum(torch.stack([torch.tensor(float(len(x)), dtype=torch.float64), x64.sum(),
                                                  (x64 * x64).sum()]).to(self.device)).cpu()  # fmt: skip
        mean = total / n
        return mean.to(x.dtype), (squares / n - mean * mean).clamp(min=0).sqrt().to(x.dtype)

    def task_rows(self, tasks: torch.Tensor) -> torch.Tensor:
        """(T,) rows of each task id in a minibatch over every process, from this process's (R,) ``tasks``."""
        if self.count == 1:
            return torch.bincount(tasks)
        width = int(self.max_int(int(tasks.max()) + 1 if len(tasks) else 0))
        return self.sum_ints(torch.bincount(tasks, minlength=width).tolist() if width else [])

    def sum_ints(self, values: list[int]) -> torch.Tensor:
        """(len(values),) long: each value summed over the processes."""
        local = torch.tensor(values, dtype=torch.long)
        return local if self.count == 1 or not len(values) else self.sum(local.to(self.device)).cpu()

    def max_int(self, value: int) -> int:
        if self.count == 1:
            return value
        return int(self.reduce(torch.tensor([value], device=self.device), "max")[0])

    @property
    def device(self) -> torch.device:
        return self.accelerator.device if self.accelerator is not None else torch.device("cpu")

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.reduce(tensor, "sum") if self.count > 1 else tensor

    def reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """The one collective every other is made of: ``tensor`` reduced by ``op`` (sum, max) across processes."""
        return self.accelerator.reduce(tensor, reduction=op)

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
                local = torch.zeros(size, dtype=trainable[0].dtype)
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
