"""The autoregressive VLA's backbone: `transformers`' PaliGemma (SigLIP + a linear projector + Gemma), built
from a small config with random weights or loaded from a local directory with its processor, and its
language model in the form `policies.token_decoding` reads a causal LM.

vla-rl composes the prompt itself (`Backbone.prefix`) instead of calling PaliGemma's ``forward`` with
``pixel_values``: the camera patches come from PaliGemma's own ``get_image_features`` (the tower and
the projector) and the instruction from its embedding table, so both enter at the scale PaliGemma's own
forward gives them whichever transformers applies the Gemma sqrt(width) scaling (5.x in the embedding
table, with the patches unscaled; 4.x inside the decoder, with the patches divided by it first); the state
and committed actions come from linear layers of the policy. The decoder attends causally over the whole sequence (PaliGemma's prefix is bidirectional:
a pretrained PaliGemma is fine-tuned into this attention pattern).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from policies.autoregressive_vla.configuration_autoregressive_vla import AutoregressiveVLAConfig
from policies.keypoints import ImageEncoder
from policies.tokenizer import PAD_WORD, UNKNOWN_WORD, WordTokenizer


@dataclass
class LMOutput:
    logits: torch.Tensor  # (B, L, V), or (B, logits_to_keep, V)
    past_key_values: object  # transformers' cache, or None
    hidden: torch.Tensor  # (B, L, width): the last hidden states


class ActionLM:
    """PaliGemma's Gemma and its output layer as a causal LM over ``inputs_embeds`` (what
    `policies.token_decoding` calls). Not a module: the weights belong to the policy's ``vlm``."""

    def __init__(self, vlm):
        self.vlm = vlm

    @property
    def config(self):
        return self.vlm.config.text_config  # vocab_size: the text vocabulary plus the action tokens and the end

    def get_input_embeddings(self) -> nn.Module:
        return self.vlm.get_input_embeddings()

    def __call__(self, *, inputs_embeds, attention_mask, position_ids, past_key_values=None, use_cache=False,
                 logits_to_keep: int = 0):  # fmt: skip
        """``logits_to_keep``: the logits of the last that many positions only (0: all), as transformers' LMs."""
        out = self.vlm.model.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache,
        )  # fmt: skip
        hidden = out.last_hidden_state
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return LMOutput(self.vlm.lm_head(kept), out.past_key_values if use_cache else None, hidden)


def build_vlm(cfg: AutoregressiveVLAConfig, extra_tokens: int, saved: Path | None = None):
    """(PaliGemma model, its processor or None, instruction tokenizer, image mean, image std, the text
    vocabulary's size): built from ``cfg``'s sizes (random weights, the word-level tokenizer over
    ``cfg.vocabulary``) or loaded from ``cfg.pretrained_backbone``, its vocabulary extended by ``extra_tokens``
    (the action tokens and the end). ``saved``: a checkpoint's ``backbone/`` (the extended config and the
    processor of a pretrained backbone, `Backbone.save`): the model is built from it, its weights to come
    from the checkpoint, so a checkpoint does not need the directory it was trained from."""
    if saved is not None:
        return _from_saved(cfg, extra_tokens, saved)
    if cfg.pretrained_backbone:
        return _load_pretrained(cfg, extra_tokens)
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    words = cfg.vocabulary or [PAD_WORD, UNKNOWN_WORD]
    vocab = len(words) + extra_tokens
    head_dim = cfg.width // cfg.heads
    config = PaliGemmaConfig(
        vision_config={
            "model_type": "siglip_vision_model", "hidden_size": cfg.vision_width, "num_hidden_layers": cfg.vision_layers,
            "intermediate_size": cfg.mlp_ratio * cfg.vision_width, "num_attention_heads": cfg.heads,
            "image_size": cfg.image_size, "patch_size": cfg.patch_size, "projection_dim": cfg.width,
            "vision_use_head": False,  # PaliGemma reads the patches; a pooling head would get no gradient
        },
        text_config={
            "model_type": "gemma", "hidden_size": cfg.width, "intermediate_size": cfg.mlp_ratio * cfg.width,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": head_dim, "vocab_size": vocab, "max_position_embeddings": 4096,
        },
        projection_dim=cfg.width, vocab_size=vocab, image_token_index=0,  # vla-rl places the patches itself
    )  # fmt: skip
    vlm = PaliGemmaForConditionalGeneration(config)
    return vlm, None, WordTokenizer(words, cfg.max_text_tokens), (0.5,) * 3, (0.5,) * 3, len(words)


def _processor(directory: Path, flag: str):
    from transformers import AutoProcessor

    if not (directory / "config.json").is_file():
        raise ValueError(
            f"{flag}={directory} holds no config.json: pass a local PaliGemma directory (save_pretrained of the "
            f"model and its processor)"
        )
    try:
        return AutoProcessor.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{flag}={directory} has no processor ({error.__class__.__name__}); save the model's processor beside it "
            f"(AutoProcessor.from_pretrained(<hub id>).save_pretrained('{directory}'))"
        ) from None


def _load_pretrained(cfg: AutoregressiveVLAConfig, extra_tokens: int):
    from transformers import PaliGemmaForConditionalGeneration

    directory = Path(cfg.pretrained_backbone)
    processor = _processor(directory, "policy.pretrained_backbone")
    # float32, whatever dtype the checkpoint was saved in: AdamW steps on bf16 weights lose small updates.
    vlm = PaliGemmaForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
    text_vocab = vlm.get_input_embeddings().num_embeddings
    vlm.resize_token_embeddings(text_vocab + extra_tokens)
    return (vlm, processor, *_reading(processor, cfg.max_text_tokens), text_vocab)


def _from_saved(cfg: AutoregressiveVLAConfig, extra_tokens: int, saved: Path):
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    processor = _processor(saved, "the checkpoint's backbone")
    vlm = PaliGemmaForConditionalGeneration(PaliGemmaConfig.from_pretrained(saved))  # its vocabulary extended already
    text_vocab = vlm.get_input_embeddings().num_embeddings - extra_tokens
    return (vlm, processor, *_reading(processor, cfg.max_text_tokens), text_vocab)


def _reading(processor, max_text_tokens: int):
    """(instruction tokenizer, image mean, image std) of a PaliGemma processor."""
    hf_tokenizer, image = processor.tokenizer, processor.image_processor

    def tokenize(texts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        out = hf_tokenizer(list(texts), padding="max_length", truncation=True, max_length=max_text_tokens,
                           return_tensors="pt")  # fmt: skip
        return out["input_ids"].to(device), out["attention_mask"].to(device)

    return tokenize, tuple(image.image_mean), tuple(image.image_std)


class KeypointTokens(nn.Module):
    """(B, 3, S, S) in [0, 1] -> (B, K, width): the keypoint CNN (`policies.keypoints.ImageEncoder`, the diffusion
    policy's vision), each keypoint a token: a linear map of its (x, y) plus the keypoint's own learned embedding."""

    def __init__(self, channels: int, keypoints: int, width: int):
        super().__init__()
        self.encoder = ImageEncoder(channels, keypoints)
        self.coordinates = nn.Linear(2, width)
        self.index = nn.Parameter(torch.randn(keypoints, width) * 0.02)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        xy = self.encoder(image).unflatten(1, (-1, 2))  # (B, K, 2)
        return self.coordinates(xy) + self.index


class Backbone(nn.Module):
    """The VLM and the prompt's own inputs: observation -> (prefix (B, P, width), mask (B, P)).

    The prefix is [camera_1 image tokens | ... | instruction tokens | committed actions | state], a camera's
    image tokens its SigLIP patches, its keypoint tokens, or both (``vision``); its mask is
    False on instruction padding and on committed rows that are not committed. The state token is last
    and always present: its hidden state is what a value head reads.
    """

    def __init__(self, cfg: AutoregressiveVLAConfig, extra_tokens: int, saved: Path | None = None):
        super().__init__()
        self.vlm, self.processor, self.tokenize, mean, std, self.text_vocab = build_vlm(cfg, extra_tokens, saved)
        self.register_buffer("pixel_mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        self.image_size = self.vlm.config.vision_config.image_size
        width = self.vlm.config.text_config.hidden_size
        self.state_proj = nn.Linear(cfg.state_dim, width)
        # Training-time RTC: each committed row is a prompt token (its action, projected, plus its row).
        self.committed_proj = nn.Linear(cfg.action_dim, width) if cfg.max_delay_steps else None
        self.committed_row = nn.Parameter(torch.zeros(cfg.max_delay_steps, width)) if cfg.max_delay_steps else None
        self.lm = ActionLM(self.vlm)
        self.vision, self.keypoint_size = cfg.vision, cfg.image_size
        self.keypoints = None
        if cfg.vision != "siglip":
            self.keypoints = nn.ModuleList(
                [KeypointTokens(cfg.vision_channels, cfg.num_keypoints, width) for _ in cfg.cameras]
            )
        if cfg.vision == "keypoints":  # the tower reads nothing: frozen, so no optimizer or DDP waits on it
            self.vlm.model.vision_tower.requires_grad_(False)
            self.vlm.model.multi_modal_projector.requires_grad_(False)

    def save(self, directory: Path) -> None:
        """A pretrained backbone's extended config and processor into ``directory`` (`build_vlm`'s ``saved``); the
        weights travel in the policy's ``model.safetensors``. A backbone built from the policy's config needs none."""
        if self.processor is not None:
            self.vlm.config.save_pretrained(directory)
            self.processor.save_pretrained(directory)

    @property
    def width(self) -> int:
        return self.vlm.config.text_config.hidden_size

    def prefix(self, images: list[torch.Tensor], state: torch.Tensor, instructions: list[str],
               committed: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """images: per camera (B, 3, S, S) in [0, 1]; state (B, S) normalized; committed: (normalized actions
        (B, D, A), known (B, D) bool), D = max_delay_steps, or None -> (prefix (B, P, width), mask (B, P) long)."""
        b, device = state.shape[0], state.device
        patches = self.image_tokens(images)  # (B, n_cam * P, width)
        ids, text_mask = self.tokenize(list(instructions), device)
        parts = [patches, self.lm.get_input_embeddings()(ids).to(patches)]
        masks = [torch.ones(patches.shape[:2], dtype=torch.long, device=device), text_mask.long()]
        if self.committed_proj is not None:
            rows = len(self.committed_row)
            if committed is None:  # no augmentation: nothing is committed
                actions = torch.zeros(b, rows, self.committed_proj.in_features, device=device)
                known = torch.zeros(b, rows, dtype=torch.bool, device=device)
            else:
                actions, known = committed
            parts.append(self.committed_proj(actions.to(patches)) + self.committed_row)
            masks.append(known.long())
        parts.append(self.state_proj(state.to(patches))[:, None])
        masks.append(torch.ones(b, 1, dtype=torch.long, device=device))
        return torch.cat(parts, 1), torch.cat(masks, 1)

    def image_tokens(self, images: list[torch.Tensor]) -> torch.Tensor:
        """Per camera (B, 3, S, S) in [0, 1] -> (B, n_cam * P, width): each camera's tokens in turn (``vision``)."""
        b, per_camera = images[0].shape[0], []
        if self.keypoints is not None:  # the keypoint CNN is built for one size: resized to it, not normalized
            per_camera.append([enc(_sized(image, self.keypoint_size)) for enc, image in zip(self.keypoints, images)])
        if self.vision != "keypoints":
            pixels = torch.cat([self._pixels(image) for image in images])  # (n_cam * B, 3, s, s)
            patches = self.vlm.model.get_image_features(pixel_values=pixels)  # (n_cam * B, P, width)
            patches = getattr(patches, "pooler_output", patches)  # transformers 5 wraps it; 4.x returns the tensor
            per_camera.append(patches.unflatten(0, (len(images), b)).unbind(0))
        return torch.cat([token for camera in zip(*per_camera) for token in camera], 1)

    def _pixels(self, image: torch.Tensor) -> torch.Tensor:
        return (_sized(image, self.image_size) - self.pixel_mean) / self.pixel_std


def _sized(image: torch.Tensor, size: int) -> torch.Tensor:
    """(B, 3, H, W) -> (B, 3, size, size), bilinear where it differs."""
    if image.shape[-1] != size or image.shape[-2] != size:
        image = F.interpolate(image, size=(size, size), mode="bilinear", align_corners=False)
    return image
