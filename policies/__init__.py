"""Policy models (torch only; no simulator or ROS imports).

``POLICY_TYPES`` maps a checkpoint's ``policy_type`` to its (config class, model class).
"""

from policies.diffusion import DiffusionConfig, DiffusionPolicy, DiffusionVLAConfig, DiffusionVLAPolicy

POLICY_TYPES = {
    "diffusion": (DiffusionConfig, DiffusionPolicy),
    "diffusion_vla": (DiffusionVLAConfig, DiffusionVLAPolicy),
}
