"""Policy models (torch only; no simulator or ROS imports), one folder per type in LeRobot's layout.

Importing ``policies`` registers every config (``--policy.type=...``) but loads no model code;
``policy_class(type)`` imports the model of a type when it is needed.
"""

from policies.diffusion import DiffusionConfig
from policies.diffusion_vla import DiffusionVLAConfig
from policies.lerobot import LeRobotConfig
from policies.pretrained import PolicyConfig, PreTrainedPolicy, policy_class

__all__ = ["DiffusionConfig", "DiffusionVLAConfig", "LeRobotConfig", "PolicyConfig", "PreTrainedPolicy", "policy_class"]
