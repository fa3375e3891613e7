"""Build the batched env of a config's physics backend (``EnvConfig.backend``)."""

from __future__ import annotations

from sim.config import EnvConfig

BACKENDS = ("cpu", "warp")


def make_env(config: EnvConfig):
    """A `vla_rl.types.BatchedEnv` for ``config``: MujocoBatchedEnv (cpu) or WarpBatchedEnv (warp).

    The backends import lazily, so choosing cpu never loads Warp; choosing warp without the
    ``gpu`` extra fails with an ImportError that says how to install it.
    """
    if config.backend == "cpu":
        if config.device != "cpu":
            raise ValueError(f"the cpu backend runs on device 'cpu', got {config.device!r}; use backend='warp'")
        from sim.mujoco_env import MujocoBatchedEnv

        return MujocoBatchedEnv(config)
    if config.backend == "warp":
        from sim.warp_env import WarpBatchedEnv

        return WarpBatchedEnv(config)
    raise ValueError(f"unknown env backend {config.backend!r}; valid backends: {', '.join(BACKENDS)}")
