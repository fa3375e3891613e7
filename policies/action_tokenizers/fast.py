"""A FAST-style chunk tokenizer (Pertsch et al. 2025): DCT per action dimension, scaled and rounded
coefficients, byte-pair encoding over them.

Encoding a chunk (H, A): normalize each dimension to [-1, 1] by its fitted range (values outside are
clipped and counted), take the orthonormal DCT-II over the H steps of each dimension, multiply by
``scale`` and round, then read the (H, A) integers frequency-major (every dimension's lowest
frequency first, as FAST flattens them) as characters of a fixed alphabet and byte-pair encode them
(Hugging Face ``tokenizers``, trained on the dataset's chunks). Smooth chunks have few large
coefficients, so BPE merges their long runs of zeros into a few tokens.

Round-trip error: rounding moves each coefficient by at most 1 / (2 scale); the inverse DCT is
orthonormal, so each dimension's error over the chunk has an L2 norm of at most sqrt(H) / (2 scale)
in normalized units, and no single value is off by more than that, times (high - low) / 2 in action
units.

The alphabet covers every integer a chunk inside the range can produce (|coefficient| <= sqrt(H), as
the DCT is orthonormal), so every chunk encodes; any token sequence decodes (missing coefficients are
zero, extra ones are dropped, and the sequence is marked not valid).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from scipy.fft import dct, idct

from policies.action_tokenizers.base import (
    TOKENIZER_FILE,
    Detokenized,
    Tokenized,
    check_chunks,
    normalize,
    quantile_range,
    unnormalize,
)

BPE_FILE = "action_tokenizer_bpe.json"
FIRST_CHAR = 0x4E00  # integers are written as characters from here on (a block with no whitespace or marks)


class FASTTokenizer:
    """DCT + BPE over chunks of ``horizon`` steps; token ids are the BPE model's (``vocab_size``)."""

    kind = "fast"

    def __init__(self, low, high, horizon: int, scale: float, bpe):
        self.low, self.high = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
        self.horizon, self.action_dim, self.scale, self.bpe = horizon, len(self.low), float(scale), bpe
        self.max_abs = math.ceil(self.scale * math.sqrt(horizon))  # the largest |integer| a chunk can give

    @classmethod
    def fit(cls, chunks: np.ndarray, scale: float = 10.0, vocab_size: int = 1024) -> FASTTokenizer:
        """Fitted on a dataset's action chunks (N, H, A): the range, then BPE on their coefficient strings."""
        from tokenizers import Tokenizer, models, trainers

        chunks = np.asarray(chunks, dtype=np.float64)
        low, high = quantile_range(chunks)
        tokenizer = cls(low, high, chunks.shape[1], scale, None)
        alphabet = [tokenizer._char(i) for i in range(-tokenizer.max_abs, tokenizer.max_abs + 1)]
        if vocab_size < len(alphabet):
            raise ValueError(f"vocab_size={vocab_size} must hold the {len(alphabet)} coefficient values (2 x scale x "
                             f"sqrt(horizon) + 1): raise it (--policy.action_vocab_size) or lower scale "
                             f"(--policy.fast_scale)")  # fmt: skip
        bpe = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False,
                                      max_token_length=64)  # fmt: skip
        bpe.train_from_iterator(tokenizer._strings(chunks)[0], trainer=trainer)
        tokenizer.bpe = bpe
        return tokenizer

    @property
    def vocab_size(self) -> int:
        return self.bpe.get_vocab_size()

    def max_error(self) -> np.ndarray:
        """(A,) an upper bound of the round-trip error of a value inside the fitted range, in action units."""
        return math.sqrt(self.horizon) / (2 * self.scale) * (self.high - self.low) / 2

    def encode(self, chunks) -> Tokenized:
        """Chunks (B, H, A) -> B token sequences (as long as their chunk needs)."""
        strings, clipped = self._strings(check_chunks(chunks, self.horizon, self.action_dim))
        return Tokenized([encoding.ids for encoding in self.bpe.encode_batch(strings)], clipped)

    def decode(self, tokens: list[list[int]]) -> Detokenized:
        """B sequences of ids -> chunks (B, H, A); any sequence gives a finite chunk of that shape."""
        n = self.horizon * self.action_dim
        coefficients = np.zeros((len(tokens), n))
        valid = np.ones(len(tokens), dtype=bool)
        for b, sequence in enumerate(tokens):
            known = [i for i in sequence if 0 <= i < self.vocab_size]
            text = "".join(self.bpe.id_to_token(i) for i in known)
            values = [ord(c) - FIRST_CHAR - self.max_abs for c in text]
            in_alphabet = [v for v in values if -self.max_abs <= v <= self.max_abs][:n]
            coefficients[b, : len(in_alphabet)] = in_alphabet
            valid[b] = len(known) == len(sequence) and len(values) == n and len(in_alphabet) == n
        frequency_major = coefficients.reshape(len(tokens), self.horizon, self.action_dim) / self.scale
        scaled = idct(frequency_major, type=2, norm="ortho", axis=1)
        return Detokenized(unnormalize(scaled, self.low, self.high), valid)

    def save(self, directory: str | Path) -> None:
        fields = {"kind": self.kind, "low": self.low.tolist(), "high": self.high.tolist(), "horizon": self.horizon,
                  "scale": self.scale, "bpe": BPE_FILE}  # fmt: skip
        Path(directory, TOKENIZER_FILE).write_text(json.dumps(fields, indent=2))
        self.bpe.save(str(Path(directory, BPE_FILE)))

    @classmethod
    def load(cls, directory: str | Path) -> FASTTokenizer:
        from tokenizers import Tokenizer

        saved = json.loads(Path(directory, TOKENIZER_FILE).read_text())
        bpe = Tokenizer.from_file(str(Path(directory, saved["bpe"])))
        return cls(np.array(saved["low"]), np.array(saved["high"]), saved["horizon"], saved["scale"], bpe)

    # -- internals -------------------------------------------------------------------------------

    def _char(self, value: int) -> str:
        return chr(FIRST_CHAR + self.max_abs + value)

    def _strings(self, chunks: np.ndarray) -> tuple[list[str], np.ndarray]:
        """(B, H, A) chunks -> their coefficient strings (frequency-major) and clipped counts (B,)."""
        scaled, clipped = normalize(chunks, self.low, self.high)
        coefficients = np.rint(dct(scaled, type=2, norm="ortho", axis=1) * self.scale).astype(np.int64)
        coefficients = coefficients.clip(-self.max_abs, self.max_abs).reshape(len(chunks), -1)
        return ["".join(self._char(int(v)) for v in row) for row in coefficients], clipped
