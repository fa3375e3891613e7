"""The latency model: how long inference takes (``delay``), the protocol between a request and its chunk's
actions (``protocol``: when requests go out, what they are told, which merges and delays a policy fits),
how chunks become per-step actions (``executor``), the one config of chunking (``ChunkingConfig``), the
noise of one request (``noise``), and the simulation's shell around the protocol (``delayed_env``; the
robot's is `robot_bridge.chunk_scheduler`).
Simulation, evaluation, fine-tuning, training and the robot all use these."""

from vla_core.runtime.config import ChunkingConfig
from vla_core.runtime.delay import (
    DelayConfig,
    DelayModel,
    LatencyLog,
    LatencyTrace,
    augmentation,
    committed_prefix,
    latencies_to_steps,
    load_latencies,
    mid_inference_steps,
    mid_observation,
)
from vla_core.runtime.executor import ActionChunkExecutor, MergeMode, rtc_blend_weights, rtc_weights
from vla_core.runtime.noise import noise_shape, request_noise
from vla_core.runtime.protocol import (
    DEFAULT_MID_FRACTION,
    MERGES,
    LatencyProtocol,
    LatencySpec,
    check_merge,
    check_mid_fraction,
)

__all__ = [
    "DEFAULT_MID_FRACTION",
    "MERGES",
    "ActionChunkExecutor",
    "ChunkingConfig",
    "DelayConfig",
    "DelayModel",
    "LatencyLog",
    "LatencyProtocol",
    "LatencySpec",
    "LatencyTrace",
    "MergeMode",
    "augmentation",
    "check_merge",
    "check_mid_fraction",
    "committed_prefix",
    "latencies_to_steps",
    "load_latencies",
    "mid_inference_steps",
    "mid_observation",
    "noise_shape",
    "request_noise",
    "rtc_blend_weights",
    "rtc_weights",
]
