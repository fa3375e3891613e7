"""Token sequences as RL decisions: the RL actor of an autoregressive (action-token) policy.

A token policy writes a chunk as a sequence of action tokens y_1 .. y_T sampled one at a time from
pi(y_t | prompt, y_<t) at a temperature tau (`policies.token_decoding`). The sequence is the decision; its
factors are the tokens, one log-probability per token (``FactorLogProb`` (B, F) with a mask: a FAST
sequence is as long as its chunk needs, padded to the budget F).

Why per token and not summed per chunk: the learners take one clipped ratio per factor (DPPO's per-step
ratio). A chunk's ratio is the product of up to F token ratios, which leaves any clip range after a few
tokens have moved, so a summed log-probability would clip (and stop training) almost every chunk; the
per-token ratio is what token-level PPO and GRPO for VLAs use (SimpleVLA-RL, RLinf). Each token's
advantage is its chunk's.

Scored tokens: a token written after the last row that ran changes no executed action (the tokens a row is
written in come before the next row's), so when the policy's tokens are written row by row (uniform bins: row
j's A values are tokens jA .. jA + A - 1, `TokenRL.token_rows`) those tokens leave the score; every earlier
token stays, as later tokens read it. FAST's tokens are DCT coefficients of the whole chunk: every one stays.

Sampling and scoring use the same distribution: the logits over the allowed tokens divided by tau.
Exploration is the temperature (``--noise.temperature``, default 1: the model's own distribution);
evaluation and serving decode greedily (``policy.temperature`` 0), the mode of the distribution RL trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vla_core.rl import FactorLogProb
from vla_core.runtime.delay import augmentation_features, augmentation_features_dim


@dataclass
class TokenDecision:
    """B decoded sequences: ``ids`` (B, F) vocabulary ids (end token included), ``mask`` (B, F) True where a
    token was written; F is the actor's budget, so decisions of any rollout concatenate."""

    ids: torch.Tensor
    mask: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def select(self, rows: torch.Tensor) -> TokenDecision:
        rows = rows.to(self.ids.device)
        return TokenDecision(self.ids[rows], self.mask[rows])

    def to(self, device) -> TokenDecision:
        return TokenDecision(self.ids.to(device), self.mask.to(device))

    @staticmethod
    def cat(decisions: list[TokenDecision]) -> TokenDecision:
        device = decisions[0].ids.device
        return TokenDecision(torch.cat([d.ids.to(device) for d in decisions]),
                             torch.cat([d.mask.to(device) for d in decisions]))  # fmt: skip

    def trimmed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) cut to the longest sequence, so scoring runs no all-padding positions."""
        length = max(int(self.mask.sum(1).max()), 1)
        return self.ids[:, :length], self.mask[:, :length]


def pad_columns(x: torch.Tensor, width: int, value=0) -> torch.Tensor:
    """(B, T) -> (B, width), T <= width, padded on the right with ``value``."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


class TokenActor:
    """The RL actor (`vla_core.rl.RLPolicy`) of a token policy (`TokenRL`); see the module docstring.

    augmentation_width: the width of the delay augmentation the rollouts carry (0: none); the value features
    then read it after the prompt's last hidden state.
    """

    factors_are_steps = False  # its factors are tokens padded to the budget: --train_last_steps means nothing here

    def __init__(self, policy, temperature: float, augmentation_width: int = 0):
        if not temperature > 0:
            raise ValueError(
                f"--noise.temperature={temperature}: a token policy's RL samples its tokens at a temperature > 0 "
                f"(greedy decoding has no log-probability to train); set --noise.temperature=1"
            )
        self.policy = self.module = policy
        self.temperature = float(temperature)
        self.num_factors = policy.token_budget
        self.augmentation_width = augmentation_width

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def value_dim(self) -> int:
        c, w = self.policy.config, self.augmentation_width
        return self.policy.feature_dim + augmentation_features_dim(w, c.action_dim)

    @torch.no_grad()
    def act(self, obs: dict, obs_step: torch.Tensor):
        chunk, decoded = self.policy.sample_tokens(obs, obs_step, self.temperature)
        ids = pad_columns(decoded.ids, self.num_factors)
        return chunk, TokenDecision(ids, pad_columns(decoded.mask, self.num_factors, False))

    def score(self, obs: dict, decision: TokenDecision, executed: torch.Tensor | None = None) -> FactorLogProb:
        """(B, F) per token; the mask leaves out the tokens after the last executed row (module docstring)."""
        ids, mask = decision.trimmed()
        values = self.policy.token_log_prob(obs, ids, mask, self.temperature)
        return FactorLogProb(pad_columns(values, self.num_factors), self.scored_tokens(decision, executed))

    def scored_tokens(self, decision: TokenDecision, executed: torch.Tensor | None) -> torch.Tensor:
        """(B, F) bool: the tokens written that an executed row depends on. executed: (B, H) bool, the rows that
        ran (None: all, every written token)."""
        mask = decision.mask.to(self.device)
        rows = self.policy.token_rows(self.num_factors)
        if executed is None or rows is None:
            return mask
        last = torch.where(executed, torch.arange(executed.shape[1], device=executed.device), -1).amax(1)  # (B,)
        return mask & (rows.to(mask.device)[None, :] <= last.to(mask.device)[:, None])

    def entropy(self, obs: dict, decision: TokenDecision) -> torch.Tensor:
        """(B, F) the entropy of each token's sampling distribution (0 where no token was written)."""
        ids, mask = decision.trimmed()
        return pad_columns(self.policy.token_log_prob(obs, ids, mask, self.temperature, entropy=True), self.num_factors)

    def value_features(self, obs: dict) -> torch.Tensor:
        """(B, value_dim): the prompt's last hidden state, then the delay augmentation (when the rollouts carry one)."""
        features = [self.policy.prefix_features(obs)]
        if self.augmentation_width:
            features.append(augmentation_features(obs, self.augmentation_width, self.policy.normalize_action))
        return torch.cat(features, -1)


class TokenRL:
    """What a token policy implements for RL (mixed into `PreTrainedPolicy` subclasses); ``rl_actor`` wraps
    it as the RL contract:

    - ``sample_tokens(obs, obs_step, temperature)`` -> (ActionChunk, `token_decoding.Decoded`), no autograd;
    - ``token_log_prob(obs, ids, mask, temperature, entropy=False)`` -> (B, T), with autograd;
    - ``prefix_features(obs)`` (B, ``feature_dim``) for a value head; ``token_budget``, the most tokens a
      sequence has;
    - ``token_rows(width)`` -> (width,) long, the chunk row each token position writes, or None when tokens
      do not map to rows (FAST).
    """

    def rl_actor(self, noise, augmentation_width: int = 0) -> TokenActor:
        if noise.eta != 0 or noise.min_std != 0.1:
            raise ValueError(
                "--noise.eta and --noise.min_std shape a denoising chain's steps; a token policy explores by "
                "--noise.temperature only: drop them"
            )
        return TokenActor(self, noise.temperature, augmentation_width)
