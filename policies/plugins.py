"""Third-party policy types: the entry points of group ``vla_rl.policies`` (see `vla_core.registry`).

Each entry point's value is a module, typically ``<package>.configuration_<type>``, that defines a
`policies.PolicyConfig` subclass and registers it (``@PolicyConfig.register_subclass("<type>")``);
its policy class is ``<Name>Policy`` in the sibling ``modeling_<type>`` module, which
`policies.policy_class` imports only when a policy of that type is built, as for the built-in types.
"""

from __future__ import annotations

from vla_core import registry


def load_policy_plugins() -> list[str]:
    """Import every ``vla_rl.policies`` plugin module (each registers its config); their entry point names.

    Importing `policies` calls it once; call it again after installing a plugin into a running
    process. A plugin that fails to import raises `vla_core.registry.PluginError` naming its distribution.
    """
    found = registry.plugins(registry.POLICIES)
    for entry_point in found:
        registry.load(entry_point)
    return [entry_point.name for entry_point in found]
