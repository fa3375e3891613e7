"""Batched, key-value-cached decoding of action tokens from a `transformers` causal language model, and
the teacher-forced score of a decoded sequence: what an autoregressive VLA samples and RL trains.

The prefix (image, instruction and state embeddings, left-padded to one length) runs once; then each
step feeds the last token alone with the cache. Decoding is constrained to the action tokens: every
other logit is masked (a logits processor), so every emitted token is an action token, and an end
token is allowed once ``min_tokens`` have been emitted (the FAST tokenizer's variable-length chunks;
fixed-length binning sets ``eos_id=None``), and it is the only token allowed at the budget's last step, so
a sequence never has more than ``max_tokens - 1`` action tokens. Greedy at temperature 0, else sampled at
the temperature from a caller's generator. Only the positions whose logits are read are projected onto the
vocabulary (``logits_to_keep``, as `transformers`' causal LMs take it): a real VLA's vocabulary is large.

Log-probabilities are those of the distribution the token was drawn from, restricted to the allowed
tokens (at temperature 1 for greedy decoding); `score_tokens` recomputes them teacher-forced, with
autograd, in one pass: the per-token factors of the RL contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ActionTokenSpace:
    """Where the action tokens sit in the language model's vocabulary: ids ``first_id .. first_id + size
    - 1``; ``eos_id`` ends a variable-length sequence (None: every sequence is ``max_tokens`` long)."""

    first_id: int
    size: int
    eos_id: int | None = None

    def allowed(self, vocab_size: int, may_end: bool, device, must_end: bool = False) -> torch.Tensor:
        """(vocab_size,) bool: the action tokens, and the end token when ``may_end``; the end token alone when
        ``must_end`` (the budget's last token of a variable-length sequence)."""
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if self.eos_id is not None and must_end:
            mask[self.eos_id] = True
            return mask
        mask[self.first_id : self.first_id + self.size] = True
        if self.eos_id is not None and may_end:
            mask[self.eos_id] = True
        return mask


@dataclass
class Decoded:
    """B decoded sequences, padded to T: ``ids`` (B, T) vocabulary ids (the end token included),
    ``log_probs`` (B, T) of each, ``mask`` (B, T) True where a token was emitted."""

    ids: torch.Tensor
    log_probs: torch.Tensor
    mask: torch.Tensor

    def action_tokens(self, space: ActionTokenSpace) -> list[list[int]]:
        """Each sequence's action tokens as the tokenizer numbers them (0 .. size - 1), the end token dropped."""
        out = []
        for ids, emitted in zip(self.ids.tolist(), self.mask.tolist(), strict=True):
            out.append([i - space.first_id for i, e in zip(ids, emitted, strict=True)
                        if e and space.first_id <= i < space.first_id + space.size])  # fmt: skip
        return out


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids of a left-padded attention mask: 0 at each row's first real token."""
    return (mask.cumsum(1) - 1).clamp_min(0)


def _constrained(logits: torch.Tensor, allowed: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, V) log-probabilities over the allowed tokens of the distribution sampled from."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled.masked_fill(~allowed, float("-inf")), -1)


@torch.no_grad()
def decode(model, prefix: torch.Tensor, prefix_mask: torch.Tensor, space: ActionTokenSpace, max_tokens: int, *,
           min_tokens: int = 1, temperature: float = 0.0, generator: torch.Generator | None = None,
           use_cache: bool = True) -> Decoded:  # fmt: skip
    """Decode up to ``max_tokens`` action tokens after ``prefix`` (B, P, D) embeddings with ``prefix_mask``
    (B, P) (1 real, 0 left padding). ``use_cache=False`` runs the whole sequence again at every step (the
    baseline a benchmark compares against; the same tokens under greedy decoding)."""
    b, device = prefix.shape[0], prefix.device
    embed = model.get_input_embeddings()
    vocab = model.config.vocab_size
    mask, inputs, cache = prefix_mask.long(), prefix, None
    ids = torch.zeros(b, max_tokens, dtype=torch.long, device=device)
    log_probs = torch.zeros(b, max_tokens, device=device)
    emitted = torch.zeros(b, max_tokens, dtype=torch.bool, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for t in range(max_tokens):
        if use_cache:
            positions = _positions(mask)[:, -inputs.shape[1] :]
            out = model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True, logits_to_keep=1)  # fmt: skip
            cache = out.past_key_values
        else:
            out = model(inputs_embeds=inputs, attention_mask=mask, position_ids=_positions(mask), use_cache=False,
                        logits_to_keep=1)  # fmt: skip
        allowed = space.allowed(vocab, may_end=t >= min_tokens, device=device, must_end=t == max_tokens - 1)
        dist = _constrained(out.logits[:, -1], allowed, temperature)
        if temperature > 0:
            token = torch.multinomial(dist.exp(), 1, generator=generator)[:, 0]
        else:
            token = dist.argmax(-1)
        ids[:, t] = torch.where(done, 0, token)
        log_probs[:, t] = torch.where(done, 0.0, dist.gather(1, token[:, None])[:, 0])
        emitted[:, t] = ~done
        if space.eos_id is not None:
            done = done | (token == space.eos_id)
        step = embed(ids[:, t : t + 1]).to(prefix.dtype)
        inputs = step if use_cache else torch.cat([inputs, step], 1)
        mask = torch.cat([mask, (~done | emitted[:, t]).long()[:, None]], 1)
        if done.all():
            return Decoded(ids[:, : t + 1], log_probs[:, : t + 1], emitted[:, : t + 1])
    return Decoded(ids, log_probs, emitted)


def score_tokens(model, prefix: torch.Tensor, prefix_mask: torch.Tensor, decoded_ids: torch.Tensor,
                 token_mask: torch.Tensor, space: ActionTokenSpace, *, min_tokens: int = 1,
                 temperature: float = 0.0, entropy: bool = False, max_tokens: int | None = None,
                 readout: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(B, T) log-probabilities of ``decoded_ids`` (B, T) under the current weights, teacher-forced in one
    pass with autograd, over the same constrained distribution as `decode` with ``max_tokens`` (zeros where
    ``token_mask`` (B, T) is False). ``entropy``: the entropy of that distribution at each position instead.
    ``readout``: also the prompt's readout from the same pass, (B, width), the last hidden state of the prefix's
    last position (causal: what the prefix alone gives it), for a model whose output carries ``hidden``."""
    embed = model.get_input_embeddings()
    t = decoded_ids.shape[1]
    inputs = torch.cat([prefix, embed(decoded_ids[:, :-1]).to(prefix.dtype)], 1)
    mask = torch.cat([prefix_mask.long(), token_mask[:, :-1].long()], 1)
    # The last T positions' logits, those that predicted token 0 .. T - 1 (from the prefix's last position on).
    out = model(inputs_embeds=inputs, attention_mask=mask, position_ids=_positions(mask), use_cache=False,
                logits_to_keep=t)  # fmt: skip
    steps = out.logits
    vocab = model.config.vocab_size
    allowed = torch.stack([space.allowed(vocab, may_end=k >= min_tokens, device=prefix.device,
                                         must_end=max_tokens is not None and k == max_tokens - 1) for k in range(t)])  # fmt: skip
    dist = _constrained(steps, allowed[None], temperature)
    if entropy:  # -sum p log p over the allowed tokens (the masked ones have p = 0 and log p = -inf)
        values = -(dist.exp() * dist.masked_fill(~allowed[None], 0.0)).sum(-1)
    else:
        values = dist.gather(2, decoded_ids[..., None])[..., 0]
    values = torch.where(token_mask, values, 0.0)
    return (values, out.hidden[:, prefix.shape[1] - 1]) if readout else values
