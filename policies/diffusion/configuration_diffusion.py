"""Configuration of the small diffusion policy."""

from __future__ import annotations

from dataclasses import dataclass

from policies.pretrained import DenoisingPolicyConfig, PolicyConfig


@PolicyConfig.register_subclass("diffusion")
@dataclass
class DiffusionConfig(DenoisingPolicyConfig):
    """Diffusion policy: denoises an action chunk of `horizon` steps given image, state and instruction.

    ``objective`` (DenoisingPolicyConfig) stays ``ddpm`` by default, as before the field existed (a
    checkpoint without it loads as ddpm); ``--policy.objective=flow`` trains it by flow matching, which
    gives a CPU-trainable policy with RTC inpainting and the steering hooks (`policies.flow_matching`).
    """

    vision_channels: int = 32  # width of the convolutional image encoder
    num_keypoints: int = 32  # spatial-softmax keypoints per camera
    text_dim: int = 32  # instruction embedding size
    hidden_dim: int = 256  # width of the denoiser
    num_blocks: int = 4  # residual FiLM blocks in the denoiser

    def check_image_size(self, height: int, width: int) -> None:
        # The keypoint encoder is built for one image size; it does not resize.
        if (height, width) != (self.image_size, self.image_size):
            raise ValueError(
                f"dataset images are {height}x{width} but policy.image_size={self.image_size}; "
                f"set --policy.image_size={height}" + ("" if height == width else " (and make them square)")
            )
