"""KV-cached, batched, constrained decoding of action tokens (`policies.token_decoding`) on a small random
`transformers` language model: the cache changes nothing, only action tokens (and the end token, once
allowed) are emitted, and the teacher-forced score is the log-probability the decoder drew with."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from policies.token_decoding import ActionTokenSpace, decode, score_tokens

VOCAB, WIDTH = 300, 32


def tiny_lm(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def prefix(b: int = 3, p: int = 5, seed: int = 1):
    """(B, P, D) embeddings, left-padded: row 0 has 2 padding positions, row 1 one."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, p, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, :1] = 0
    return torch.randn(b, p, WIDTH, generator=g), mask


def test_cached_batched_greedy_decoding_equals_decoding_without_cache_and_each_row_alone():
    model, (embeds, mask) = tiny_lm(), prefix()
    space = ActionTokenSpace(first_id=200, size=64)
    cached = decode(model, embeds, mask, space, max_tokens=12)
    uncached = decode(model, embeds, mask, space, max_tokens=12, use_cache=False)
    assert torch.equal(cached.ids, uncached.ids)
    torch.testing.assert_close(cached.log_probs, uncached.log_probs, rtol=1e-4, atol=1e-4)
    # Row 0 alone, without its padding: the same tokens as in the batch.
    alone = decode(model, embeds[:1, 2:], mask[:1, 2:], space, max_tokens=12)
    assert torch.equal(alone.ids[0], cached.ids[0])
    assert ((cached.ids >= 200) & (cached.ids < 264)).all() and cached.mask.all()  # only action tokens, all 12
    assert cached.action_tokens(space)[1] == (cached.ids[1] - 200).tolist()


def test_the_end_token_is_allowed_only_after_min_tokens_and_ends_its_row():
    model, (embeds, mask) = tiny_lm(), prefix()
    # The end token: the id the unconstrained model likes best after row 2's prefix, so that rows end early.
    free = model(inputs_embeds=embeds, attention_mask=mask).logits[:, -1].argmax(-1)
    eos = int(free[2])
    space = ActionTokenSpace(first_id=0, size=150, eos_id=eos) if eos >= 150 else ActionTokenSpace(150, 150, eos)
    out = decode(model, embeds, mask, space, max_tokens=20, min_tokens=3, temperature=1.0,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    for row_ids, row_mask in zip(out.ids, out.mask, strict=True):
        emitted = row_ids[row_mask].tolist()
        assert eos not in emitted[:3]  # not before min_tokens
        if eos in emitted:
            assert emitted.index(eos) == len(emitted) - 1  # nothing after the end token
        assert all(space.first_id <= i < space.first_id + space.size or i == eos for i in emitted)


def test_the_teacher_forced_score_is_what_the_decoder_drew_with_and_carries_gradients():
    model, (embeds, mask) = tiny_lm(), prefix()
    space = ActionTokenSpace(first_id=100, size=100, eos_id=5)
    for temperature in (0.0, 0.7):
        out = decode(model, embeds, mask, space, max_tokens=10, min_tokens=2, temperature=temperature,
                     generator=torch.Generator().manual_seed(3))  # fmt: skip
        scored = score_tokens(model, embeds, mask, out.ids, out.mask, space, min_tokens=2, temperature=temperature,
                              max_tokens=10)  # fmt: skip
        torch.testing.assert_close(scored, out.log_probs, rtol=1e-4, atol=1e-4)
        assert (scored[~out.mask] == 0).all() and (scored[out.mask] <= 0).all()
        # A sequence that reached the budget ends there: the end token alone was allowed, with probability 1.
        full = out.mask.sum(1) == 10
        assert (out.ids[full, 9] == 5).all() and (scored[full, 9] == 0).all()
    scored.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_sampling_is_reproducible_from_its_generator():
    model, (embeds, mask) = tiny_lm(), prefix()
    space = ActionTokenSpace(first_id=0, size=256)
    runs = [decode(model, embeds, mask, space, 8, temperature=1.0, generator=torch.Generator().manual_seed(s))
            for s in (4, 4, 5)]  # fmt: skip
    assert torch.equal(runs[0].ids, runs[1].ids) and not torch.equal(runs[0].ids, runs[2].ids)
