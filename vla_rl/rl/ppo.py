"""PPO over chunk decisions (DPPO-style for a denoising chain), with a value head.

One decision is one chunk (`vla_rl.rl.rollout`); the RL action behind it is the actor's decision,
scored per factor (`vla_core.rl.RLPolicy`; for a diffusion or flow policy the denoising chain, a
Gaussian policy of K steps). Per world and episode, decisions i = 0 .. L-1 with chunk reward R_i
(sum_j gamma^j r_j over the steps the chunk ran), discount g_i = gamma^steps_i and done_i:

    delta_i = R_i + g_i (1 - done_i) V(s_{i+1}) - V(s_i)
    A_i     = rho_i delta_i + g_i lambda c_i (1 - done_i) A_{i+1}   (GAE with gamma per control step)
    G_i     = A_i + V(s_i)                                          (the value target)

rho_i = c_i = 1 on-policy; a stale decision (asynchronous rollouts) gets its truncated weight
min(pi_prox / pi_behaviour, rho_bar) (V-trace; `vla_rl.rl.update.Anchors`).

An episode that hits the time limit counts as ended (no bootstrap): the value head sees the
episode's progress, so the value of a state with no time left is near zero anyway.

Critic: a value head on the actor's value features (``value_features``, detached: a denoising
policy's condition, and under delay the committed actions) plus the episode's progress. Not a
separate critic on ``observation.state``: the state is the arm's own joints, and what decides
success (where the ball or the object is) is only in the images, which the policy's encoder
already reads. Detached, so the value loss never moves the actor's
encoder. It warms up for ``critic_warmup_iterations`` before the actor's first update. With
``privileged_critic`` it also reads the simulator's privileged state at each decision
(``observation.privileged``: where the ball or the object is, and how it moves, and the end effector;
`vla_rl.rl.rollout.privileged_features`): an asymmetric critic, which only training has; the actor, the
checkpoint and the robot never see it. ``explained_variance`` in the history, 1 - Var(G - V) / Var(G) over
the rollout (before the update), says how much of the returns the critic predicts.

Loss per minibatch (see `vla_rl.rl.update` for why the ratio is per factor):

    L_actor  = clipped_surrogate(log pi(decision), log pi_prox(decision), normalized A, weight w)
               + kl_coef * KL(pi || pi_imitation)                    (optional)

(pi_prox: the weights at the update's start; w: a stale sample's truncated weight, else 1.)
    L_critic = 1/2 max((V - G)^2, (V_old + clip(V - V_old, +-value_clip) - G)^2)

Episodes whose world diverged are left out of the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vla_core.rl import FactorLogProb, RLPolicy
from vla_core.types import OBS_PRIVILEGED
from vla_rl.rl.rollout import Rollout, select_rows, to_device
from vla_rl.rl.update import (
    Anchors,
    GradientStep,
    Processes,
    UpdateSettings,
    actor_loss,
    actor_loss_per_task,
    anchors,
    scored,
)


@dataclass
class PPOConfig:
    """PPO's own settings (the shared ones are ``vla-rl finetune``'s)."""

    gamma: float = 0.99  # discount per control step
    gae_lambda: float = 0.95  # GAE's lambda, per chunk decision
    episodes_per_world: int = 2  # episodes each world runs per iteration
    critic_lr: float = 1e-3
    critic_hidden: int = 256  # width of the value head's two hidden layers
    critic_warmup_iterations: int = 2  # iterations that train only the critic, before the actor's first update
    value_clip: float = 0.2  # clip of the value change per update (0 = off)
    kl_coef: float = 0.0  # weight of the KL to the imitation policy (0 = off)
    # The critic also reads the simulator's privileged state (asymmetric; training only, never the actor)
    privileged_critic: bool = False

    def validate(self) -> None:
        if not 0 < self.gamma <= 1 or not 0 <= self.gae_lambda <= 1:
            raise ValueError(
                f"ppo.gamma must be in (0, 1] and ppo.gae_lambda in [0, 1], got {self.gamma}, {self.gae_lambda}"
            )
        if self.episodes_per_world < 1 or self.critic_hidden < 1 or self.critic_warmup_iterations < 0:
            raise ValueError(
                "ppo.episodes_per_world and ppo.critic_hidden must be >= 1, ppo.critic_warmup_iterations >= 0"
            )
        if self.critic_lr <= 0 or self.value_clip < 0 or self.kl_coef < 0:
            raise ValueError("ppo.critic_lr must be > 0, ppo.value_clip and ppo.kl_coef >= 0")


class ValueHead(nn.Module):
    """V(s): (B, F) condition features, (B,) episode progress in [0, 1] and, for an asymmetric critic, (B, P)
    privileged state -> (B,) value."""

    def __init__(self, feature_dim: int, hidden: int, privileged_dim: int = 0):
        super().__init__()
        self.privileged_dim = privileged_dim
        width = feature_dim + 1 + privileged_dim
        self.net = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, hidden), nn.Mish(), nn.Linear(hidden, hidden), nn.Mish(),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def forward(self, features: torch.Tensor, progress: torch.Tensor, obs: dict | None = None) -> torch.Tensor:
        """obs: the decisions' observations, read for ``observation.privileged`` when the head has it."""
        parts = [features, progress[:, None].to(features)]
        if self.privileged_dim:
            if obs is None or OBS_PRIVILEGED not in obs:
                raise ValueError("this privileged critic reads observation.privileged; collect with privileged=True")
            parts.append(obs[OBS_PRIVILEGED].to(features))
        return self.net(torch.cat(parts, -1)).squeeze(-1)


def gae(
    rollout: Rollout, values: torch.Tensor, lam: float, ratio: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (M,), value targets (M,)) of a rollout whose decisions are grouped per world and
    episode, in order (`collect` returns them so); values: (M,) V(s_i). ratio: (M,) each decision's
    truncated importance weight for samples drawn by older weights (V-trace, Espeholt et al. 2018:
    rho_i = c_i = min(prod pi_prox / pi_behaviour, rho_bar)); None (on-policy) is 1:

        A_i = rho_i delta_i + g_i lambda c_i (1 - done_i) A_{i+1},     G_i = A_i + V(s_i)
    """
    m = len(rollout)
    advantages = torch.zeros(m)
    next_value, next_advantage = 0.0, 0.0
    for i in reversed(range(m)):
        last_of_episode = i == m - 1 or bool(
            (rollout.world[i + 1] != rollout.world[i]) | (rollout.episode[i + 1] != rollout.episode[i])
        )
        if last_of_episode:
            next_value, next_advantage = 0.0, 0.0
        going_on = 1.0 - float(rollout.done[i])
        g = float(rollout.discount[i])
        rho = 1.0 if ratio is None else float(ratio[i])  # 1.0 * x == x: an on-policy rollout's numbers are GAE's
        delta = float(rollout.reward[i]) + g * going_on * next_value - float(values[i])
        advantages[i] = rho * delta + g * lam * rho * going_on * next_advantage
        next_value, next_advantage = float(values[i]), float(advantages[i])
    return advantages, advantages + values


@torch.no_grad()
def values_of(
    actor: RLPolicy, critic: ValueHead, rollout: Rollout, max_episode_steps: int, batch_size: int
) -> torch.Tensor:
    """(M,) V(s) of every decision, in batches (M may be 0: a data-parallel process whose worlds all diverged)."""
    out = [torch.zeros(0)]
    for start in range(0, len(rollout), batch_size):
        rows = torch.arange(start, min(start + batch_size, len(rollout)))
        obs = to_device(select_rows(rollout.obs, rows), actor.device)
        progress = rollout.obs_step[rows].float() / max_episode_steps
        out.append(critic(actor.value_features(obs), progress.to(actor.device), obs).cpu())
    return torch.cat(out)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) (1: the critic predicts the returns; 0: no better than their
    mean; below 0: worse); nan when the returns do not vary."""
    spread = returns.var(unbiased=False)
    return float("nan") if spread == 0 else float(1 - (returns - values).var(unbiased=False) / spread)


class PPO:
    """The PPO learner: the actor's optimizer and, with it, the critic, its optimizer and the frozen imitation
    policy the KL term pulls toward (``reference``, when ``cfg.kl_coef`` > 0). ``update`` takes one
    rollout; ``state_dict`` is what a resumed run needs.

    The critic is built here, from the global torch generator (the run seeds it once for the weights it
    adds: the latency head first, then this). max_episode_steps: the env's time limit, the progress scale.
    privileged_dim: P of ``observation.privileged`` (``cfg.privileged_critic``; 0 otherwise).
    """

    def __init__(self, actor: RLPolicy, cfg: PPOConfig, settings: UpdateSettings, processes: Processes,
                 reference: RLPolicy | None, max_episode_steps: int, privileged_dim: int = 0):  # fmt: skip
        self.actor, self.cfg, self.settings, self.processes = actor, cfg, settings, processes
        self.reference, self.max_episode_steps = reference, max_episode_steps
        self.actor_step = settings.actor_step(actor, processes)
        self.critic = ValueHead(actor.value_dim, cfg.critic_hidden, privileged_dim).to(actor.device)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=cfg.critic_lr)
        self.critic_step = GradientStep(self.critic_optimizer, settings.max_grad_norm, processes=processes)

    def update(self, rollout: Rollout, iteration: int) -> dict[str, float]:
        """One PPO update on a rollout; the actor trains from iteration ``critic_warmup_iterations`` on."""
        s = self.settings
        a = anchors(self.actor, rollout, s, s.rho_bar)
        reference = None if self.reference is None else scored(self.reference, rollout, s)
        stats = update(self.actor, self.critic, rollout, a, reference, cfg=self.cfg, settings=s,
                       actor_step=self.actor_step, critic_step=self.critic_step, processes=self.processes,
                       train_actor=iteration >= self.cfg.critic_warmup_iterations,
                       max_episode_steps=self.max_episode_steps)  # fmt: skip
        return {**stats, **a.stats}

    @property
    def skipped(self) -> dict[str, int]:
        return {"actor": self.actor_step.skipped, "critic": self.critic_step.skipped}

    def state_dict(self) -> dict:
        """Its part of ``finetune_state.pt`` (the layout of every vla-rl version so far)."""
        return {"actor_optimizer": self.actor_step.optimizer.state_dict(), "critic": self.critic.state_dict(),
                "critic_optimizer": self.critic_optimizer.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict, skipped: dict[str, int]) -> None:
        if state.get("critic") is None:
            raise ValueError("is a GRPO run (no critic); resume it with --algo=grpo")
        self.actor_step.optimizer.load_state_dict(state["actor_optimizer"])
        saved_width, width = state["critic"]["net.0.weight"].shape[0], self.critic.net[0].normalized_shape[0]
        plain = width - self.critic.privileged_dim  # the width without the privileged state
        if saved_width != width and (saved_width == plain or not self.critic.privileged_dim and saved_width > plain):
            flag = "true" if saved_width > plain else "false"
            raise ValueError(f"was fine-tuned with --ppo.privileged_critic={flag}; resume it with that setting")
        try:
            self.critic.load_state_dict(state["critic"])
        except RuntimeError as err:  # another shape: written when the value head read other features
            raise ValueError(
                f"holds a value head of another input width ({' '.join(str(err).split())[:120]}...): vla-rl 0.2's "
                f"critic did not read the delay augmentation; finish that run with vla-rl 0.2 or start it anew"
            ) from None
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.actor_step.skipped, self.critic_step.skipped = skipped["actor"], skipped["critic"]


def update(
    actor: RLPolicy,
    critic: ValueHead,
    rollout: Rollout,
    anchored: Anchors,
    reference_log_prob: FactorLogProb | None,
    *,
    cfg: PPOConfig,
    settings: UpdateSettings,
    actor_step: GradientStep,
    critic_step: GradientStep,
    train_actor: bool,
    max_episode_steps: int,
    processes: Processes | None = None,
) -> dict[str, float]:
    """One PPO update on a rollout. anchored: what its ratios are taken against (`vla_rl.rl.update.Anchors`:
    the proximal log-probabilities (M, F') of ``settings.factors``, the F' factors the actor loss covers,
    and a stale rollout's truncated weights); reference_log_prob: (M, F') the imitation policy's.
    processes: a data-parallel run's, each updating on its own rollouts (`vla_rl.rl.update.Processes`); the
    losses reported are this process's."""
    processes, s = processes or Processes(), settings
    keep = ~rollout.diverged
    rollout, old_log_prob = rollout.select(keep), anchored.proximal.select(keep)
    weight = None if anchored.weight is None else anchored.weight[keep]
    ratio = None if anchored.decision_ratio is None else anchored.decision_ratio[keep]
    if reference_log_prob is not None:
        reference_log_prob = reference_log_prob.select(keep)
    decisions = int(processes.sum_ints([len(rollout)])[0])  # over every process
    if decisions == 0:
        return {"decisions": 0}
    old_values = values_of(actor, critic, rollout, max_episode_steps, s.minibatch_size)
    advantages, returns = gae(rollout, old_values, cfg.gae_lambda, ratio)
    mean, std = processes.mean_std(advantages)
    normalized = (advantages - mean) / (std + 1e-8)
    sums: dict[str, float] = {}
    count = 0
    dev = actor.device
    for _ in range(s.epochs):
        for rows, minibatch_rows in processes.minibatches(len(rollout), s.minibatch_size, s.generator):
            task_rows = processes.task_rows(rollout.task[rows]) if s.pcgrad and train_actor else None
            if len(rows) == 0:  # none of this process's rows: add nothing, but take part in the sums
                critic_step(None)
                if train_actor:
                    actor_step(None, [None] * int((task_rows > 0).sum()) if s.pcgrad else None)
                continue
            share = len(rows) / minibatch_rows
            obs = to_device(select_rows(rollout.obs, rows), dev)
            progress = (rollout.obs_step[rows].float() / max_episode_steps).to(dev)
            with torch.no_grad():
                features = actor.value_features(obs)
            value = critic(features, progress, obs)
            target, before = returns[rows].to(dev), old_values[rows].to(dev)
            value_loss = (value - target) ** 2
            if cfg.value_clip > 0:
                clipped = before + (value - before).clamp(-cfg.value_clip, cfg.value_clip)
                value_loss = torch.maximum(value_loss, (clipped - target) ** 2)
            value_loss = 0.5 * value_loss.mean()
            critic_step(value_loss * share)
            stats = {"value_loss": value_loss.item()}
            if train_actor:
                decision, executed = rollout.decision.select(rows).to(dev), rollout.executed[rows].to(dev)
                new = actor.score(obs, decision, executed).columns(s.factors)
                old, adv = old_log_prob.values[rows].to(dev), normalized[rows].to(dev)
                reference = None if reference_log_prob is None else reference_log_prob.values[rows].to(dev)
                stale = None if weight is None else weight[rows].to(dev)
                terms = (new.values, old, adv, s.clip_low, s.clip_high, reference, cfg.kl_coef, new.mask, stale)
                loss, actor_stats = actor_loss(*terms)
                per_task = (
                    actor_loss_per_task(rollout.task[rows].to(dev), task_rows.to(dev), *terms) if s.pcgrad else None
                )
                actor_step(loss * share, per_task)
                stats.update(policy_loss=loss.item(), **actor_stats)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
    out = {k: v / max(1, count) for k, v in sums.items()}
    out.update(decisions=decisions)
    if len(rollout):  # this process's
        out.update(advantage_mean=float(advantages.mean()), value_mean=float(old_values.mean()),
                   explained_variance=explained_variance(old_values, returns))  # fmt: skip
    return out
