"""Build the batched env of a config: its env family (by the task name) and physics backend.

A family is the tasks whose names start with one prefix, and the builder of each backend they run
on. The built-in families are :data:`BUILTIN_FAMILIES`; installed distributions add more through
entry points of group ``vla_rl.envs`` (`vla_core.registry`): the entry point's name is the prefix
its family claims, its value a ``"module:callable"`` taking the `EnvConfig` (whatever its backend)
and returning a `vla_core.types.BatchedEnv`. No two families may claim overlapping prefixes.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import get_args

from sim.config import Backend, EnvConfig
from vla_core import registry

BACKENDS = get_args(Backend)
LIBERO_PREFIX = "libero_"  # libero_spatial, libero_object, libero_goal, libero_10, libero_90 (see sim.libero_env)
ROBOSUITE_PREFIX = "robosuite/"  # robosuite/Lift, robosuite/Stack, robosuite/PickPlaceCan (see sim.robosuite_env)
RLBENCH_PREFIX = "rlbench/"  # rlbench/close_jar, any module of rlbench.tasks (see sim.rlbench_env)
BUILTIN = "vla-rl"  # the origin of the built-in families


@dataclass(frozen=True)
class EnvFamily:
    """The tasks whose names start with ``prefix``, and how to build their batched env on each backend."""

    # Task names starting with it belong to the family; "" = every task no other family claims
    # (the MuJoCo tabletop tasks, which report an unknown name themselves).
    prefix: str
    # backend -> "module:callable", called with the EnvConfig, returning a BatchedEnv. Imported only
    # when a task of the family is built, so choosing one family never loads another's simulator.
    builders: dict[str, str]
    why_these_backends: str = ""  # why the family runs on its backends only, for the error naming them
    origin: str = BUILTIN  # who registered it: vla-rl, or the distribution of the plugin
    entry_point: EntryPoint | None = None  # the plugin's entry point; None for a built-in family

    def builder(self, backend: str):
        """The callable that builds this family's env on ``backend`` (which it must support), imported."""
        if self.entry_point is not None:  # a plugin: its failure to import names the distribution
            return registry.load(self.entry_point)
        module, _, name = self.builders[backend].partition(":")
        return getattr(importlib.import_module(module), name)  # a missing extra's ImportError says how to install it


WORKER_PROCESSES = "robosuite/LIBERO worker processes"
BUILTIN_FAMILIES = (
    EnvFamily(LIBERO_PREFIX, {"cpu": "sim.libero_env:LiberoBatchedEnv"}, WORKER_PROCESSES),
    EnvFamily(ROBOSUITE_PREFIX, {"cpu": "sim.robosuite_env:RobosuiteBatchedEnv"}, WORKER_PROCESSES),
    # CoppeliaSim runs one instance per process: one RLBench world per worker process, on the CPU's physics.
    EnvFamily(
        RLBENCH_PREFIX, {"cpu": "sim.rlbench_env:RLBenchBatchedEnv"}, "RLBench worker processes, one CoppeliaSim each"
    ),
    # The MuJoCo tabletop tasks (`sim.tasks.TASKS`): mujoco.rollout threads, or MuJoCo Warp on `device`.
    EnvFamily("", {"cpu": "sim.mujoco_env:MujocoBatchedEnv", "warp": "sim.warp_env:WarpBatchedEnv"}),
)


@functools.cache
def env_families() -> tuple[EnvFamily, ...]:
    """The built-in families, then those of the installed ``vla_rl.envs`` plugins (cached: call
    ``env_families.cache_clear()`` after installing one into a running process).

    Reads the plugins' metadata only. Raises ValueError when two families claim overlapping prefixes.
    """
    families = list(BUILTIN_FAMILIES)
    for entry_point in registry.plugins(registry.ENVS):
        origin = registry.distribution(entry_point)
        if not entry_point.name:
            raise ValueError(
                f"the {registry.ENVS} plugin {entry_point.value!r} of the distribution {origin!r} claims no task "
                f"prefix; name its entry point after the prefix of its task names (e.g. 'my_suite/')"
            )
        builders = dict.fromkeys(BACKENDS, entry_point.value)  # the plugin's callable decides per backend
        families.append(EnvFamily(entry_point.name, builders, origin=origin, entry_point=entry_point))
    claimed = [f for f in families if f.prefix]
    for i, one in enumerate(claimed):
        for other in claimed[i + 1 :]:
            if one.prefix.startswith(other.prefix) or other.prefix.startswith(one.prefix):
                longer = max(one.prefix, other.prefix, key=len)
                raise ValueError(
                    f"env families overlap: {one.prefix!r} (from {one.origin}) and {other.prefix!r} (from "
                    f"{other.origin}) both claim the tasks starting with {longer!r}; uninstall one of the "
                    f"{registry.ENVS} plugins or give it a prefix of its own"
                )
    return tuple(families)


def env_family(task: str) -> EnvFamily:
    """The family of ``task``: the one whose prefix it starts with, else the tabletop tasks'."""
    for family in env_families():
        if family.prefix and task.startswith(family.prefix):
            return family
    return next(f for f in env_families() if not f.prefix)


def make_env(config: EnvConfig):
    """A `vla_core.types.BatchedEnv` for ``config``.

    - ``libero_*`` tasks: LiberoBatchedEnv; ``robosuite/*`` tasks: RobosuiteBatchedEnv. Both run
      one subprocess worker per world on the cpu backend and need the ``libero`` extra.
    - ``rlbench/*`` tasks: RLBenchBatchedEnv, one worker process (one CoppeliaSim) per world on the
      cpu backend; needs CoppeliaSim, PyRep and RLBench, which no package registry provides.
    - A task of a plugin's family (``vla_rl.envs`` entry points): what the plugin builds.
    - The MuJoCo tabletop tasks: MujocoBatchedEnv (cpu) or WarpBatchedEnv (warp).

    Everything imports lazily, so choosing cpu never loads Warp or LIBERO; a missing extra fails
    with an ImportError that says how to install it, a plugin that fails to import with a
    `vla_core.registry.PluginError` naming its distribution.
    """
    if config.backend not in BACKENDS:
        raise ValueError(f"unknown env backend {config.backend!r}; valid backends: {', '.join(BACKENDS)}")
    if config.backend == "cpu" and config.device != "cpu":
        raise ValueError(f"the cpu backend runs on device 'cpu', got {config.device!r}; use backend='warp'")
    family = env_family(config.task)
    if config.settle_steps > 0 and family.prefix != LIBERO_PREFIX:
        raise ValueError(
            f"--env.settle_steps={config.settle_steps}: only LIBERO tasks settle after a reset; {config.task!r} "
            "starts settled (drop the flag)"
        )
    _check_family_fields(config, family)
    if config.variation and (family.prefix or config.backend != "cpu"):
        raise ValueError(f"--env.variation={config.variation} varies the MuJoCo suite's tasks on the cpu backend, not "
                         f"{config.task!r} on {config.backend!r}; pass --env.backend=cpu with a suite task, or drop "
                         f"the flag")  # fmt: skip
    if config.backend not in family.builders:
        backends = " or ".join(family.builders)
        raise ValueError(
            f"{config.task!r} runs on the {backends} backend ({family.why_these_backends}); "
            f"set backend={next(iter(family.builders))!r}"
        )
    return family.builder(config.backend)(config)


def _check_family_fields(config: EnvConfig, family: EnvFamily) -> None:
    """Refuse the fields of one family set for a task of another (they would be ignored silently)."""
    if family.prefix == RLBENCH_PREFIX:
        return
    default = EnvConfig()
    for name in ("rlbench_action_mode", "rlbench_variation", "rlbench_demo_root"):
        if getattr(config, name) != getattr(default, name):
            raise ValueError(f"--env.{name} applies to rlbench/ tasks only, not {config.task!r}; drop the flag")
