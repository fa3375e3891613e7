"""The small diffusion policy (type ``diffusion``): a CNN + MLP denoiser sized for CPU training."""

from policies.diffusion.configuration_diffusion import DiffusionConfig

__all__ = ["DiffusionConfig"]
