"""Action runtime: how action chunks become per-step actions."""

from vla_rl.runtime.executor import ActionChunkExecutor, MergeMode

__all__ = ["ActionChunkExecutor", "MergeMode"]
