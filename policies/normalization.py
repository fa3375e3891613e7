"""Dataset normalization shared by the policies: states to zero mean and unit variance, actions to [-1, 1].

The statistics are buffers of the policy itself (``state_mean``, ``state_std``, ``action_min``,
``action_max``), so they travel inside every checkpoint's weights.
"""

from __future__ import annotations

import torch


class NormalizationMixin:
    """For an ``nn.Module`` policy: call ``register_normalization`` in ``__init__``."""

    def register_normalization(self, state_dim: int, action_dim: int, action_bounds: list | None = None) -> None:
        """``action_bounds``: [low, high] (action units) a sampled chunk is clamped to (`clamp_chunk`); empty or
        None: the demonstrations' range."""
        if action_bounds and len(action_bounds[0]) != action_dim:
            raise ValueError(f"--policy.action_bounds has {len(action_bounds[0])} values per bound; the actions "
                             f"have {action_dim}")  # fmt: skip
        self._action_bounds = [list(map(float, b)) for b in action_bounds] if action_bounds else None
        self.register_buffer("state_mean", torch.zeros(state_dim))
        self.register_buffer("state_std", torch.ones(state_dim))
        self.register_buffer("action_min", -torch.ones(action_dim))
        self.register_buffer("action_max", torch.ones(action_dim))

    def set_normalization(self, state_mean, state_std, action_min, action_max) -> None:
        """Copy dataset statistics into the buffers; near-constant dimensions are guarded."""
        self.state_mean.copy_(torch.as_tensor(state_mean))
        self.state_std.copy_(torch.as_tensor(state_std).clamp_min(1e-3))
        lo, hi = torch.as_tensor(action_min), torch.as_tensor(action_max)
        pad = ((1e-3 - (hi - lo)) / 2).clamp_min(0)  # widen a constant action dim to a 1e-3 range
        self.action_min.copy_(lo - pad)
        self.action_max.copy_(hi + pad)

    def normalize_state(self, s: torch.Tensor) -> torch.Tensor:
        return (s - self.state_mean) / self.state_std

    def normalize_action(self, a: torch.Tensor) -> torch.Tensor:
        return (a - self.action_min) / (self.action_max - self.action_min) * 2 - 1

    def unnormalize_action(self, a: torch.Tensor) -> torch.Tensor:
        return (a + 1) / 2 * (self.action_max - self.action_min) + self.action_min

    def clamp_chunk(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, A) sampled chunk, normalized -> clamped to the action bounds (normalized), or to [-1, 1], the
        demonstrations' range, when there are none."""
        if self._action_bounds is None:
            return x.clamp(-1, 1)
        low, high = (self.normalize_action(torch.as_tensor(b, dtype=x.dtype, device=x.device))
                     for b in self._action_bounds)  # fmt: skip
        return torch.maximum(torch.minimum(x, high), low)
