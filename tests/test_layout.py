"""The dependency direction of docs/ARCHITECTURE.md, checked on every import statement of the tree
(module level and inside functions), so a shortcut across packages fails here first."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package (or module) -> the project modules it may import, by prefix; itself always allowed.
RULES = {
    "vla_rl/types.py": set(),
    "vla_rl/runtime": {"vla_rl.types", "vla_rl.runtime"},
    "policies": {"vla_rl.types", "policies"},
    "sim": {"vla_rl.types", "vla_rl.runtime", "sim"},
    # convert writes its dataset with the helpers `vla-rl record` uses (vla_rl.data, vla_rl.files).
    "robot_bridge": {
        "vla_rl.types",
        "vla_rl.runtime",
        "vla_rl.data",
        "vla_rl.files",
        "policies",
        "sim",
        "robot_bridge",
    },
}
PROJECT = ("vla_rl", "policies", "sim", "robot_bridge", "lerobot_policy_vla_rl")


def _project_imports(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
    return [m for m in modules if m.split(".")[0] in PROJECT]


def _allowed(module: str, prefixes: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("part", list(RULES))
def test_each_package_imports_only_what_the_architecture_allows(part):
    target = ROOT / part
    files = [target] if target.is_file() else sorted(target.rglob("*.py"))
    assert files, part
    for path in files:
        bad = [m for m in _project_imports(path) if not _allowed(m, RULES[part])]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_vla_rl_never_imports_the_ros_package_but_in_the_cli():
    for path in sorted((ROOT / "vla_rl").rglob("*.py")):
        if path.name != "cli.py":  # the CLI dispatches to every command
            bad = [m for m in _project_imports(path) if m.split(".")[0] == "robot_bridge"]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_rule_catches_a_crossing(tmp_path):
    """The checker itself: a policy module importing the simulator is flagged."""
    assert not _allowed("sim.mujoco_env", RULES["policies"]) and _allowed("policies.tokenizer", RULES["policies"])
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom sim.arm import STATE_NAMES\ndef f():\n    import robot_bridge.codec\n")
    assert _project_imports(probe) == ["sim.arm", "robot_bridge.codec"]
