"""Action tokenizers: continuous action chunks <-> token ids, for autoregressive VLAs.

Two kinds, each fitted on a dataset's action chunks and saved inside the checkpoint
(``action_tokenizer.json``, plus the BPE model of the FAST one):

- `binning.UniformBinTokenizer` (RT-2, OpenVLA): each action value in its own token, from
  ``num_bins`` uniform bins per dimension between the dataset's quantiles; H x A tokens per chunk.
- `fast.FASTTokenizer` (Pertsch et al. 2025, "FAST"): a DCT per action dimension over the chunk,
  scaled and rounded coefficients, byte-pair encoding over them (Hugging Face ``tokenizers``); a
  smooth chunk takes a few tokens.

Both clip values outside the fitted range and count them (``Tokenized.clipped``), and decode *any*
sequence of their token ids to a finite chunk of the fitted shape (``Detokenized.valid`` says whether
the sequence was one the tokenizer could have produced), so a constrained decoder can never emit a
chunk that breaks the robot.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from policies.action_tokenizers.base import TOKENIZER_FILE, Detokenized, Tokenized
from policies.action_tokenizers.binning import UniformBinTokenizer
from policies.action_tokenizers.fast import FASTTokenizer

KINDS = {"uniform_bins": UniformBinTokenizer, "fast": FASTTokenizer}

__all__ = ["KINDS", "Detokenized", "FASTTokenizer", "Tokenized", "UniformBinTokenizer", "fit_action_tokenizer",
           "load_action_tokenizer"]  # fmt: skip


def fit_action_tokenizer(kind: str, chunks, **settings):
    """An action tokenizer of ``kind`` (``uniform_bins``: ``num_bins``; ``fast``: ``scale``, ``vocab_size``)
    fitted on a dataset's action chunks (F, H, A), e.g. ``vla_core.data.ChunkedDemos.action_chunks(H)``."""
    if kind not in KINDS:
        raise ValueError(f"unknown action tokenizer {kind!r}; choose one of {', '.join(KINDS)}")
    return KINDS[kind].fit(np.asarray(chunks, dtype=np.float64), **settings)


def load_action_tokenizer(directory: str | Path):
    """The action tokenizer saved in ``directory``; ValueError naming the fix when there is none."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(
            f"{directory} holds no {TOKENIZER_FILE}: the checkpoint lacks its action tokenizer; fit one on the "
            f"training dataset (its save() writes it beside the weights)"
        )
    saved = json.loads(path.read_text())
    kind = saved.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{path} names an unknown action tokenizer {kind!r}; known: {', '.join(KINDS)}")
    return KINDS[kind].load(directory)
