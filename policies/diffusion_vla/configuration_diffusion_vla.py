"""Configuration of the vision-language diffusion/flow VLA (SigLIP-style encoders + a DiT action expert)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from policies.flow_matching import Objective
from policies.pretrained import DenoisingPolicyConfig, PolicyConfig

DdpmSampler = Literal["ddim", "ddpm"]


@PolicyConfig.register_subclass("diffusion_vla")
@dataclass
class DiffusionVLAConfig(DenoisingPolicyConfig):
    """Condition encoder (images, instruction, state -> tokens) + a diffusion transformer over the chunk.

    The encoders are `transformers` SigLIP vision and text towers, built from the sizes below with
    random weights, or loaded from ``pretrained_encoder`` (a local directory holding a SigLIP
    checkpoint and its tokenizer) when one is given. Camera images of another size than
    ``image_size`` are resized to it by the encoder.
    """

    # -- condition encoder (ignored where pretrained_encoder gives the sizes) --
    pretrained_encoder: str = ""  # local SigLIP directory (config, weights, tokenizer); empty = random init
    patch_size: int = 8  # vision patch side, pixels
    vision_width: int = 128  # vision tower width
    vision_layers: int = 2  # vision tower depth
    text_width: int = 64  # text tower width
    text_layers: int = 1  # text tower depth
    # Keep the vision and text towers fixed, as when fine-tuning on top of a pretrained encoder;
    # their projections into the DiT width still train. Frozen towers run without autograd.
    freeze_towers: bool = False
    # -- diffusion transformer over the action chunk --
    dim: int = 128  # DiT width; condition tokens are projected to it
    depth: int = 4  # DiT blocks (self-attention within a chunk, cross-attention to the condition, MLP)
    heads: int = 4  # attention heads in the DiT and the encoders
    mlp_ratio: float = 4.0  # MLP width / dim
    # -- objective --
    objective: Objective = "flow"  # the VLA's default; see DenoisingPolicyConfig
    ddpm_sampler: DdpmSampler = "ddim"  # ddpm only: ddim (deterministic, few steps) or ddpm

    def validate(self) -> None:
        """Raise ValueError naming the fix for an inconsistent config."""
        super().validate()
        if self.ddpm_sampler not in get_args(DdpmSampler):
            raise ValueError(f"policy.ddpm_sampler must be one of {get_args(DdpmSampler)}, got {self.ddpm_sampler!r}")
        if self.dim % self.heads or self.vision_width % self.heads or self.text_width % self.heads:
            raise ValueError(
                f"policy.dim={self.dim}, vision_width={self.vision_width} and text_width={self.text_width} "
                f"must be divisible by policy.heads={self.heads}"
            )
        if not self.pretrained_encoder and self.image_size % self.patch_size:
            raise ValueError(f"policy.image_size={self.image_size} must be a multiple of patch_size={self.patch_size}")
