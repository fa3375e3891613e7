"""Configuration of the small diffusion policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.config import PolicyConfig


@PolicyConfig.register_subclass("diffusion")
@dataclass
class DiffusionConfig(PolicyConfig):
    """Diffusion policy: denoises an action chunk of `horizon` steps given image, state and instruction."""

    horizon: int = 16  # action steps predicted per chunk (H)
    n_action_steps: int = 8  # steps of each chunk executed before replanning
    image_size: int = 64  # expected square camera image side, pixels
    crop_shift: int = 4  # training augmentation: random image shift of up to this many pixels
    vision_channels: int = 32  # width of the convolutional image encoder
    num_keypoints: int = 32  # spatial-softmax keypoints per camera
    text_dim: int = 32  # instruction embedding size
    hidden_dim: int = 256  # width of the denoiser
    num_blocks: int = 4  # residual FiLM blocks in the denoiser
    num_train_timesteps: int = 100  # DDPM noise levels during training
    num_inference_steps: int = 10  # DDIM steps at inference
    beta_schedule: str = "squaredcos_cap_v2"  # diffusers beta schedule
    # Filled from the dataset when training starts; stored in every checkpoint.
    state_dim: int = 0  # observation.state size (set from the dataset)
    action_dim: int = 0  # action size (set from the dataset)
    cameras: list[str] = field(default_factory=list)  # camera names (set from the dataset)
    vocabulary: list[str] = field(default_factory=list)  # instruction words known to the text encoder
