"""LeRobot policies of vla-rl's models: a LeRobot ``PreTrainedPolicy`` around the vla-rl policy.

The vla-rl model is ``self.model``; its weights keep their vla-rl names in ``model.safetensors``,
so a directory is the same whichever of the two tools wrote it.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import fields
from pathlib import Path

import torch
from lerobot.policies.pretrained import PreTrainedPolicy

from lerobot_policy_vla_rl.configuration_vla_rl import (
    VlaRlAutoregressiveVLAConfig,
    VlaRlDiffusionConfig,
    VlaRlDiffusionVLAConfig,
)
from policies import PolicyConfig, policy_class


class _VlaRlLeRobotPolicy:
    """The LeRobot policy methods, shared by the classes below (LeRobot checks each subclass of its
    ``PreTrainedPolicy`` for a ``config_class``, so this part is a mixin)."""

    vla_rl_type: str  # the vla-rl policy type this class wraps

    def __init__(self, config, **kwargs):
        super().__init__(config)
        own_config_cls = PolicyConfig.get_choice_class(self.vla_rl_type)
        own_config = own_config_cls(**{f.name: getattr(config, f.name) for f in fields(own_config_cls)})
        self.model = policy_class(self.vla_rl_type)(own_config)
        self.reset()

    @classmethod
    def _load_as_safetensor(cls, model, model_file: str, map_location: str, strict: bool):
        # Always strict, whatever LeRobot's default (False): a vla-rl policy is only usable with all its
        # weights, normalization statistics and assets (an action tokenizer), so a missing or extra key is an
        # error, not a warning. vla-rl's own loader reads them, so both tools read a directory alike.
        model.model.load_weights(Path(model_file).parent)
        model.model.to(map_location)
        return model

    def _save_pretrained(self, save_directory, state_dict=None) -> None:
        self.config._save_pretrained(save_directory)
        model = self.model
        if state_dict is not None:  # these weights, not the live model's: a copy holds them (and the assets)
            model = copy.deepcopy(self.model)
            model.load_state_dict(state_dict, strict=True)
        model.save_weights(Path(save_directory))

    def get_optim_params(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def reset(self) -> None:
        self._queue: deque[torch.Tensor] = deque()

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss = self.model(batch)
        return loss, {"loss": loss.item()}

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
        """(B, horizon, action_dim) in dataset units; ``noise`` (B, horizon, action_dim) as in vla-rl."""
        return self.model.predict_chunk(batch, noise=kwargs.get("noise")).actions

    @torch.no_grad()
    def select_action(self, batch: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
        """The next (B, action_dim) action: a new chunk every ``n_action_steps`` calls."""
        if not self._queue:
            chunk = self.predict_action_chunk(batch, **kwargs)[:, : self.config.n_action_steps]
            self._queue.extend(chunk.transpose(0, 1))
        return self._queue.popleft()


class VlaRlDiffusionPolicy(_VlaRlLeRobotPolicy, PreTrainedPolicy):
    config_class = VlaRlDiffusionConfig
    name = VlaRlDiffusionConfig.get_choice_name(VlaRlDiffusionConfig)
    vla_rl_type = "diffusion"


class VlaRlDiffusionVLAPolicy(_VlaRlLeRobotPolicy, PreTrainedPolicy):
    config_class = VlaRlDiffusionVLAConfig
    name = VlaRlDiffusionVLAConfig.get_choice_name(VlaRlDiffusionVLAConfig)
    vla_rl_type = "diffusion_vla"


class VlaRlAutoregressiveVLAPolicy(_VlaRlLeRobotPolicy, PreTrainedPolicy):
    config_class = VlaRlAutoregressiveVLAConfig
    name = VlaRlAutoregressiveVLAConfig.get_choice_name(VlaRlAutoregressiveVLAConfig)
    vla_rl_type = "autoregressive_vla"
