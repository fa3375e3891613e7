"""A LeRobot policy behind vla-rl's policy contract: LeRobot's own preprocessor, model and
postprocessor, run in that order on a vla-rl observation batch (the feature names are LeRobot's)."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from policies.lerobot.configuration_lerobot import LeRobotConfig, load_lerobot_config
from policies.observation import check_observation
from policies.pretrained import PreTrainedPolicy
from vla_core.types import ActionChunk


class LeRobotPolicy(PreTrainedPolicy):
    """Implements `vla_core.types.Policy` with a LeRobot ``PreTrainedPolicy`` and its processors."""

    config_class = LeRobotConfig

    def __init__(self, config: LeRobotConfig):
        super().__init__(config)  # no vla-rl normalization buffers: LeRobot's processors normalize
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors

        lerobot_config = load_lerobot_config(config.pretrained_path)
        self.model = get_policy_class(lerobot_config.type).from_pretrained(
            config.pretrained_path, config=lerobot_config
        )
        self.preprocessor, self.postprocessor = make_pre_post_processors(
            lerobot_config, pretrained_path=config.pretrained_path
        )
        # LeRobot's diffusion and flow policies take the sampler's start; ACT has none.
        parameters = inspect.signature(self.model.predict_action_chunk).parameters
        self._takes_noise = "noise" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, directory: Path) -> None:
        pass  # LeRobot's from_pretrained loaded them in __init__

    def save_pretrained(self, directory: str | Path) -> None:
        """Save as LeRobot does (its config, weights and processors), so LeRobot reads the copy."""
        self.model.save_pretrained(directory)
        self.preprocessor.save_pretrained(directory)
        self.postprocessor.save_pretrained(directory)

    @torch.no_grad()
    def predict_chunk(self, obs, obs_step=None, *, noise=None, inpaint=None) -> ActionChunk:
        """obs batch of size B -> ActionChunk (B, horizon, action_dim) in dataset units.

        noise is passed to LeRobot's ``predict_action_chunk`` (its diffusion and flow policies take one);
        LeRobot policies have no inpainting guidance here.
        """
        if inpaint is not None:
            raise ValueError("inpainting guidance is not available for LeRobot policies in vla-rl")
        if noise is not None and not self._takes_noise:
            raise ValueError(f"the LeRobot {self.config.lerobot_type} policy samples without an initial noise")
        check_observation(obs, self.config.state_dim, self.config.cameras, self.config.image_size)
        batch = self.preprocessor(dict(obs))
        # The saved preprocessor moves tensors to the device it was saved with; the model may be elsewhere.
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        actions = self.model.predict_action_chunk(batch, **({"noise": noise} if noise is not None else {}))
        actions = self.postprocessor(actions).to(obs["observation.state"].device)
        if actions.shape[1] < self.config.horizon:
            raise ValueError(
                f"the LeRobot {self.config.lerobot_type} policy returned {actions.shape[1]} actions per chunk, "
                f"fewer than the {self.config.horizon} its config announces"
            )
        return self._chunk(actions[:, : self.config.horizon], obs_step)

    def forward(self, batch, generator=None, copies=1) -> torch.Tensor:
        """LeRobot's own training loss of the batch (its preprocessor normalizes it first)."""
        batch = self.preprocessor(dict(batch))
        loss, _ = self.model({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()})
        return loss
