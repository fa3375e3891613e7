"""The latency model and action runtime: how long inference takes (``delay``), when chunks are requested
and what a request is told (``schedule``), and how chunks become per-step actions (``executor``), with the
one config of how (``ChunkingConfig``). Simulation, evaluation, training and the robot all use these."""

from vla_core.runtime.config import ChunkingConfig
from vla_core.runtime.delay import (
    DelayConfig,
    DelayModel,
    LatencyLog,
    augmentation,
    committed_prefix,
    latencies_to_steps,
    load_latencies,
    mid_inference_steps,
    mid_observation,
)
from vla_core.runtime.executor import ActionChunkExecutor, MergeMode, rtc_blend_weights, rtc_weights
from vla_core.runtime.schedule import ChunkRequest, ChunkSchedule

__all__ = [
    "ActionChunkExecutor",
    "ChunkRequest",
    "ChunkSchedule",
    "ChunkingConfig",
    "DelayConfig",
    "DelayModel",
    "LatencyLog",
    "MergeMode",
    "augmentation",
    "committed_prefix",
    "latencies_to_steps",
    "load_latencies",
    "mid_inference_steps",
    "mid_observation",
    "rtc_blend_weights",
    "rtc_weights",
]
