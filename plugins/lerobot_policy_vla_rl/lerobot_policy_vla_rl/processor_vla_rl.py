"""LeRobot processors of vla-rl's policies: batch and move to the device; no normalization, which
the vla-rl model does itself with the statistics it was trained with."""

from __future__ import annotations

from typing import Any

import torch
from lerobot.processor import (
    AddBatchDimensionProcessorStep,
    DeviceProcessorStep,
    PolicyAction,
    PolicyProcessorPipeline,
    RenameObservationsProcessorStep,
)
from lerobot.processor.factory import make_policy_processor_pipelines


def _pipelines(config, dataset_stats: dict[str, dict[str, torch.Tensor]] | None = None) -> tuple[
    PolicyProcessorPipeline[dict[str, Any], dict[str, Any]], PolicyProcessorPipeline[PolicyAction, PolicyAction]
]:  # fmt: skip
    del dataset_stats  # the statistics are inside the model's weights
    return make_policy_processor_pipelines(
        input_steps=[
            RenameObservationsProcessorStep(rename_map={}),
            AddBatchDimensionProcessorStep(),
            DeviceProcessorStep(device=config.device),
        ],
        output_steps=[DeviceProcessorStep(device="cpu")],
    )


make_vla_rl_diffusion_pre_post_processors = _pipelines
make_vla_rl_diffusion_vla_pre_post_processors = _pipelines
