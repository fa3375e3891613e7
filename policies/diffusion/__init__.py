"""Small image + state + instruction conditioned diffusion policy over action chunks."""

from policies.diffusion.configuration import DiffusionConfig
from policies.diffusion.modeling import DiffusionPolicy

__all__ = ["DiffusionConfig", "DiffusionPolicy"]
