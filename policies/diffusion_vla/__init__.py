"""The vision-language diffusion/flow VLA (type ``diffusion_vla``): SigLIP encoders + a DiT action expert,
DDPM or flow matching, trained with Mini-Diffuser Level-2 minibatching."""

from policies.diffusion_vla.configuration_diffusion_vla import DiffusionVLAConfig

__all__ = ["DiffusionVLAConfig"]
