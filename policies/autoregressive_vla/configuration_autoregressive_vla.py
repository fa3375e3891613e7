"""Configuration of the autoregressive VLA: a PaliGemma-style backbone and an action tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from policies.pretrained import PolicyConfig
from vla_core.types import ENVIRONMENT_STATE

ActionTokenizerKind = Literal["fast", "uniform_bins"]
VisionKind = Literal["siglip", "keypoints", "both"]
ActionFrame = Literal["absolute", "delta"]


@PolicyConfig.register_subclass("autoregressive_vla")
@dataclass
class AutoregressiveVLAConfig(PolicyConfig):
    """A vision-language model that reads [camera patches | instruction | committed actions | state] and
    writes the chunk as action tokens.

    The backbone is `transformers`' PaliGemma (a SigLIP vision tower, a linear projector and a Gemma
    decoder), built from the sizes below with random weights, or loaded from ``pretrained_backbone`` (a
    local PaliGemma directory with its processor: the tokenizer reads the instruction, the image
    processor's mean and std normalize the cameras). The action tokens are appended to the vocabulary
    (``action_vocab_size`` of them and one end token), so a pretrained model keeps its own words.
    """

    # -- backbone (ignored where pretrained_backbone gives the sizes) --
    pretrained_backbone: str = ""  # local PaliGemma directory (config, weights, processor); empty = random init
    patch_size: int = 8  # vision patch side, pixels
    vision_width: int = 64  # SigLIP width
    vision_layers: int = 1  # SigLIP depth
    width: int = 128  # Gemma width (the vision patches are projected to it)
    layers: int = 2  # Gemma depth
    heads: int = 4  # attention heads (SigLIP and Gemma)
    kv_heads: int = 1  # Gemma's key-value heads (multi-query attention, as PaliGemma's Gemma)
    mlp_ratio: int = 4  # MLP width / width
    # -- the image tokens --
    # siglip: the SigLIP patches (what a pretrained PaliGemma fills); keypoints: per camera the diffusion policy's
    # keypoint CNN (`policies.keypoints`), each keypoint's image coordinates one token (the tower then unused, frozen);
    # both: the keypoint tokens, then the patches. `vla-rl probe-localization` measures which finds the object.
    vision: VisionKind = "siglip"
    vision_channels: int = 32  # keypoints: the CNN's width
    num_keypoints: int = 32  # keypoints: per camera, one token each
    # -- action tokens --
    action_tokenizer: ActionTokenizerKind = "fast"  # fast (DCT + BPE over the chunk) or uniform_bins (RT-2/OpenVLA)
    # fast: the BPE vocabulary's size; uniform_bins: the bins per dimension. The action tokens in the vocabulary.
    action_vocab_size: int = 256
    fast_scale: float = 10.0  # fast: DCT coefficients are multiplied by this before rounding
    # The decoder's token budget per chunk; 0 = the tokenizer's worst case (uniform_bins: H x A; fast: the
    # longest chunk of the training data, plus a quarter), set when the tokenizer is fitted.
    max_action_tokens: int = 0
    temperature: float = 0.0  # predict_chunk's decoding: 0 = greedy, else sampled at this temperature
    # The frame the tokenizer writes in (`policies.action_tokenizers.relative`): absolute = the dataset's actions;
    # delta = row 0 as the step from the state's entry of the same name, later rows as the step from the row before
    # (dimensions with no such state entry stay absolute); the range is fitted on those steps.
    action_frame: ActionFrame = "absolute"
    # Imitation's auxiliary objective: a linear head on the prompt's readout (`prefix_features`) regresses the
    # dataset's true state (observation.environment_state: `vla-rl record --environment_state=true`), standardized
    # by its dataset statistics; its mean squared error times this weight is added to the token loss. It asks the
    # front end where the task's objects are, which the action tokens alone do not teach (`vla-rl
    # probe-localization`). 0 = off; the head is trained, never read when acting.
    environment_state_weight: float = 0.0
    environment_state_dim: int = 0  # the true state's entries, set from the dataset when the weight is > 0
    # delta: per action dimension the state entry row 0 is relative to (-1: absolute); set from the dataset's names
    # when the tokenizer is fitted, saved with the checkpoint.
    delta_state_indices: list[int] = field(default_factory=list)

    def fit_to_dataset(self, features: dict[str, dict], tasks: list[str], cameras: list[str] | None = None) -> None:
        """The base fields, and with the auxiliary objective on, the true state's size; ValueError naming the fix
        when the dataset has none."""
        super().fit_to_dataset(features, tasks, cameras)
        if self.environment_state_weight > 0:
            if ENVIRONMENT_STATE not in features:
                raise ValueError(f"policy.environment_state_weight={self.environment_state_weight} regresses the "
                                 f"dataset's {ENVIRONMENT_STATE}, which this dataset lacks: record it with `vla-rl "
                                 f"record --environment_state=true`, or set the weight to 0")  # fmt: skip
            self.environment_state_dim = int(features[ENVIRONMENT_STATE]["shape"][0])

    def validate(self) -> None:
        """Raise ValueError naming the fix for an inconsistent config."""
        super().validate()
        if self.action_tokenizer not in get_args(ActionTokenizerKind):
            raise ValueError(
                f"policy.action_tokenizer must be one of {get_args(ActionTokenizerKind)}, got {self.action_tokenizer!r}"
            )
        if self.vision not in get_args(VisionKind):
            raise ValueError(f"policy.vision must be one of {get_args(VisionKind)}, got {self.vision!r}")
        if self.vision != "siglip" and (self.vision_channels % 8 or self.num_keypoints < 1):
            raise ValueError(f"policy.vision_channels={self.vision_channels} must be a multiple of 8 (its group norm) "
                             f"and policy.num_keypoints={self.num_keypoints} >= 1")  # fmt: skip
        if self.width % self.heads or self.vision_width % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"policy.width={self.width} and vision_width={self.vision_width} must be divisible by policy.heads="
                f"{self.heads}, and heads by policy.kv_heads={self.kv_heads}"
            )
        if not self.pretrained_backbone and self.image_size % self.patch_size:
            raise ValueError(f"policy.image_size={self.image_size} must be a multiple of patch_size={self.patch_size}")
        if self.action_vocab_size < 2 or self.max_action_tokens < 0 or self.fast_scale <= 0:
            raise ValueError("policy.action_vocab_size must be >= 2, max_action_tokens >= 0 and fast_scale > 0")
        exact = self.horizon * self.action_dim
        if self.action_tokenizer == "uniform_bins" and self.action_dim and self.max_action_tokens not in (0, exact):
            raise ValueError(
                f"policy.max_action_tokens={self.max_action_tokens}: uniform bins write exactly horizon x action_dim "
                f"tokens per chunk; leave it at 0 (set from the data)"
            )
        if not self.environment_state_weight >= 0 or self.environment_state_dim < 0:
            raise ValueError(f"policy.environment_state_weight must be >= 0 (0: off) and environment_state_dim >= 0 "
                             f"(set from the data), got {self.environment_state_weight} and {self.environment_state_dim}")  # fmt: skip
        if self.action_frame not in get_args(ActionFrame):
            raise ValueError(f"policy.action_frame must be one of {get_args(ActionFrame)}, got {self.action_frame!r}")
        if self.delta_state_indices and (self.action_frame != "delta" or (
                self.action_dim and len(self.delta_state_indices) != self.action_dim)):  # fmt: skip
            raise ValueError(f"policy.delta_state_indices={self.delta_state_indices} belongs to action_frame=delta, one "
                             f"per action dimension ({self.action_dim}): leave it empty, it is set from the data")  # fmt: skip
        if not self.temperature >= 0:
            raise ValueError(f"policy.temperature must be >= 0 (0 = greedy), got {self.temperature}")
