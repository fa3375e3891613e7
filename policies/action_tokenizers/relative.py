"""Action chunks relative to the state, the frame the bin tokenizer writes in with ``action_frame=delta``.

An absolute end-effector target is mostly the state copied: on ``track`` about 98% of a bin token's value is
where the arm already is, and the image-dependent step (at most 25 mm) spans a few dozen bins. In the
relative frame row 0 is the step from the state's matching entry and every later row the step from the row
before, so each token carries only what the observation must decide (OpenVLA bins bounded deltas). An
action dimension with no state entry of its name (a gripper command) stays absolute.

``indices`` (A,) names, for each action dimension, the state entry its row 0 is relative to, or -1 for an
absolute dimension; `delta_indices` finds them by name.
"""

from __future__ import annotations

import torch

ABSOLUTE = -1


def delta_indices(state_names: list[str] | None, action_names: list[str] | None) -> list[int]:
    """Per action dimension the index of the state entry of the same name, else ``ABSOLUTE``; ValueError naming
    the fix when the names are missing or no action dimension has a state entry."""
    if not state_names or not action_names:
        raise ValueError("policy.action_frame=delta pairs action dimensions with state entries by name, and the "
                         "dataset's observation.state or action feature has no names: record it with names, or use "
                         "policy.action_frame=absolute")  # fmt: skip
    indices = [state_names.index(name) if name in state_names else ABSOLUTE for name in action_names]
    if all(i == ABSOLUTE for i in indices):
        raise ValueError(f"policy.action_frame=delta: no action dimension {action_names} is named as a state entry "
                         f"{state_names}; use policy.action_frame=absolute")  # fmt: skip
    return indices


def _split(indices: list[int], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A,) bool: the relative dimensions; (B, A): the state's entry for each (0 where absolute)."""
    index = torch.as_tensor(indices, device=state.device)
    relative = index != ABSOLUTE
    return relative, torch.where(relative, state[:, index.clamp_min(0)], torch.zeros((), dtype=state.dtype))


def to_delta(chunks: torch.Tensor, state: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Absolute chunks (B, H, A) and states (B, S) -> chunks in the relative frame (B, H, A)."""
    relative, start = _split(indices, state.to(chunks.dtype))
    previous = torch.cat([start[:, None], chunks[:, :-1]], dim=1)
    return torch.where(relative, chunks - previous, chunks)


def from_delta(deltas: torch.Tensor, state: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Chunks in the relative frame (B, H, A) and states (B, S) -> absolute chunks (B, H, A): the inverse of
    `to_delta`, each relative dimension the state's entry plus the running sum of its steps."""
    relative, start = _split(indices, state.to(deltas.dtype))
    return torch.where(relative, start[:, None] + deltas.cumsum(dim=1), deltas)
