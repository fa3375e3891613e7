"""Third-party plugins through entry points (`vla_core.registry`): a policy type and an env family
from a distribution installed into a temporary directory (its package and a ``*.dist-info`` with
METADATA and entry_points.txt, as pip leaves them), and the one-line errors of broken plugins."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from policies import PolicyConfig, load_policy_plugins, policy_class
from sim import factory
from sim.config import EnvConfig
from sim.factory import make_env
from vla_core.registry import PluginError

ROOT = Path(__file__).resolve().parents[1]

POLICY_FILES = {
    "tiny_plugin_policy/__init__.py": "",
    "tiny_plugin_policy/configuration_tiny.py": """
        from dataclasses import dataclass

        from policies import PolicyConfig


        @PolicyConfig.register_subclass("tiny_plugin")
        @dataclass
        class TinyPluginConfig(PolicyConfig):
            width: int = 7  # hidden units of the plugin's model
        """,
    "tiny_plugin_policy/modeling_tiny.py": """
        from policies import PreTrainedPolicy
        from tiny_plugin_policy.configuration_tiny import TinyPluginConfig


        class TinyPluginPolicy(PreTrainedPolicy):
            config_class = TinyPluginConfig
        """,
}
POLICY_ENTRY_POINTS = "[vla_rl.policies]\ntiny_plugin = tiny_plugin_policy.configuration_tiny\n"
ENV_FILES = {
    "tiny_plugin_env/__init__.py": """
        class TinyEnv:
            def __init__(self, config):
                self.config = config


        def make(config):
            return TinyEnv(config)
        """,
}
PLUGIN_PACKAGES = ("tiny_plugin_policy", "tiny_plugin_env", "broken_plugin")


def install(site: Path, dist: str, files: dict[str, str], entry_points: str) -> None:
    """Write distribution ``dist`` into ``site`` as an installer does: its files, then its metadata."""
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(textwrap.dedent(text))
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path to install plugins into; the registries are left as they were."""
    monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates the import caches
    monkeypatch.setattr(PolicyConfig, "_choice_registry", dict(PolicyConfig._choice_registry))
    factory.env_families.cache_clear()
    yield tmp_path
    factory.env_families.cache_clear()
    for name in [m for m in sys.modules if m.split(".")[0] in PLUGIN_PACKAGES]:
        del sys.modules[name]


def test_a_plugin_policy_type_is_a_choice_and_finds_its_model(site):
    from vla_rl.cli import parse_config

    install(site, "tiny-plugin-policy", POLICY_FILES, POLICY_ENTRY_POINTS)
    assert "tiny_plugin" not in PolicyConfig.get_known_choices()
    assert "tiny_plugin" in load_policy_plugins()
    assert "tiny_plugin" in PolicyConfig.get_known_choices()
    assert "tiny_plugin_policy.modeling_tiny" not in sys.modules  # no model code until a policy is built
    cfg = parse_config("train", ["--policy.type=tiny_plugin", "--policy.width=3", "--policy.horizon=8"])
    assert type(cfg.policy).__name__ == "TinyPluginConfig" and cfg.policy.type == "tiny_plugin"
    assert (cfg.policy.width, cfg.policy.horizon) == (3, 8)
    cls = policy_class("tiny_plugin")
    assert (cls.__module__, cls.__name__) == ("tiny_plugin_policy.modeling_tiny", "TinyPluginPolicy")


def test_importing_policies_registers_the_installed_plugins(site):
    """In a fresh process, as a command starts: `import policies` alone brings the plugin's type."""
    install(site, "tiny-plugin-policy", POLICY_FILES, POLICY_ENTRY_POINTS)
    code = (
        "import sys, policies; print(sorted(policies.PolicyConfig.get_known_choices())); "
        "print('tiny_plugin_policy.modeling_tiny' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    known, modeling_loaded = out.stdout.strip().splitlines()
    assert known == str(sorted(["autoregressive_vla", "diffusion", "diffusion_vla", "lerobot", "tiny_plugin"]))
    assert modeling_loaded == "False"


def test_make_env_builds_a_plugin_family_by_its_task_prefix(site):
    install(site, "tiny-plugin-env", ENV_FILES, "[vla_rl.envs]\ntiny/ = tiny_plugin_env:make\n")
    families = factory.env_families()
    assert [(f.prefix, f.origin) for f in families if f.prefix == "tiny/"] == [("tiny/", "tiny-plugin-env")]
    assert "tiny_plugin_env" not in sys.modules  # listed from its metadata, imported when used
    env = make_env(EnvConfig(task="tiny/cube", num_envs=2, backend="warp"))
    assert type(env).__name__ == "TinyEnv" and (env.config.task, env.config.backend) == ("tiny/cube", "warp")
    # A name outside the prefix is still the built-in tabletop family's, which refuses it.
    with pytest.raises(ValueError, match="unknown task 'tiny'; valid tasks: "):
        make_env(EnvConfig(task="tiny"))


def test_overlapping_env_families_are_refused(site):
    install(site, "tiny-plugin-env", ENV_FILES, "[vla_rl.envs]\nlibero_pro = tiny_plugin_env:make\n")
    with pytest.raises(ValueError, match=r"'libero_' \(from vla-rl\) and 'libero_pro' \(from tiny-plugin-env\)"):
        make_env(EnvConfig(task="libero_pro/0"))


BROKEN = {"broken_plugin/__init__.py": "import a_dependency_nobody_installed\n"}


@pytest.mark.parametrize("group, name", [("vla_rl.policies", "broken"), ("vla_rl.envs", "broken/")])
def test_a_broken_plugin_fails_with_one_line_naming_it(site, group, name):
    value = "broken_plugin" if group == "vla_rl.policies" else "broken_plugin:make"
    install(site, "broken-plugin", BROKEN, f"[{group}]\n{name} = {value}\n")
    with pytest.raises(PluginError) as err:
        if group == "vla_rl.policies":
            load_policy_plugins()
        else:
            make_env(EnvConfig(task="broken/x"))
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, ImportError)
    assert f"the {group} plugin {name!r} of the distribution 'broken-plugin' failed to load ({value})" in message
    assert "ModuleNotFoundError: No module named 'a_dependency_nobody_installed'" in message
    assert message.endswith("fix or uninstall broken-plugin")
