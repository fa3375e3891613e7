"""Action runtime: how action chunks become per-step actions."""

from vla_rl.runtime.executor import ActionChunkExecutor, MergeMode, rtc_blend_weights, rtc_weights

__all__ = ["ActionChunkExecutor", "MergeMode", "rtc_blend_weights", "rtc_weights"]
