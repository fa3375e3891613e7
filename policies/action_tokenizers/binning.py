"""Per-dimension uniform binning (RT-2, OpenVLA): token = the bin of each value, H x A tokens per chunk.

Each dimension's fitted range [low, high] (dataset quantiles) is cut into ``num_bins`` equal bins; a
value becomes its bin's index (values outside the range are clipped into it and counted), a token its
bin's centre. The round trip of a value inside the range is off by at most half a bin,
(high - low) / (2 num_bins).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from policies.action_tokenizers.base import (
    TOKENIZER_FILE,
    Detokenized,
    Tokenized,
    check_chunks,
    normalize,
    quantile_range,
    unnormalize,
)


class UniformBinTokenizer:
    """``num_bins`` bins per action dimension; token ids 0 .. num_bins - 1 (``vocab_size`` = num_bins)."""

    kind = "uniform_bins"

    def __init__(self, low: np.ndarray, high: np.ndarray, horizon: int, num_bins: int = 256):
        if num_bins < 2:
            raise ValueError(f"num_bins must be >= 2, got {num_bins}")
        self.low, self.high = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
        self.horizon, self.action_dim, self.num_bins = horizon, len(self.low), num_bins

    @classmethod
    def fit(cls, chunks: np.ndarray, num_bins: int = 256) -> UniformBinTokenizer:
        """Fitted on a dataset's action chunks (N, H, A)."""
        low, high = quantile_range(chunks)
        return cls(low, high, np.asarray(chunks).shape[1], num_bins)

    @property
    def vocab_size(self) -> int:
        return self.num_bins

    @property
    def bin_width(self) -> np.ndarray:
        """(A,) the width of one bin in action units."""
        return (self.high - self.low) / self.num_bins

    def max_tokens(self) -> int:
        return self.horizon * self.action_dim

    def encode(self, chunks) -> Tokenized:
        """Chunks (B, H, A) -> B sequences of H x A ids (step-major: step 0's A values first)."""
        scaled, clipped = normalize(check_chunks(chunks, self.horizon, self.action_dim), self.low, self.high)
        bins = np.floor((scaled + 1) / 2 * self.num_bins).astype(np.int64).clip(0, self.num_bins - 1)
        return Tokenized([row.tolist() for row in bins.reshape(len(bins), -1)], clipped)

    def decode(self, tokens: list[list[int]]) -> Detokenized:
        """B sequences -> chunks (B, H, A) at the bins' centres. A sequence of another length, or with ids
        outside the vocabulary, is cut or padded (with the middle bin) and clipped, and marked not valid."""
        n = self.max_tokens()
        ids = np.full((len(tokens), n), self.num_bins // 2, dtype=np.int64)
        valid = np.ones(len(tokens), dtype=bool)
        for b, sequence in enumerate(tokens):
            row = np.asarray(sequence, dtype=np.int64)[:n]
            ids[b, : len(row)] = row
            valid[b] = len(sequence) == n and bool(((row >= 0) & (row < self.num_bins)).all())
        ids = ids.clip(0, self.num_bins - 1).reshape(-1, self.horizon, self.action_dim)
        centres = (ids + 0.5) / self.num_bins * 2 - 1
        return Detokenized(unnormalize(centres, self.low, self.high), valid)

    def save(self, directory: str | Path) -> None:
        fields = {"kind": self.kind, "low": self.low.tolist(), "high": self.high.tolist(), "horizon": self.horizon,
                  "num_bins": self.num_bins}  # fmt: skip
        Path(directory, TOKENIZER_FILE).write_text(json.dumps(fields, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> UniformBinTokenizer:
        saved = json.loads(Path(directory, TOKENIZER_FILE).read_text())
        return cls(np.array(saved["low"]), np.array(saved["high"]), saved["horizon"], saved["num_bins"])
