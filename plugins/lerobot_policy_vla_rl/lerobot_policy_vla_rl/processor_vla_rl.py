"""LeRobot processors of vla-rl's policies (found by LeRobot's naming convention): batch and move to
the device; no normalization, which the vla-rl model does itself (``policies.pretrained.lerobot_processors``,
the same pipelines every vla-rl checkpoint is saved with)."""

from __future__ import annotations

from policies.pretrained import lerobot_processors


def make_vla_rl_diffusion_pre_post_processors(config, dataset_stats=None):
    del dataset_stats  # the statistics are inside the model's weights
    return lerobot_processors(config.device)


make_vla_rl_diffusion_vla_pre_post_processors = make_vla_rl_diffusion_pre_post_processors
make_vla_rl_autoregressive_vla_pre_post_processors = make_vla_rl_diffusion_pre_post_processors
