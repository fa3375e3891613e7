"""Policy models (torch only; no simulator or ROS imports).

``POLICY_TYPES`` maps a checkpoint's ``policy_type`` to its (config class, model class).
"""

from policies.diffusion import DiffusionConfig, DiffusionPolicy

POLICY_TYPES = {"diffusion": (DiffusionConfig, DiffusionPolicy)}
