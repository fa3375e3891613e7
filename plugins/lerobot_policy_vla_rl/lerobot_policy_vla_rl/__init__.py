"""vla-rl's policies as LeRobot policies (a LeRobot third-party plugin).

Importing this package registers ``vla_rl_diffusion``, ``vla_rl_diffusion_vla`` and ``vla_rl_autoregressive_vla`` with LeRobot's
``PreTrainedConfig``, so LeRobot's ``PreTrainedConfig.from_pretrained``, ``get_policy_class``,
``PreTrainedPolicy.from_pretrained`` and ``make_policy`` load a directory vla-rl wrote (a
checkpoint's ``pretrained_model/``). The files are shared as they are: the model's weights keep
vla-rl's names, and the normalization lives inside the model, so LeRobot's processors only batch
and move tensors.
"""

from lerobot_policy_vla_rl.configuration_vla_rl import (
    VlaRlAutoregressiveVLAConfig,
    VlaRlDiffusionConfig,
    VlaRlDiffusionVLAConfig,
)

__all__ = ["VlaRlAutoregressiveVLAConfig", "VlaRlDiffusionConfig", "VlaRlDiffusionVLAConfig"]
