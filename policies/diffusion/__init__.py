"""Diffusion policies over action chunks.

- ``DiffusionPolicy`` (type ``diffusion``): a small CNN + MLP policy sized for CPU training.
- ``DiffusionVLAPolicy`` (type ``diffusion_vla``): SigLIP vision/text encoders + a DiT action
  expert, DDPM or flow matching, trained with Mini-Diffuser Level-2 minibatching.
"""

from policies.diffusion.configuration import DiffusionConfig
from policies.diffusion.configuration_vla import DiffusionVLAConfig
from policies.diffusion.modeling import DiffusionPolicy
from policies.diffusion.modeling_vla import DiffusionVLAPolicy

__all__ = ["DiffusionConfig", "DiffusionPolicy", "DiffusionVLAConfig", "DiffusionVLAPolicy"]
