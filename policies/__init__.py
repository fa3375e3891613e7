"""Policy models (torch only; no simulator or ROS imports), one folder per type in LeRobot's layout.

Importing ``policies`` registers every config (``--policy.type=...``): the built-in types below,
then the types of installed plugins (entry points of group ``vla_rl.policies``, `policies.plugins`).
It loads no model code; ``policy_class(type)`` imports the model of a type when it is needed.
"""

from policies.autoregressive_vla import AutoregressiveVLAConfig
from policies.diffusion import DiffusionConfig
from policies.diffusion_vla import DiffusionVLAConfig
from policies.lerobot import LeRobotConfig
from policies.plugins import load_policy_plugins
from policies.pretrained import PolicyConfig, PreTrainedPolicy, policy_class

load_policy_plugins()  # after the built-ins, so a plugin that reuses a built-in type name is refused

__all__ = [
    "AutoregressiveVLAConfig",
    "DiffusionConfig",
    "DiffusionVLAConfig",
    "LeRobotConfig",
    "PolicyConfig",
    "PreTrainedPolicy",
    "load_policy_plugins",
    "policy_class",
]
