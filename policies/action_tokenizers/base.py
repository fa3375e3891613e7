"""What every action tokenizer shares: the fitted range, clipping into it, and the results' types."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOKENIZER_FILE = "action_tokenizer.json"
LOW_QUANTILE, HIGH_QUANTILE = 0.01, 0.99  # the fitted range per dimension (OpenVLA's and FAST's)


@dataclass
class Tokenized:
    """B token sequences (lists of ids; the binning tokenizer's all H x A long) and, per chunk, how many of
    its values lay outside the fitted range and were clipped into it."""

    tokens: list[list[int]]
    clipped: np.ndarray  # (B,) int


@dataclass
class Detokenized:
    """Chunks (B, H, A) in action units, always finite, and whether each sequence was well formed (one the
    tokenizer could have produced; a malformed one is padded or cut to the chunk, never refused)."""

    chunks: np.ndarray
    valid: np.ndarray  # (B,) bool


def quantile_range(chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per action dimension, the (low, high) quantiles of ``chunks`` (N, H, A); a constant dimension gets a
    unit-wide range around its value, so normalizing by it is defined."""
    chunks = np.asarray(chunks, dtype=np.float64)
    values = chunks.reshape(-1, chunks.shape[-1])
    if values.shape[0] == 0 or not np.isfinite(values).all():
        raise ValueError("an action tokenizer is fitted on finite action chunks (N, H, A), N >= 1")
    low, high = np.quantile(values, LOW_QUANTILE, axis=0), np.quantile(values, HIGH_QUANTILE, axis=0)
    flat = high - low < 1e-8
    return np.where(flat, low - 0.5, low), np.where(flat, low + 0.5, high)


def check_chunks(chunks, horizon: int, action_dim: int) -> np.ndarray:
    """``chunks`` as a float64 array (B, H, A); ValueError naming the fix for another shape."""
    array = np.asarray(chunks, dtype=np.float64)
    if array.ndim != 3 or array.shape[1:] != (horizon, action_dim):
        raise ValueError(
            f"this action tokenizer was fitted on chunks of {horizon} steps x {action_dim} action dimensions, got "
            f"{tuple(array.shape)}: fit it on the dataset the policy trains on"
        )
    if not np.isfinite(array).all():
        raise ValueError("action chunks to tokenize must be finite")
    return array


def normalize(chunks: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chunks (B, H, A) -> values in [-1, 1] (the fitted range), and the count of clipped values per chunk."""
    scaled = 2 * (chunks - low) / (high - low) - 1
    outside = (np.abs(scaled) > 1).reshape(len(chunks), -1).sum(1)
    return np.clip(scaled, -1, 1), outside


def unnormalize(scaled: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (scaled + 1) / 2 * (high - low) + low
