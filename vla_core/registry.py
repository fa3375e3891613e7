"""Registries third parties extend through Python entry points, as LeRobot's third-party plugins do.

An installed distribution adds to vla-rl by declaring entry points in its ``pyproject.toml``:

- group ``vla_rl.policies``: the value is a module that defines a `policies.PolicyConfig` subclass
  and registers it (``@PolicyConfig.register_subclass("<type>")``), with its ``modeling_<type>``
  module beside it; `policies` imports each one when it is imported (``--policy.type=<type>``).
- group ``vla_rl.envs``: the name is the task-name prefix the env family claims, the value a
  ``"module:callable"`` that takes a `sim.config.EnvConfig` and returns a `vla_core.types.BatchedEnv`;
  `sim.factory.make_env` loads it when it builds a task of that family.

This module only lists and loads the entry points; each registry decides what they mean.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

POLICIES = "vla_rl.policies"
ENVS = "vla_rl.envs"


class PluginError(ImportError):
    """A plugin that could not be loaded; the message is one line naming the distribution that declares it."""


def distribution(entry_point: EntryPoint) -> str:
    """The name of the distribution that declares ``entry_point``."""
    dist = entry_point.dist
    return dist.name if dist is not None and dist.name else "an unknown distribution"


def plugins(group: str) -> list[EntryPoint]:
    """The entry points of ``group`` of every installed distribution, by name then distribution.

    Reads installed metadata only: no plugin module is imported.
    """
    return sorted(entry_points(group=group), key=lambda ep: (ep.name, distribution(ep)))


def load(entry_point: EntryPoint) -> Any:
    """What ``entry_point`` names (a module, or the object after its ``:``), imported.

    Raises PluginError, one line naming the plugin, its distribution and the original error, when
    the import fails (the original error is its ``__cause__``).
    """
    try:
        return entry_point.load()
    except Exception as err:
        lines = str(err).strip().splitlines()
        reason = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
        dist = distribution(entry_point)
        raise PluginError(
            f"the {entry_point.group} plugin {entry_point.name!r} of the distribution {dist!r} failed to load "
            f"({entry_point.value}): {reason}; fix or uninstall {dist}"
        ) from err
