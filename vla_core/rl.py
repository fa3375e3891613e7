"""The RL contract: what RL fine-tuning needs of a policy, whatever kind of decision the policy makes.

Evaluation and serving need only `vla_core.types.Policy`. RL needs an *actor*: the policy itself or a
wrapper around it (`PreTrainedPolicy.rl_actor`) that

- ``act``s on a batch of observations: samples a chunk with exploration and returns the `Decision`
  behind it, a record the learner can score again later;
- ``score``s decisions under the current weights, with autograd, as log-probabilities per factor with
  a mask (`FactorLogProb`): one factor per denoising step of a chain, per token of a sequence, one
  for a single Gaussian draw. Per-factor ratios (DPPO's per-step ratio) and ``--train_last_steps``
  work on any kind. It scores only what could change an executed action: told which rows of each chunk
  ran (``executed``), it leaves out the parts of the decision no executed row depends on, which add
  only noise to every ratio, KL and entropy: a denoising chain's final-step samples of the rows that
  did not run (earlier steps' rows feed later steps through the network, so they stay), a token
  sequence's tokens after the last executed row when its tokens are written row by row (FAST's are
  not: each token spans the chunk, and all stay). The score function of what is left out has mean
  zero given the rest, so the policy gradient stays unbiased (`tests/test_executed_score.py` checks it
  by brute force on toys);
- gives the ``value_features`` a value head reads.

The rollout (`vla_rl.rl.rollout`) stores decisions and the learners (`vla_rl.rl.ppo`, `vla_rl.rl.grpo`)
score them; neither looks inside a decision. A denoising chain is one kind of decision
(`policies.denoising_chain.DenoisingChain`); token sequences and initial-noise actions are others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from vla_core.types import ActionChunk, Observation, Policy


@runtime_checkable
class Decision(Protocol):
    """B decisions of one kind, batched; rows are decisions."""

    def __len__(self) -> int: ...

    def select(self, rows: torch.Tensor) -> Decision:
        """The decisions of ``rows``: a long index or a bool mask over B."""
        ...

    def to(self, device: torch.device | str) -> Decision: ...

    @staticmethod
    def cat(decisions: Sequence[Decision]) -> Decision:
        """Concatenate decisions of this kind along B."""
        ...


def cat_decisions(decisions: Sequence[Decision]) -> Decision:
    """Concatenate decisions of one kind (the kind of the first)."""
    return type(decisions[0]).cat(decisions)


@dataclass
class FactorLogProb:
    """Log-probabilities of B decisions, per factor: ``values`` (B, F); ``mask`` (B, F) bool, True where
    the factor exists (a shorter token sequence has fewer); None: every factor of every row exists."""

    values: torch.Tensor
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.values.shape[0]

    def columns(self, factors: slice) -> FactorLogProb:
        """The factors ``factors`` of every row (``--train_last_steps``: the last k)."""
        return FactorLogProb(self.values[:, factors], None if self.mask is None else self.mask[:, factors])

    def select(self, rows: torch.Tensor) -> FactorLogProb:
        return FactorLogProb(self.values[rows], None if self.mask is None else self.mask[rows])

    def to(self, device: torch.device | str) -> FactorLogProb:
        return FactorLogProb(self.values.to(device), None if self.mask is None else self.mask.to(device))

    @staticmethod
    def cat(parts: Sequence[FactorLogProb]) -> FactorLogProb:
        values = torch.cat([p.values for p in parts])
        if all(p.mask is None for p in parts):
            return FactorLogProb(values)
        masks = [torch.ones_like(p.values, dtype=torch.bool) if p.mask is None else p.mask for p in parts]
        return FactorLogProb(values, torch.cat(masks))


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``x`` over the factors that exist (all of them when ``mask`` is None)."""
    if mask is None:
        return x.mean()
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp_min(1)


@runtime_checkable
class RLPolicy(Protocol):
    """An actor RL fine-tuning trains (see the module docstring).

    policy: what evaluation and serving run and what checkpoints save. module: the weights RL trains
    (for a denoising policy, the policy itself). num_factors: F of its `FactorLogProb`; value_dim: the
    width of ``value_features``.
    """

    policy: Policy
    module: torch.nn.Module
    num_factors: int
    value_dim: int

    @property
    def device(self) -> torch.device: ...

    def act(self, obs: Observation, obs_step: torch.Tensor) -> tuple[ActionChunk, Decision]:
        """Sample a chunk per observation, with exploration, no autograd: (ActionChunk (B, H, A), B decisions)."""
        ...

    def score(self, obs: Observation, decision: Decision, executed: torch.Tensor | None = None) -> FactorLogProb:
        """Log-probabilities (B, F) of ``decision`` (sampled from ``obs``, delay augmentation included) under
        the current weights, with autograd, of the parts an executed row depends on. executed: (B, H) bool, the
        rows of each chunk that ran (the rollout's ``executed``); None: every row."""
        ...

    def value_features(self, obs: Observation) -> torch.Tensor:
        """(B, value_dim) what a value head reads of the observation; with autograd when it is enabled."""
        ...
