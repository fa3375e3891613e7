"""The autoregressive VLA: a PaliGemma-style model that writes each action chunk as action tokens.

Prompt (`backbone.Backbone.prefix`): [camera patches | instruction | committed actions | state]. The chunk
is tokenized by the policy's action tokenizer (`policies.action_tokenizers`: FAST, a DCT + BPE over the
chunk, or uniform bins per value), fitted on the training dataset's chunks when training starts
(``fit_to_demonstrations``) and saved beside the weights. The action tokens (and one end token, which
closes a FAST sequence) are appended to the backbone's vocabulary.

- Training (``forward``): teacher-forced cross-entropy of the chunk's tokens, over the distribution the
  decoder samples from (the action tokens, and the end token once a token was written), so the training
  loss is the negative log-likelihood `token_decoding.score_tokens` gives RL.
- Inference (``predict_chunk``): batched decoding with a key-value cache, constrained to the action tokens
  (`policies.token_decoding`), greedy at ``temperature`` 0, then detokenized. A sequence the tokenizer could
  not have written (a FAST sequence without all its coefficients when the budget ran out) still decodes to
  a finite chunk (missing coefficients are zero); such chunks are counted (``invalid_chunks``) and
  reported once with the fix.
- Training-time RTC (``max_delay_steps`` > 0): the committed actions of the delay augmentation are prompt
  tokens (one per committed row, masked where nothing is committed). A FAST chunk's DCT mixes its rows,
  so no token is "the committed row": the model writes the whole chunk, supervised on every row, and the
  chunk it returns starts with the committed actions exactly, as the denoising policies' do.
- RL (`policies.token_actor`): the decision is the token sequence, one factor per token.

Actions enter the tokenizer in dataset units (it has its own fitted range), absolute or, with ``action_frame``
delta, as steps from the state and from the row before (`policies.action_tokenizers.relative`); states are
normalized with the dataset statistics, which are buffers of the policy, as in every vla-rl policy.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import torch

from policies.action_tokenizers import fit_action_tokenizer, load_action_tokenizer
from policies.action_tokenizers.relative import delta_indices, from_delta, to_delta
from policies.autoregressive_vla.backbone import Backbone
from policies.autoregressive_vla.configuration_autoregressive_vla import AutoregressiveVLAConfig
from policies.observation import check_observation
from policies.pretrained import PreTrainedPolicy
from policies.token_actor import TokenRL
from policies.token_decoding import ActionTokenSpace, Decoded, decode, score_tokens
from vla_core.types import ACTION, ENVIRONMENT_STATE, OBS_STATE, TASK, ActionChunk, image_key

BUDGET_MARGIN = 1.25  # fast: the token budget is the longest training chunk's tokens times this
BACKBONE_DIR = "backbone"  # in a saved directory: a pretrained backbone's extended config and processor


class AutoregressiveVLAPolicy(TokenRL, PreTrainedPolicy):
    """Implements `vla_core.types.Policy`: observation batch -> ActionChunk (B, horizon, action_dim)."""

    config_class = AutoregressiveVLAConfig

    def __init__(self, config: AutoregressiveVLAConfig, saved_backbone: Path | None = None):
        super().__init__(config)
        self.backbone = Backbone(config, extra_tokens=config.action_vocab_size + 1, saved=saved_backbone)
        self.register_normalization(config.state_dim, config.action_dim)
        self.environment_state_head = None  # the auxiliary objective's head (config.environment_state_weight)
        if config.environment_state_weight > 0 and config.environment_state_dim > 0:
            dim = config.environment_state_dim
            self.environment_state_head = torch.nn.Linear(self.backbone.width, dim)
            self.register_buffer("environment_state_mean", torch.zeros(dim))
            self.register_buffer("environment_state_std", torch.ones(dim))
        self.action_tokenizer = None  # fitted (fit_to_demonstrations) or loaded (load_weights)
        self.clipped_values = self.tokenized_values = 0  # training actions clipped into the tokenizer's range
        self.invalid_chunks = self.decoded_chunks = 0  # decoded sequences the tokenizer could not have written

    # -- the action tokenizer -------------------------------------------------------------------

    @property
    def token_space(self) -> ActionTokenSpace:
        """Where the action tokens sit in the vocabulary; the end token only for FAST's variable length."""
        first = self.backbone.text_vocab
        end = first + self.config.action_vocab_size if self.config.action_tokenizer == "fast" else None
        return ActionTokenSpace(first, self._tokenizer().vocab_size, end)

    @property
    def token_budget(self) -> int:
        """Tokens a decode may write, the end token included (FAST); F of the RL actor's factors."""
        return self.config.max_action_tokens + (self.config.action_tokenizer == "fast")

    def _tokenizer(self):
        if self.action_tokenizer is None:
            raise ValueError(
                "this autoregressive_vla policy has no action tokenizer: train it with `vla-rl train` (which fits one "
                "on the dataset) or load a checkpoint that holds its action_tokenizer.json"
            )
        return self.action_tokenizer

    @classmethod
    def from_dataset(cls, config: AutoregressiveVLAConfig, features: dict, stats: dict, tasks: list[str],
                     cameras: list[str] | None = None) -> AutoregressiveVLAPolicy:  # fmt: skip
        """The base's, and the auxiliary objective's standardization from the true state's dataset statistics."""
        policy = super().from_dataset(config, features, stats, tasks, cameras)
        if policy.environment_state_head is not None:
            mean = torch.as_tensor(stats[ENVIRONMENT_STATE]["mean"], dtype=torch.float32).reshape(-1)
            std = torch.as_tensor(stats[ENVIRONMENT_STATE]["std"], dtype=torch.float32).reshape(-1)
            policy.environment_state_mean.copy_(mean)
            policy.environment_state_std.copy_(std.clamp_min(1e-6))  # a constant entry (the ball's x velocity)
        return policy

    def fit_to_demonstrations(self, demos, frames: torch.Tensor | None = None) -> None:
        """Fit the action tokenizer on the chunks of ``frames`` (the training frames; all when None) of
        ``demos`` (`vla_core.data.ChunkedDemos`), and set the token budget from them."""
        cfg = self.config
        chunks = demos.action_chunks(cfg.horizon, frames).double()
        if cfg.action_frame == "delta":
            found = delta_indices(demos.state_names, demos.action_names)
            if cfg.delta_state_indices not in ([], found):  # set by hand: it would be replaced unseen
                raise ValueError(f"policy.delta_state_indices={cfg.delta_state_indices} is set from the dataset's "
                                 f"names (here {found}): drop it")  # fmt: skip
            cfg.delta_state_indices = found
            states = demos.state if frames is None else demos.state[frames]
            chunks = to_delta(chunks, states.double(), cfg.delta_state_indices)
        chunks = chunks.numpy()
        setting = {"vocab_size": cfg.action_vocab_size, "scale": cfg.fast_scale} if cfg.action_tokenizer == "fast" \
            else {"num_bins": cfg.action_vocab_size}  # fmt: skip
        tokenizer = fit_action_tokenizer(cfg.action_tokenizer, chunks, **setting)
        longest = max(len(t) for t in tokenizer.encode(chunks).tokens)
        if cfg.max_action_tokens == 0:
            worst = cfg.horizon * cfg.action_dim  # a FAST sequence never needs more (one token per coefficient)
            cfg.max_action_tokens = worst if cfg.action_tokenizer == "uniform_bins" \
                else min(worst, math.ceil(longest * BUDGET_MARGIN))  # fmt: skip
        elif longest > cfg.max_action_tokens:
            raise ValueError(
                f"policy.max_action_tokens={cfg.max_action_tokens} is shorter than the dataset's longest chunk "
                f"({longest} tokens): raise it to at least {longest} or leave it at 0 (set from the data)"
            )
        self.set_action_tokenizer(tokenizer)

    def set_action_tokenizer(self, tokenizer) -> None:
        """Use ``tokenizer``, checked against the policy's chunk shape and vocabulary."""
        cfg = self.config
        shape = (tokenizer.horizon, tokenizer.action_dim)
        if shape != (cfg.horizon, cfg.action_dim):
            raise ValueError(
                f"the action tokenizer was fitted on chunks of {shape[0]} steps x {shape[1]} action dimensions, this "
                f"policy writes {cfg.horizon} x {cfg.action_dim}: fit it on the dataset the policy trains on"
            )
        if tokenizer.kind != cfg.action_tokenizer or tokenizer.vocab_size > cfg.action_vocab_size:
            raise ValueError(
                f"the action tokenizer is {tokenizer.kind!r} with {tokenizer.vocab_size} tokens, this policy was "
                f"built for {cfg.action_tokenizer!r} with {cfg.action_vocab_size}: use the checkpoint's own tokenizer"
            )
        if cfg.max_action_tokens < 1:
            raise ValueError("policy.max_action_tokens is 0: fit the tokenizer with fit_to_demonstrations")
        self.action_tokenizer = tokenizer

    def training_report(self) -> dict:
        """Action values this process tokenized since it started, and how many lay outside the tokenizer's fitted
        range and were clipped into it (about 2% by design: the range is the 1st to the 99th percentile)."""
        return {"action_values_tokenized": self.tokenized_values, "action_values_clipped": self.clipped_values}

    @classmethod
    def for_directory(cls, config: AutoregressiveVLAConfig, directory: Path) -> AutoregressiveVLAPolicy:
        """Built from a saved directory's own ``backbone/`` when it has one (a pretrained backbone's config and
        processor), so loading needs neither the directory it was trained from nor its weights twice."""
        saved = Path(directory) / BACKBONE_DIR
        return cls(config, saved_backbone=saved if saved.is_dir() else None)

    def save_assets(self, directory: Path) -> None:
        self._tokenizer().save(directory)
        self.backbone.save(Path(directory) / BACKBONE_DIR)

    def load_assets(self, directory: Path) -> None:
        """The action tokenizer and the token budget it was fitted with (``config.json``'s, when the directory
        has one: a resumed training run keeps them rather than fitting again)."""
        config = Path(directory) / "config.json"
        if config.is_file():
            self.config.max_action_tokens = json.loads(config.read_text()).get("max_action_tokens", 0)
        self.set_action_tokenizer(load_action_tokenizer(directory))

    # -- the prompt -----------------------------------------------------------------------------

    def prefix(self, obs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Observation batch -> (prefix (B, P, width), mask (B, P)); validates the input."""
        check_observation(obs, self.config.state_dim, self.config.cameras, image_size=None)  # the backbone resizes
        committed = self.committed_actions(obs)
        if committed is not None:
            rows = self.config.max_delay_steps
            committed = (self.normalize_action(committed[0][:, :rows]), committed[1][:, :rows])
        images = [obs[image_key(cam)].to(self.device) for cam in self.config.cameras]
        state = self.normalize_state(obs[OBS_STATE].to(self.device).float())
        return self.backbone.prefix(images, state, list(obs[TASK]), committed)

    def prefix_features(self, obs: dict) -> torch.Tensor:
        """(B, width): the last hidden state of the prompt (its state token), what a value head reads."""
        prefix, mask = self.prefix(obs)
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        return self.backbone.lm(inputs_embeds=prefix, attention_mask=mask, position_ids=positions).hidden[:, -1]

    @property
    def feature_dim(self) -> int:
        return self.backbone.width

    # -- training -------------------------------------------------------------------------------

    def token_ids(self, tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokenizer sequences -> (vocabulary ids (B, T), mask (B, T) bool), the end token appended (FAST)."""
        space = self.token_space
        rows = [[space.first_id + i for i in seq] + ([space.eos_id] if space.eos_id is not None else [])
                for seq in tokens]  # fmt: skip
        length = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.bool)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, : len(row)] = True
        return ids.to(self.device), mask.to(self.device)

    def forward(self, batch: dict, generator: torch.Generator | None = None, copies: int = 1) -> torch.Tensor:
        """Mean negative log-likelihood per token of the demonstrated chunks' tokens (teacher-forced).

        batch: observation keys of B frames + ``action`` (B, H, A) in dataset units (padding past an
        episode's end repeats its last action and is tokenized with the chunk). Values outside the
        tokenizer's fitted range are clipped into it and counted (``clipped_values``).
        """
        cfg = self.config
        actions = batch[ACTION]
        if actions.ndim != 3 or actions.shape[1:] != (cfg.horizon, cfg.action_dim):
            raise ValueError(f"batch actions must be (B, {cfg.horizon}, {cfg.action_dim}), got {tuple(actions.shape)}")
        if copies != 1:
            raise ValueError("the autoregressive_vla policy has no Level-2 copies; drop --l2_copies")
        actions = self.to_frame(actions.detach().cpu().double(), batch[OBS_STATE].cpu())
        tokenized = self._tokenizer().encode(actions.numpy())
        self.clipped_values += int(tokenized.clipped.sum())
        self.tokenized_values += actions.numel()
        ids, mask = self.token_ids(tokenized.tokens)
        aux = self.environment_state_head is not None
        if aux and ENVIRONMENT_STATE not in batch:
            raise ValueError(f"policy.environment_state_weight > 0 needs {ENVIRONMENT_STATE} in every training batch: "
                             f"train on a dataset recorded with `vla-rl record --environment_state=true`")  # fmt: skip
        prefix, prefix_mask = self.prefix(batch)
        scored = score_tokens(self.backbone.lm, prefix, prefix_mask, ids, mask, self.token_space,
                              max_tokens=self.token_budget, readout=aux)  # fmt: skip
        log_probs, readout = scored if aux else (scored, None)
        loss = -log_probs.sum() / mask.sum()
        if aux:  # the readout of the same pass (`prefix_features`' value), not a second one
            loss = loss + self.config.environment_state_weight * self.environment_state_error(batch, readout)
        return loss

    def environment_state_error(self, batch: dict, readout: torch.Tensor) -> torch.Tensor:
        """The auxiliary objective: mean squared error of the head's reading of the prompt's ``readout`` (B, width)
        against the batch's true state (B, E), both standardized."""
        true_state = batch[ENVIRONMENT_STATE].to(self.device).float()
        target = (true_state - self.environment_state_mean) / self.environment_state_std
        return (self.environment_state_head(readout) - target).pow(2).mean()

    # -- inference ------------------------------------------------------------------------------

    @torch.no_grad()
    def predict_chunk(self, obs: dict, obs_step: torch.Tensor | None = None, *, noise: torch.Tensor | None = None,
                      inpaint=None, steer=None) -> ActionChunk:  # fmt: skip
        """obs batch of size B -> ActionChunk (B, horizon, action_dim) in dataset units, decoded at
        ``config.temperature`` (0: greedy). With max_delay_steps > 0 the chunk's committed rows are the
        committed actions exactly. It has no flow velocity to steer."""
        if steer is not None:
            raise ValueError(self._no_flow_velocity("steer"))
        if noise is not None or inpaint is not None:
            raise ValueError("the autoregressive_vla policy has no sampler noise and no inpainting (it decodes tokens)")
        return self.sample_tokens(obs, obs_step, self.config.temperature)[0]

    @torch.no_grad()
    def sample_tokens(self, obs: dict, obs_step: torch.Tensor | None, temperature: float,
                      generator: torch.Generator | None = None, use_cache: bool = True) -> tuple[ActionChunk, Decoded]:  # fmt: skip
        """Decode one chunk per observation at ``temperature`` -> (ActionChunk, the decoded tokens with
        their log-probabilities). ``use_cache=False`` is the uncached baseline `bench ar-decoding` measures."""
        prefix, mask = self.prefix(obs)
        decoded = decode(self.backbone.lm, prefix, mask, self.token_space, self.token_budget,
                         temperature=temperature, generator=generator, use_cache=use_cache)  # fmt: skip
        return self._chunk(self.detokenize(decoded, obs), obs_step), decoded

    def detokenize(self, decoded: Decoded, obs: dict) -> torch.Tensor:
        """(B, H, A) actions in dataset units of decoded sequences, the committed rows kept exactly."""
        result = self._tokenizer().decode(decoded.action_tokens(self.token_space))
        self._count_invalid(result.valid)
        actions = self.from_frame(torch.as_tensor(result.chunks), obs[OBS_STATE].cpu())
        actions = actions.to(device=self.device, dtype=torch.float32)
        committed = self.committed_actions(obs)
        if committed is not None:
            actions = torch.where(committed[1][..., None], committed[0], actions)
        return actions

    def to_frame(self, actions: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Chunks (B, H, A) in dataset units -> the frame the tokenizer writes in (``config.action_frame``)."""
        if self.config.action_frame == "absolute":
            return actions
        return to_delta(actions, state.to(actions.dtype), self._delta_indices())

    def from_frame(self, chunks: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_frame`: detokenized chunks (B, H, A) -> dataset units, from the observed states."""
        if self.config.action_frame == "absolute":
            return chunks
        return from_delta(chunks, state.to(chunks.dtype), self._delta_indices())

    def _delta_indices(self) -> list[int]:
        if len(self.config.delta_state_indices) != self.config.action_dim:
            raise ValueError("policy.action_frame=delta has no delta_state_indices: fit the tokenizer with "
                             "fit_to_demonstrations (vla-rl train does), or load a checkpoint that saved them")  # fmt: skip
        return self.config.delta_state_indices

    def _count_invalid(self, valid: np.ndarray) -> None:
        first = self.invalid_chunks == 0
        self.decoded_chunks += len(valid)
        self.invalid_chunks += int((~valid).sum())
        if first and self.invalid_chunks:
            warnings.warn(
                f"{self.invalid_chunks} of {self.decoded_chunks} decoded action sequences were not ones the tokenizer "
                f"writes (they decode with missing values as zero): train longer, or raise policy.max_action_tokens "
                f"(now {self.config.max_action_tokens}) if sequences run out of budget",
                stacklevel=3,
            )

    # -- RL (policies.token_actor.TokenRL) ------------------------------------------------------

    def token_rows(self, width: int) -> torch.Tensor | None:
        """(width,) long: the chunk row each token position writes (uniform bins: step-major, A tokens a row);
        None for FAST, whose tokens each span the whole chunk (`policies.token_actor`)."""
        if self.config.action_tokenizer != "uniform_bins":
            return None
        return torch.arange(width, device=self.device) // self.config.action_dim

    def token_log_prob(self, obs: dict, ids: torch.Tensor, mask: torch.Tensor, temperature: float,
                       entropy: bool = False) -> torch.Tensor:  # fmt: skip
        """(B, T) log-probabilities of decoded ``ids`` (B, T) with ``mask`` (B, T), teacher-forced, with autograd,
        at the temperature they were sampled at (or their entropies, with ``entropy``)."""
        prefix, prefix_mask = self.prefix(obs)
        return score_tokens(self.backbone.lm, prefix, prefix_mask, ids.to(self.device), mask.to(self.device),
                            self.token_space, temperature=temperature, entropy=entropy,
                            max_tokens=self.token_budget)  # fmt: skip
