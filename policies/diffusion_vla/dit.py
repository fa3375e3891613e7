"""Diffusion transformer over action chunks, with Level-2 minibatching built into its shapes.

Inputs are K noised copies of each condition's chunk: x (B, K, H, dim), one timestep embedding per
copy (B, K, dim), and the condition tokens of the B conditions, (B, L, dim), computed once. A chunk
whose first steps are known (the delay augmentation, training-time RTC) has one timestep per token
instead, (B, K, H): known tokens are at the clean end of the schedule while the rest are noised, and
a learned known-token embedding marks them.

Attention rules (Mini-Diffuser):
- self-attention runs within a copy: the K copies are folded into the batch, (B*K, H, dim), so copy
  k's tokens attend only to copy k's tokens;
- cross-attention queries of all K copies of a condition attend to that condition's tokens: the
  queries are laid out as (B, K*H, dim) against keys/values (B, L, dim), so the condition's keys
  and values are computed once per block and broadcast to every copy, never copied K times;
- condition tokens are never updated here, so they never attend to action tokens;
- the per-copy context (timestep, plus a pooled summary of the condition) enters through
  AdaLN-Zero modulation; with per-token timesteps the context is per token, (B, K, H, dim).

Queries in attention are independent of each other and LayerNorm and the MLP act per token, so the
copies cannot influence each other: a test checks that perturbing one copy changes no other, and
that K copies in one pass equal K separate passes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(...) float timesteps -> (..., dim) sinusoidal embedding."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    angles = t.float()[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], -1)


def per_token(v: torch.Tensor) -> torch.Tensor:
    """A per-copy (B, K, D) modulation broadcast over the chunk's H tokens, (B, K, 1, D); a per-token
    (B, K, H, D) one as it is."""
    return v[:, :, None] if v.ndim == 3 else v


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (B, K, H, D); shift, scale (B, K, D) per copy or (B, K, H, D) per token."""
    return x * (1 + per_token(scale)) + per_token(shift)


class DiTBlock(nn.Module):
    """AdaLN-Zero block: self-attention within each copy, cross-attention to the condition, MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.self_out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.cross_q = nn.Linear(dim, dim)
        self.cross_kv = nn.Linear(dim, 2 * dim)
        self.cross_out = nn.Linear(dim, dim)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        # shift/scale/gate for each of the three sub-layers; zero-initialized so each block starts
        # as the identity (AdaLN-Zero, Peebles & Xie).
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 9 * dim))
        nn.init.zeros_(self.ada[1].weight)
        nn.init.zeros_(self.ada[1].bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, D) -> (N, heads, T, D / heads)."""
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x: torch.Tensor, context: torch.Tensor, cond: torch.Tensor, cond_bias: torch.Tensor):
        """x (B, K, H, D); context (B, K, D) or per token (B, K, H, D); cond (B, L, D); cond_bias (B, 1, 1, L)
        additive mask."""
        b, k, h, d = x.shape
        s1, c1, g1, s2, c2, g2, s3, c3, g3 = self.ada(context).chunk(9, -1)  # each shaped like context

        # Self-attention within each copy: fold K into the batch.
        q, kk, v = self.qkv(modulate(self.norm1(x), s1, c1)).reshape(b * k, h, 3 * d).chunk(3, -1)
        att = F.scaled_dot_product_attention(self._split_heads(q), self._split_heads(kk), self._split_heads(v))
        att = self.self_out(att.transpose(1, 2).reshape(b, k, h, d))
        x = x + per_token(g1) * att

        # Cross-attention: all K*H queries of a condition against its L tokens, keys/values computed once.
        q = self.cross_q(modulate(self.norm2(x), s2, c2)).reshape(b, k * h, d)
        ck, cv = self.cross_kv(cond).chunk(2, -1)  # (B, L, D) each
        att = F.scaled_dot_product_attention(
            self._split_heads(q), self._split_heads(ck), self._split_heads(cv), attn_mask=cond_bias
        )  # (B, heads, K*H, D / heads)
        att = self.cross_out(att.transpose(1, 2).reshape(b, k, h, d))
        x = x + per_token(g2) * att

        return x + per_token(g3) * self.mlp(modulate(self.norm3(x), s3, c3))


class DiT(nn.Module):
    """Noised chunks (B, K, H, A) + timesteps (B, K) or (B, K, H) + condition tokens (B, L, dim) -> (B, K, H, A).

    The output is the objective's regression target: noise (ddpm) or velocity (flow). known_tokens:
    build the learned embedding of known (clean, committed) tokens, for a policy that reads the delay
    augmentation; without it the parameters are those of a DiT that knows no tokens.
    """

    def __init__(
        self, action_dim: int, horizon: int, dim: int, depth: int, heads: int, mlp_ratio: float,
        known_tokens: bool = False,
    ):  # fmt: skip
        super().__init__()
        self.dim = dim
        self.action_in = nn.Linear(action_dim, dim)
        self.position = nn.Parameter(torch.randn(horizon, dim) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.cond_pool = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([DiTBlock(dim, heads, mlp_ratio) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.action_out = nn.Linear(dim, action_dim)
        nn.init.zeros_(self.final_ada[1].weight)
        nn.init.zeros_(self.final_ada[1].bias)
        # Created last, so the other parameters draw the same initial values with or without it.
        self.known_embedding = nn.Parameter(torch.randn(dim) * 0.02) if known_tokens else None

    def forward(
        self,
        noisy: torch.Tensor,
        t: torch.Tensor,
        cond: torch.Tensor,
        cond_mask: torch.Tensor,
        known: torch.Tensor | None = None,
        with_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """noisy (B, K, H, A); t (B, K) float timesteps, one per copy, or (B, K, H), one per token;
        cond (B, L, dim); cond_mask (B, L) bool; known (B, K, H) bool: the tokens holding clean committed
        actions (None: none), which get the known-token embedding (a DiT built with known_tokens).
        with_hidden: also return the final hidden tokens (B, K, H, dim), what the output layer reads."""
        x = self.action_in(noisy) + self.position  # (B, K, H, dim)
        if known is not None:
            if self.known_embedding is None:
                raise ValueError("this DiT was built without known_tokens; it cannot mark known tokens")
            x = x + known[..., None].to(x) * self.known_embedding
        weights = cond_mask.float()[..., None]
        pooled = (cond * weights).sum(1) / weights.sum(1).clamp_min(1)  # (B, dim): one summary per condition
        summary = self.cond_pool(pooled)[:, None]  # (B, 1, dim)
        if t.ndim == 3:  # a timestep per token: so is the context
            summary = summary[:, :, None]
        context = self.time_mlp(timestep_embedding(t, self.dim)) + summary  # (B, K, dim) or (B, K, H, dim)
        # Masked condition tokens get -inf logits; the state token is always present, so no row is empty.
        cond_bias = torch.zeros(cond_mask.shape, device=cond.device).masked_fill(~cond_mask, float("-inf"))
        cond_bias = cond_bias[:, None, None]  # (B, 1, 1, L)
        for block in self.blocks:
            x = block(x, context, cond, cond_bias)
        shift, scale = self.final_ada(context).chunk(2, -1)
        hidden = modulate(self.final_norm(x), shift, scale)
        out = self.action_out(hidden)
        return (out, hidden) if with_hidden else out
