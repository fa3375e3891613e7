"""LeRobot configs of vla-rl's policies: each is vla-rl's own config with LeRobot's base fields added.

A class inherits from both LeRobot's ``PreTrainedConfig`` and the vla-rl config, so the fields are
defined once (in ``policies``), a vla-rl ``config.json`` parses in LeRobot unchanged, and LeRobot
finds the policy class in the sibling ``modeling_vla_rl`` by its naming convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lerobot.configs.policies import PreTrainedConfig
from lerobot.configs.types import FeatureType, NormalizationMode
from lerobot.optim.optimizers import AdamWConfig

from policies.autoregressive_vla import AutoregressiveVLAConfig
from policies.diffusion import DiffusionConfig
from policies.diffusion_vla import DiffusionVLAConfig
from policies.pretrained import lerobot_type


class _VlaRlLeRobotConfig:
    """What LeRobot asks of a config, answered for a vla-rl policy."""

    # vla-rl policies normalize inside the model (their statistics are buffers), so LeRobot's
    # normalizer steps must pass everything through.
    normalization_mapping: ClassVar[dict[str, NormalizationMode]] = {
        "VISUAL": NormalizationMode.IDENTITY, "STATE": NormalizationMode.IDENTITY,
        "ACTION": NormalizationMode.IDENTITY,
    }  # fmt: skip

    @property
    def observation_delta_indices(self) -> None:
        return None  # one observation frame

    @property
    def action_delta_indices(self) -> list[int]:
        return list(range(self.horizon))  # a chunk of `horizon` actions from the current frame

    @property
    def reward_delta_indices(self) -> None:
        return None

    def get_optimizer_preset(self) -> AdamWConfig:
        return AdamWConfig(lr=1e-3, weight_decay=1e-6)  # vla-rl train's defaults

    def get_scheduler_preset(self) -> None:
        return None

    def validate_features(self) -> None:
        images = [k for k, f in self.input_features.items() if f.type is FeatureType.VISUAL]
        if self.input_features and not images:
            raise ValueError("a vla-rl policy needs at least one camera among its input features")


@PreTrainedConfig.register_subclass(lerobot_type("diffusion"))
@dataclass
class VlaRlDiffusionConfig(_VlaRlLeRobotConfig, PreTrainedConfig, DiffusionConfig):
    """vla-rl's ``diffusion`` policy config, as LeRobot reads it."""


@PreTrainedConfig.register_subclass(lerobot_type("diffusion_vla"))
@dataclass
class VlaRlDiffusionVLAConfig(_VlaRlLeRobotConfig, PreTrainedConfig, DiffusionVLAConfig):
    """vla-rl's ``diffusion_vla`` policy config, as LeRobot reads it."""


@PreTrainedConfig.register_subclass(lerobot_type("autoregressive_vla"))
@dataclass
class VlaRlAutoregressiveVLAConfig(_VlaRlLeRobotConfig, PreTrainedConfig, AutoregressiveVLAConfig):
    """vla-rl's ``autoregressive_vla`` policy config, as LeRobot reads it."""
