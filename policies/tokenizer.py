"""The one word-level instruction tokenizer shared by every policy that has no pretrained tokenizer.

The vocabulary is built from the dataset's task strings when training starts and is stored in the
policy config (``vocabulary``), so a checkpoint tokenizes exactly as it did in training. Ids 0 and 1
are padding and unknown words.
"""

from __future__ import annotations

import re

import torch

PAD_WORD, UNKNOWN_WORD = "<pad>", "<unk>"


def words(text: str) -> list[str]:
    """Lower-case alphanumeric words of an instruction: ``"Pick up the RED cube."`` -> pick, up, the, red, cube."""
    return re.findall(r"[a-z0-9]+", text.lower())


def word_vocabulary(instructions: list[str]) -> list[str]:
    """The word-level vocabulary of a set of instructions; ids 0 and 1 are padding and unknown."""
    return [PAD_WORD, UNKNOWN_WORD] + sorted({w for text in instructions for w in words(text)})


class WordTokenizer:
    """Instruction strings -> (input_ids (B, T) long, attention_mask (B, T) long), padded to max_tokens.

    Words beyond ``max_tokens`` are cut; an instruction without words becomes one unknown word.
    """

    def __init__(self, vocabulary: list[str], max_tokens: int):
        if vocabulary[:2] != [PAD_WORD, UNKNOWN_WORD]:
            raise ValueError("the vocabulary must start with <pad>, <unk>; build it with word_vocabulary()")
        self.index = {w: i for i, w in enumerate(vocabulary)}
        self.max_tokens = max_tokens

    def __call__(self, instructions: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(instructions), self.max_tokens, dtype=torch.long)
        for row, text in enumerate(instructions):
            found = (words(text) or [UNKNOWN_WORD])[: self.max_tokens]
            ids[row, : len(found)] = torch.tensor([self.index.get(w, 1) for w in found])
        return ids.to(device), (ids != 0).long().to(device)
