"""Action runtime: how action chunks become per-step actions, and the one config of how (``ChunkingConfig``)."""

from vla_rl.runtime.config import ChunkingConfig
from vla_rl.runtime.executor import ActionChunkExecutor, MergeMode, rtc_blend_weights, rtc_weights

__all__ = ["ActionChunkExecutor", "ChunkingConfig", "MergeMode", "rtc_blend_weights", "rtc_weights"]
