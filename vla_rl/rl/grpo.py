"""GRPO over chunk decisions (SimpleVLA-RL style): no critic.

The N worlds form N / G groups of G; the G worlds of a group start every episode from the same
initial state (a reset with one seed per group: equal seeds, equal initial states) and differ
only in the policy's sampling noise (and, under a random ``--delay``, in the delays each world draws). Each world runs one episode; its reward is binary success
R in {0, 1}, and the group's episodes are compared with each other:

    A_e = (R_e - mean_group R) / (std_group R + eps)        broadcast to every decision of episode e

Dynamic sampling: a group where all G episodes succeeded, or all failed, has A = 0 everywhere and
teaches nothing; it is dropped (and counted). As in DAPO, the rollout is refilled first: the task is
rolled out again from new initial states (up to ``max_refills`` times) until the batch holds
N / G informative groups, every env step of it counted (`vla_rl.rl.sources.LocalRollouts`; Ray's
asynchronous rollouts only drop). Episodes whose world diverged are dropped with their group's
statistics computed without them.

Loss: `vla_rl.rl.update.actor_loss` (the clipped surrogate) with the asymmetric clip (clip-higher, 0.2 / 0.28),
per factor of the decision (per denoising step of a chain), averaged over every factor of every kept
decision. No KL, no entropy term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vla_core.rl import RLPolicy
from vla_rl.rl.rollout import Rollout, select_rows, to_device
from vla_rl.rl.update import (
    Anchors,
    GradientStep,
    Processes,
    UpdateSettings,
    actor_loss,
    actor_loss_per_task,
    anchors,
)


@dataclass
class GRPOConfig:
    """GRPO's own settings (the shared ones are ``vla-rl finetune``'s)."""

    group_size: int = 8  # G: worlds that start from the same state; must divide env.num_envs
    dynamic_sampling: bool = True  # drop groups whose episodes all succeeded or all failed
    # DAPO: with dynamic sampling, roll out again (new initial states) up to this many times until the
    # batch holds env.num_envs / G informative groups; every env step of it counts. 0 = only drop.
    max_refills: int = 4

    def validate(self, num_envs: int) -> None:
        if self.max_refills < 0:
            raise ValueError(f"grpo.max_refills must be >= 0 (0: drop uniform groups only), got {self.max_refills}")
        if self.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2 (a group compares its episodes), got {self.group_size}")
        if num_envs % self.group_size:
            raise ValueError(
                f"grpo.group_size={self.group_size} does not divide env.num_envs={num_envs}; "
                f"set --env.num_envs to a multiple of {self.group_size}"
            )


def group_seeds(num_envs: int, group_size: int, seed: int) -> list[int]:
    """One reset seed per world, equal within a group: world w belongs to group w // G."""
    return [seed + w // group_size for w in range(num_envs)]


def informative_groups(rollout: Rollout, group_size: int) -> torch.Tensor:
    """(groups,) bool over the groups of a rollout of one episode per world (group = world // G): True where
    its episodes, diverged ones left out, neither all succeeded nor all failed (the only groups GRPO
    learns from)."""
    first = torch.ones(len(rollout), dtype=torch.bool)  # one row per episode: each world's first decision
    first[1:] = rollout.world[1:] != rollout.world[:-1]
    episodes = rollout.select(first)
    group = episodes.world // group_size
    _, kept, _ = group_advantages(episodes.success, group, ~episodes.diverged, dynamic_sampling=True)
    informative = torch.zeros((int(rollout.world.max()) + group_size) // group_size, dtype=torch.bool)
    informative[group[kept]] = True
    return informative


def keep_groups(rollout: Rollout, groups: torch.Tensor, group_size: int) -> Rollout:
    """The decisions of ``groups`` (k,) long, in that order, their worlds renumbered so group j is
    worlds j G .. j G + G - 1 (a batch as if those groups had been rolled out together)."""
    rank = torch.full((int(rollout.world.max()) // group_size + 1,), -1, dtype=torch.long)
    rank[groups] = torch.arange(len(groups))
    of_world = rank[rollout.world // group_size]
    kept = rollout.select(of_world >= 0)
    kept.world = of_world[of_world >= 0] * group_size + kept.world % group_size
    order = torch.argsort(kept.world * (kept.episode.max() + 1) + kept.episode, stable=True)
    return kept.select(order)


def group_advantages(
    success: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, dynamic_sampling: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Per episode: success (E,) bool, group (E,) long, valid (E,) bool (not diverged).

    Returns (advantages (E,), kept (E,) bool, counts): the group-normalized advantage of each
    valid episode, and which episodes enter the update.
    """
    reward = success.float()
    advantages = torch.zeros_like(reward)
    kept = valid.clone()
    dropped = 0
    for g in group[valid].unique().tolist():
        members = (group == g) & valid
        if members.sum() == 0:
            continue
        r = reward[members]
        if dynamic_sampling and (r.min() == r.max()):
            kept &= ~members
            dropped += 1
            continue
        advantages[members] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    return advantages, kept, {"groups_dropped": dropped, "groups": int(group[valid].unique().numel())}


class GRPO:
    """The GRPO learner: the actor's optimizer; ``update`` takes a rollout of one episode per world."""

    def __init__(self, actor: RLPolicy, cfg: GRPOConfig, settings: UpdateSettings, processes: Processes):
        self.actor, self.cfg, self.settings, self.processes = actor, cfg, settings, processes
        self.actor_step = settings.actor_step(actor, processes)

    def update(self, rollout: Rollout, iteration: int) -> dict[str, float]:
        a = anchors(self.actor, rollout, self.settings, self.settings.rho_bar)
        stats = update(self.actor, rollout, a, cfg=self.cfg, settings=self.settings, actor_step=self.actor_step,
                       processes=self.processes)  # fmt: skip
        return {**stats, **a.stats}

    @property
    def skipped(self) -> dict[str, int]:
        return {"actor": self.actor_step.skipped, "critic": 0}

    def state_dict(self) -> dict:
        """Its part of ``finetune_state.pt`` (the layout of every vla-rl version so far)."""
        return {"actor_optimizer": self.actor_step.optimizer.state_dict(), "critic": None, "critic_optimizer": None}

    def load_state_dict(self, state: dict, skipped: dict[str, int]) -> None:
        self.actor_step.optimizer.load_state_dict(state["actor_optimizer"])
        self.actor_step.skipped = skipped["actor"]


def update(
    actor: RLPolicy,
    rollout: Rollout,
    anchored: Anchors,
    *,
    cfg: GRPOConfig,
    settings: UpdateSettings,
    actor_step: GradientStep,
    processes: Processes | None = None,
) -> dict[str, float]:
    """One GRPO update on a rollout of one episode per world. anchored: what its ratios are taken against
    (`vla_rl.rl.update.Anchors`: the proximal log-probabilities (M, F') of ``settings.factors``, the F'
    factors the loss covers, and a stale rollout's truncated weights). processes: a data-parallel run's,
    each updating on its own rollouts, whose groups are its own (`vla_rl.rl.update.Processes`)."""
    processes, s = processes or Processes(), settings
    # Episode e of the rollout is world e's (one episode per world); its group is e // G. In a
    # multi-task rollout each task's worlds are numbered on (`Rollout.cat`), so groups stay in a task;
    # worlds of tasks not rolled out this time hold no episode and are left out.
    num_worlds = int(rollout.world.max()) + 1
    success = torch.zeros(num_worlds, dtype=torch.bool)
    diverged = torch.zeros(num_worlds, dtype=torch.bool)
    present = torch.zeros(num_worlds, dtype=torch.bool)
    success[rollout.world], diverged[rollout.world], present[rollout.world] = rollout.success, rollout.diverged, True
    advantages, kept, counts = group_advantages(
        success, torch.arange(num_worlds) // cfg.group_size, present & ~diverged, cfg.dynamic_sampling
    )
    keep = kept[rollout.world]
    # Every process's: its groups, and its decisions kept.
    summed = processes.sum_ints([*counts.values(), int(keep.sum())]).tolist()
    stats: dict[str, float] = {**dict(zip(counts, summed[:-1], strict=True)), "decisions": summed[-1]}
    if stats["decisions"] == 0:
        return stats  # every group (of every process) was all-success or all-failure: nothing to learn from
    rollout, old_log_prob, decision_advantage = (
        rollout.select(keep),
        anchored.proximal.select(keep),
        advantages[rollout.world][keep],
    )
    weight = None if anchored.weight is None else anchored.weight[keep]
    sums: dict[str, float] = {}
    count = 0
    dev = actor.device
    for _ in range(s.epochs):
        for rows, minibatch_rows in processes.minibatches(len(rollout), s.minibatch_size, s.generator):
            task_rows = processes.task_rows(rollout.task[rows]) if s.pcgrad else None
            if len(rows) == 0:  # none of this process's rows: add nothing, but take part in the sums
                actor_step(None, [None] * int((task_rows > 0).sum()) if s.pcgrad else None)
                continue
            share = len(rows) / minibatch_rows
            obs = to_device(select_rows(rollout.obs, rows), dev)
            decision, executed = rollout.decision.select(rows).to(dev), rollout.executed[rows].to(dev)
            new = actor.score(obs, decision, executed).columns(s.factors)
            old, adv = old_log_prob.values[rows].to(dev), decision_advantage[rows].to(dev)
            stale = None if weight is None else weight[rows].to(dev)
            terms = (new.values, old, adv, s.clip_low, s.clip_high, None, 0.0, new.mask, stale)
            loss, clip_stats = actor_loss(*terms)
            per_task = actor_loss_per_task(rollout.task[rows].to(dev), task_rows.to(dev), *terms) if s.pcgrad else None
            actor_step(loss * share, per_task)
            for k, v in {"policy_loss": loss.item(), **clip_stats}.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
    stats.update({k: v / max(1, count) for k, v in sums.items()})
    return stats
