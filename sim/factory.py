"""Build the batched env of a config: its task family (by the task name) and physics backend."""

from __future__ import annotations

from typing import get_args

from sim.config import Backend, EnvConfig

BACKENDS = get_args(Backend)
LIBERO_PREFIX = "libero_"  # libero_spatial, libero_object, libero_goal, libero_10, libero_90 (see sim.libero_env)
ROBOSUITE_PREFIX = "robosuite/"  # robosuite/Lift, robosuite/Stack, robosuite/PickPlaceCan (see sim.robosuite_env)


def make_env(config: EnvConfig):
    """A `vla_core.types.BatchedEnv` for ``config``.

    - ``libero_*`` tasks: LiberoBatchedEnv; ``robosuite/*`` tasks: RobosuiteBatchedEnv. Both run
      one subprocess worker per world on the cpu backend and need the ``libero`` extra.
    - The MuJoCo tabletop tasks: MujocoBatchedEnv (cpu) or WarpBatchedEnv (warp).

    Everything imports lazily, so choosing cpu never loads Warp or LIBERO; a missing extra fails
    with an ImportError that says how to install it.
    """
    if config.backend not in BACKENDS:
        raise ValueError(f"unknown env backend {config.backend!r}; valid backends: {', '.join(BACKENDS)}")
    if config.backend == "cpu" and config.device != "cpu":
        raise ValueError(f"the cpu backend runs on device 'cpu', got {config.device!r}; use backend='warp'")
    subprocess_family = config.task.startswith(LIBERO_PREFIX) or config.task.startswith(ROBOSUITE_PREFIX)
    if subprocess_family and config.backend != "cpu":
        raise ValueError(
            f"{config.task!r} runs on the cpu backend (robosuite/LIBERO worker processes); set backend='cpu'"
        )
    if config.task.startswith(LIBERO_PREFIX):
        from sim.libero_env import LiberoBatchedEnv

        return LiberoBatchedEnv(config)
    if config.task.startswith(ROBOSUITE_PREFIX):
        from sim.robosuite_env import RobosuiteBatchedEnv

        return RobosuiteBatchedEnv(config)
    if config.backend == "cpu":
        from sim.mujoco_env import MujocoBatchedEnv

        return MujocoBatchedEnv(config)
    from sim.warp_env import WarpBatchedEnv

    return WarpBatchedEnv(config)
