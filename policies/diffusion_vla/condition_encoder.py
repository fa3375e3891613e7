"""Observation -> condition tokens for the diffusion action expert.

Images go through a SigLIP vision tower (one tower shared by all cameras, plus a learned camera
embedding), the instruction through a SigLIP text tower, the normalized state through a linear
layer. Every token is projected to the DiT width:

    tokens (B, L, dim) = [camera_1 patches | ... | camera_n patches | instruction tokens | state]
    mask   (B, L) bool, False on instruction padding

The towers are built from config with random weights, or loaded from a local pretrained SigLIP
directory (weights and tokenizer). Without a pretrained tokenizer, instructions are split into
words over the dataset's vocabulary. A policy trained on pretrained towers saves their configs and
tokenizer beside its weights (`ConditionEncoder.save`, the checkpoint's ``encoder/``) and is rebuilt
from them (``saved``), so a checkpoint loads without the directory it was trained from.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from policies.diffusion_vla.configuration_diffusion_vla import DiffusionVLAConfig
from policies.tokenizer import PAD_WORD, UNKNOWN_WORD, WordTokenizer


class ConditionEncoder(nn.Module):
    """Observation batch -> (tokens (B, L, dim), mask (B, L) bool). See the module docstring."""

    def __init__(self, config: DiffusionVLAConfig, saved: Path | None = None):
        """``saved``: a checkpoint's ``encoder/`` (`save`): the towers are built from the configs there (their
        weights to come from the checkpoint) and the tokenizer read from there, instead of from
        ``config.pretrained_encoder``."""
        super().__init__()
        from transformers import AutoTokenizer, SiglipTextConfig, SiglipTextModel, SiglipVisionConfig, SiglipVisionModel

        cfg = config
        self.hf_tokenizer = None  # a pretrained encoder's tokenizer, saved with the checkpoint
        if saved is not None:
            self.vision = SiglipVisionModel(SiglipVisionConfig.from_pretrained(saved / "vision"))
            self.text = SiglipTextModel(SiglipTextConfig.from_pretrained(saved / "text"))
            self.hf_tokenizer = AutoTokenizer.from_pretrained(saved / "tokenizer")
        elif cfg.pretrained_encoder:
            check_siglip_folder(Path(cfg.pretrained_encoder))
            self.vision = SiglipVisionModel.from_pretrained(cfg.pretrained_encoder)
            self.text = SiglipTextModel.from_pretrained(cfg.pretrained_encoder)
            self.hf_tokenizer = AutoTokenizer.from_pretrained(cfg.pretrained_encoder)
        if self.hf_tokenizer is not None:
            hf_tokenizer = self.hf_tokenizer
            self.tokenize = lambda texts, device: _hf_tokenize(hf_tokenizer, texts, cfg.max_text_tokens, device)
        else:
            mlp = int(cfg.mlp_ratio)
            self.vision = SiglipVisionModel(SiglipVisionConfig(
                hidden_size=cfg.vision_width, intermediate_size=mlp * cfg.vision_width,
                num_hidden_layers=cfg.vision_layers, num_attention_heads=cfg.heads,
                image_size=cfg.image_size, patch_size=cfg.patch_size, vision_use_head=False,
            ))  # fmt: skip
            vocabulary = cfg.vocabulary or [PAD_WORD, UNKNOWN_WORD]
            self.text = SiglipTextModel(SiglipTextConfig(
                vocab_size=len(vocabulary), hidden_size=cfg.text_width, intermediate_size=mlp * cfg.text_width,
                num_hidden_layers=cfg.text_layers, num_attention_heads=cfg.heads,
                max_position_embeddings=cfg.max_text_tokens, pad_token_id=0,
            ))  # fmt: skip
            self.tokenize = WordTokenizer(vocabulary, cfg.max_text_tokens)
        self.freeze_towers = cfg.freeze_towers
        if self.freeze_towers:
            self.vision.requires_grad_(False)
            self.text.requires_grad_(False)
        self.image_size = self.vision.config.image_size
        self.cameras = list(cfg.cameras)
        self.vision_proj = nn.Linear(self.vision.config.hidden_size, cfg.dim)
        self.camera_embedding = nn.Parameter(torch.zeros(len(self.cameras), 1, cfg.dim))
        self.text_proj = nn.Linear(self.text.config.hidden_size, cfg.dim)
        self.state_proj = nn.Linear(cfg.state_dim, cfg.dim)
        self.out_norm = nn.LayerNorm(cfg.dim)

    def save(self, directory: Path) -> None:
        """Pretrained towers' configs and tokenizer into ``directory`` (the ``saved`` of a rebuild); the weights
        travel in the policy's ``model.safetensors``. Towers built from the policy's config need nothing."""
        if self.hf_tokenizer is not None:
            self.vision.config.save_pretrained(directory / "vision")
            self.text.config.save_pretrained(directory / "text")
            self.hf_tokenizer.save_pretrained(directory / "tokenizer")

    def forward(self, images: list[torch.Tensor], state: torch.Tensor, instructions: list[str]):
        """images: per camera (B, 3, S, S) in [0, 1]; state (B, state_dim), normalized; B instructions."""
        b = state.shape[0]
        pixels = torch.cat([self._resize(img) for img in images]) * 2.0 - 1.0  # (n_cam * B, 3, s, s), SigLIP range
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_towers):
            vision_out = self.vision(pixel_values=pixels).last_hidden_state
        patches = self.vision_proj(vision_out)  # (n_cam * B, P, dim)
        patches = patches.unflatten(0, (len(images), b)) + self.camera_embedding[:, None]  # (n_cam, B, P, dim)
        vision_tokens = patches.permute(1, 0, 2, 3).flatten(1, 2)  # (B, n_cam * P, dim)
        ids, attention = self.tokenize(instructions, state.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_towers):
            text_out = self.text(input_ids=ids, attention_mask=attention).last_hidden_state
        text_tokens = self.text_proj(text_out)  # (B, T, dim)
        state_token = self.state_proj(state)[:, None]  # (B, 1, dim)
        tokens = self.out_norm(torch.cat([vision_tokens, text_tokens, state_token], 1))
        mask = torch.cat([
            torch.ones(vision_tokens.shape[:2], dtype=torch.bool, device=state.device),
            attention.bool(),
            torch.ones(b, 1, dtype=torch.bool, device=state.device),
        ], 1)  # fmt: skip
        return tokens, mask

    def _resize(self, image: torch.Tensor) -> torch.Tensor:
        if image.shape[-1] == self.image_size and image.shape[-2] == self.image_size:
            return image
        return F.interpolate(image, size=(self.image_size, self.image_size), mode="bilinear", antialias=True)


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")  # a fast tokenizer, or SigLIP's SentencePiece model


def check_siglip_folder(directory: Path) -> None:
    """Raise ValueError, one line naming what is missing, unless ``directory`` holds a SigLIP model (both towers:
    ``model_type`` "siglip"), its weights and its tokenizer, as `save_pretrained` of a `SiglipModel` and of its
    tokenizer write them (and as ``google/siglip-*`` ships)."""
    import json

    where = f"policy.pretrained_encoder={directory}"
    if not directory.is_dir():
        raise ValueError(
            f"{where} is not a directory: pass a local SigLIP folder (`vla-rl pretrain-encoder` writes one)"
        )
    config = directory / "config.json"
    if not config.is_file():
        raise ValueError(f"{where} has no config.json: not a transformers model folder")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type != "siglip":
        raise ValueError(
            f"{where} holds a {model_type!r} model, not SigLIP (config.json model_type 'siglip', both towers)"
        )
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"{where} has no weights: none of {', '.join(WEIGHT_FILES)}")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{where} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} (write it with tokenizer.save_pretrained)"
        )


def _hf_tokenize(tokenizer, instructions: list[str], max_tokens: int, device):
    enc = tokenizer(
        list(instructions), padding="max_length", truncation=True, max_length=max_tokens, return_tensors="pt"
    )
    ids = enc["input_ids"]
    # SigLIP tokenizers return no attention mask; padding positions are the pad id.
    attention = enc.get("attention_mask", (ids != tokenizer.pad_token_id).long())
    return ids.to(device), attention.to(device)
