"""The layers of docs/ARCHITECTURE.md, checked on every import statement of the tree (module level
and inside functions), so a shortcut across packages fails here first; and the size rule of the
product packages (no function over 120 lines, nested functions counted in the one that holds them)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The layers, bottom up. package -> the project packages it may import, by prefix; itself always
# allowed. vla_rl (the commands and compositions) may import every package (see below for ROS).
RULES = {
    "vla_core": {"vla_core"},
    "policies": {"vla_core", "policies"},
    "sim": {"vla_core", "sim"},
    "robot_bridge": {"vla_core", "robot_bridge"},
    "plugins": {"vla_core", "policies", "lerobot_policy_vla_rl"},
}
PROJECT = ("vla_core", "vla_rl", "policies", "sim", "robot_bridge", "lerobot_policy_vla_rl")
PRODUCT = ("vla_core", "vla_rl", "policies", "sim", "robot_bridge")
MAX_FUNCTION_LINES = 120


def _imports(tree: ast.AST, packages: tuple[str, ...] = PROJECT) -> list[str]:
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
    return [m for m in modules if m.split(".")[0] in packages]


def _project_imports(path: Path) -> list[str]:
    return _imports(ast.parse(path.read_text()))


def _module_level_imports(path: Path) -> list[str]:
    """Imports that run when the module is imported: every statement outside a function body."""
    tree = ast.parse(path.read_text())
    outside = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = []
    for node in outside:
        if isinstance(node, ast.ClassDef):  # a class body runs at import; its methods do not
            node = ast.Module([n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))], [])
        found += _imports(node)
    return found


def _allowed(module: str, prefixes: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _long_functions(path: Path, limit: int) -> list[str]:
    """``name:line (n lines)`` of each outermost function of ``path`` longer than ``limit`` lines."""
    long = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1  # its nested functions are inside these lines
                if lines > limit:
                    long.append(f"{child.name}:{child.lineno} ({lines} lines)")
            else:
                visit(child)

    visit(ast.parse(path.read_text()))
    return long


@pytest.mark.parametrize("part", list(RULES))
def test_each_package_imports_only_the_layers_below_it(part):
    files = sorted((ROOT / part).rglob("*.py"))
    assert files, part
    for path in files:
        bad = [m for m in _project_imports(path) if not _allowed(m, RULES[part])]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_commands_load_ros_only_when_a_ros_command_runs():
    """vla_rl may compose the bridge (serve, sim-robot), but only inside functions: importing any
    command module never loads robot_bridge, so a machine without the ros extra runs the others."""
    for path in sorted((ROOT / "vla_rl").rglob("*.py")):
        bad = [m for m in _module_level_imports(path) if m.split(".")[0] == "robot_bridge"]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad} at module level"


def test_ray_is_imported_only_inside_the_functions_of_its_two_modules():
    """docs/ARCHITECTURE.md: Ray only inside the functions of vla_rl.rl.ray_runtime and vla_rl.bench_ray,
    so every other command runs without the ray extra."""
    homes = {"vla_rl/rl/ray_runtime.py", "vla_rl/bench_ray.py"}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree, name = ast.parse(path.read_text()), str(path.relative_to(ROOT))
            at_import = [
                n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            ]
            assert not _imports(ast.Module(at_import, []), ("ray",)), f"{name} imports ray at module level"
            assert name in homes or not _imports(tree, ("ray",)), f"{name} imports ray outside its two modules"


@pytest.mark.parametrize("package", PRODUCT)
def test_no_function_is_longer_than_120_lines(package):
    long = {
        str(path.relative_to(ROOT)): found
        for path in sorted((ROOT / package).rglob("*.py"))
        if (found := _long_functions(path, MAX_FUNCTION_LINES))
    }
    assert not long, f"split these into smaller functions: {long}"


def test_the_checks_catch_what_they_forbid(tmp_path):
    """The checkers themselves: a policy module importing the simulator, a module-level bridge import,
    and a long function (its nested helper counted inside it) are each flagged."""
    assert not _allowed("sim.mujoco_env", RULES["policies"]) and _allowed("policies.tokenizer", RULES["policies"])
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom sim.arm import X\nclass C:\n    import robot_bridge.topics\n"
                     "    def f(self):\n        import robot_bridge.codec\n")  # fmt: skip
    assert _project_imports(probe) == ["sim.arm", "robot_bridge.topics", "robot_bridge.codec"]
    assert _module_level_imports(probe) == ["sim.arm", "robot_bridge.topics"]
    lines = lambda indent: "\n".join(f"{indent}x{i} = {i}" for i in range(60))
    # 1 + 60 + 1 + 60 + 1 + 1 = 124 lines, 62 of them in the nested function
    probe.write_text(f"def outer():\n{lines('    ')}\n    def inner():\n{lines('        ')}\n        return 1\n"
                     "    return inner\n")  # fmt: skip
    assert _long_functions(probe, 120) == ["outer:1 (124 lines)"]
    assert _long_functions(probe, 124) == []
