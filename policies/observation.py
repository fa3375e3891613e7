"""Validation of an observation batch against what a policy was trained with (shared by the policies)."""

from __future__ import annotations

import torch

from vla_core.types import OBS_STATE, TASK, image_key


def check_observation(obs: dict, state_dim: int, cameras: list[str], image_size: int | None) -> None:
    """Raise ValueError naming the problem unless ``obs`` is a valid batch.

    Expects ``observation.state`` (B, state_dim), ``observation.images.<cam>`` (B, 3, H, W) float in
    [0, 1] for every camera, a finite state, and B instruction strings. ``image_size`` fixes H = W;
    None accepts any size (for a policy that resizes).
    """
    state = obs.get(OBS_STATE)
    if state is None or state.ndim != 2 or state.shape[1] != state_dim:
        got = None if state is None else tuple(state.shape)
        raise ValueError(f"{OBS_STATE} must be (B, {state_dim}), got {got}")
    b = state.shape[0]
    for cam in cameras:
        img = obs.get(image_key(cam))
        if img is None:
            raise ValueError(f"missing {image_key(cam)}: this policy was trained with cameras {cameras}")
        if image_size is not None and tuple(img.shape) != (b, 3, image_size, image_size):
            raise ValueError(
                f"{image_key(cam)} must be {(b, 3, image_size, image_size)} (B, C, H, W) in [0, 1], got "
                f"{tuple(img.shape)}; resize images to {image_size}x{image_size}"
            )
        if img.ndim != 4 or img.shape[0] != b or img.shape[1] != 3:
            raise ValueError(f"{image_key(cam)} must be ({b}, 3, H, W) in [0, 1], got {tuple(img.shape)}")
        if not img.is_floating_point():
            raise ValueError(
                f"{image_key(cam)} must be float in [0, 1], got {img.dtype}; convert with img.float() / 255"
            )
        # One reduction for both checks (NaN fails every comparison); it runs on every inference call.
        if not ((img >= 0) & (img <= 1)).all():
            if not torch.isfinite(img).all():
                raise ValueError(f"{image_key(cam)} contains NaN or inf")
            low, high = img.min().item(), img.max().item()
            hint = "divide 0-255 pixel values by 255" if high > 1 else "undo the normalization before the policy"
            raise ValueError(f"{image_key(cam)} must be in [0, 1], got values in [{low:g}, {high:g}]; {hint}")
    if not torch.isfinite(state).all():
        raise ValueError(f"{OBS_STATE} contains NaN or inf")
    if TASK not in obs or len(obs[TASK]) != b:
        raise ValueError(f"'{TASK}' must be a list of {b} instruction strings")
