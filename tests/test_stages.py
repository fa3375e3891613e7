"""The stages API (`vla_rl.stages`) and the rule that compositions go through it.

The rule, checked on every import statement (module level and inside functions) of each composition:
``vla-rl quickstart`` (vla_rl/quickstart.py), the benchmark commands (vla_rl/bench*.py, with the shared
vla_rl/bench_stages.py) and the scripts in benchmarks/ (not gpu_smoke.py, which checks components one
by one, as a test does). Of the vla_rl package a composition may import
only

- ``vla_rl.stages``: the stage functions and the configs they take;
- ``vla_rl.bench_stages``: the learning benchmarks' shared stages, themselves built on ``vla_rl.stages``;
- its own module;
- for a script in benchmarks/, also ``vla_rl.cli``: a script that only forwards its arguments to a
  ``vla-rl`` command line (``main(argv)``) runs the command through its public entry point.
- another benchmark's config class (``from vla_rl.bench_delay import BenchDelayConfig``) and nothing
  else of it: a benchmark built on other benchmarks' settings (``bench delay-calibration``) reads their
  one definition; their shared stages live in ``vla_rl.bench_stages``.

Everything else of vla_rl (a command module such as ``vla_rl.train``, its private helpers such as
``_config_dict``, ``vla_rl.rl.*``, ``vla_rl.latency_warmup``, ...) is another command's internals.
``import vla_rl.x``, ``from vla_rl.x import y``, ``from vla_rl import x`` and relative imports are all
read as importing ``vla_rl.x``. Other packages (vla_core, sim, policies, the standard library, ...)
are outside this rule (tests/test_layout.py orders the packages).
"""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"vla_rl.stages", "vla_rl.bench_stages"}
SCRIPT_ALLOWED = {"vla_rl.cli"}
BENCH_CONFIG = re.compile(r"Bench\w*Config")
# Loaded by a command or a stage, never by `import vla_rl.stages` itself.
HEAVY = ("torch", "mujoco", "sim", "policies", "diffusers", "accelerate", "lerobot", "vla_rl.train",
         "vla_rl.record", "vla_rl.eval", "vla_rl.finetune", "vla_rl.rl", "vla_rl.latency_warmup")  # fmt: skip


def compositions() -> list[Path]:
    """Every composition; not benchmarks/gpu_smoke.py, which checks components one by one, as a test does."""
    files = [ROOT / "vla_rl" / "quickstart.py", *sorted((ROOT / "vla_rl").glob("bench*.py"))]
    return files + [p for p in sorted((ROOT / "benchmarks").glob("*.py")) if p.name != "gpu_smoke.py"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts)


def vla_rl_imports(source: str, module: str) -> list[str]:
    """Every vla_rl module ``source`` (the text of ``module``) imports, wherever the statement is."""
    package = module.rsplit(".", 1)[0] if "." in module else ""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package (one level up per extra dot)
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            if base == "vla_rl":  # `from vla_rl import x` imports the module vla_rl.x
                found += [f"vla_rl.{alias.name}" for alias in node.names]
            elif base.startswith("vla_rl.bench_") and all(BENCH_CONFIG.fullmatch(a.name) for a in node.names):
                continue  # only another benchmark's config classes
            else:
                found.append(base)
    return [m for m in found if m == "vla_rl" or m.startswith("vla_rl.")]


def forbidden_imports(source: str, module: str) -> list[str]:
    """The imports of ``source`` that break the rule of the module docstring."""
    allowed = ALLOWED | {module} | (SCRIPT_ALLOWED if module.startswith("benchmarks.") else set())
    return [m for m in vla_rl_imports(source, module) if m not in allowed]


@pytest.mark.parametrize("path", compositions(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_composition_imports_only_the_stages_api_of_vla_rl(path):
    bad = forbidden_imports(path.read_text(), _module_name(path))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}; use vla_rl.stages (see this test's docstring)"


def test_the_rule_catches_what_it_forbids():
    """A benchmark reaching into the train command (as benchmarks/l2_minibatching.py once did for the
    private ``_config_dict``) is flagged, in each import form; the allowed ones pass."""
    script = "benchmarks.l2_minibatching"
    assert forbidden_imports("def f():\n    from vla_rl.train import _config_dict\n", script) == ["vla_rl.train"]
    assert forbidden_imports("import vla_rl.eval\nfrom vla_rl import finetune\n", script) == [
        "vla_rl.eval",
        "vla_rl.finetune",
    ]
    assert forbidden_imports("from vla_rl.rl.grpo import GRPOConfig\n", "vla_rl.bench_rl") == ["vla_rl.rl.grpo"]
    assert forbidden_imports("from .train import train\n", "vla_rl.quickstart") == ["vla_rl.train"]
    assert forbidden_imports("from vla_rl.cli import main\n", "vla_rl.quickstart") == ["vla_rl.cli"]
    ok = "from vla_rl import stages\nfrom vla_rl.stages import TrainConfig\nfrom vla_core.runtime import DelayConfig\n"
    assert forbidden_imports(ok + "from vla_rl.cli import main\n", script) == []
    assert forbidden_imports(ok + "from vla_rl.bench_stages import held_out\n", "vla_rl.bench_rl") == []
    calibration = "vla_rl.bench_delay_calibration"
    assert forbidden_imports("from vla_rl.bench_delay import BenchDelayConfig\n", calibration) == []
    assert forbidden_imports("from vla_rl.bench_delay import BenchDelayConfig, summarize\n", calibration) == [
        "vla_rl.bench_delay"
    ]
    assert forbidden_imports("import vla_rl.bench_latency_rl\n", calibration) == ["vla_rl.bench_latency_rl"]
    assert {p.name for p in compositions()} >= {"quickstart.py", "bench_rl.py", "l2_minibatching.py"}


def test_importing_the_stages_api_loads_no_command_torch_or_simulator():
    code = (
        "import json, sys\nimport vla_rl.stages\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'mujoco', 'sim', 'policies', 'diffusers', 'accelerate', 'lerobot') or m.startswith('vla_rl.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.splitlines()[-1])
    heavy = [m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert not heavy, f"import vla_rl.stages loaded {heavy}"
    assert "vla_rl.stages" in loaded


def test_every_name_of_the_api_resolves_to_the_commands_own_object():
    from sim.config import EnvConfig
    from vla_rl import stages
    from vla_rl.eval import EvalConfig
    from vla_rl.finetune import FinetuneConfig
    from vla_rl.record import RecordConfig
    from vla_rl.train import DatasetConfig, TrainConfig

    assert set(stages.__all__) == {"record", "train", "evaluate", "finetune", "train_prm", "steer", "dsrl",
                                   *stages._EXPORTS}  # fmt: skip
    for name in stages.__all__:
        assert getattr(stages, name) is not None, name
    for cls in (RecordConfig, TrainConfig, DatasetConfig, EvalConfig, FinetuneConfig, EnvConfig):
        assert getattr(stages, cls.__name__) is cls
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        stages.nothing  # noqa: B018


@pytest.mark.parametrize(
    "stage, module, name, extra",
    [("record", "vla_rl.record", "record", ()), ("train", "vla_rl.train", "train", ()),
     ("evaluate", "vla_rl.eval", "evaluate", ("policy",)), ("finetune", "vla_rl.finetune", "finetune", ()),
     ("train_prm", "vla_rl.train_prm", "train_prm", ()), ("steer", "vla_rl.steer", "run_steer", ()),
     ("dsrl", "vla_rl.dsrl", "run_dsrl", ())],
)  # fmt: skip
def test_a_stage_is_its_commands_entry_point(stage, module, name, extra, monkeypatch):
    """Each stage hands its config (and, for evaluate, the policy) to the command and returns what it returns,
    looking the command up when called."""
    import importlib

    from vla_rl import stages

    calls = []

    def command(cfg, *args):
        calls.append((cfg, args))
        return {"from": name}

    monkeypatch.setattr(importlib.import_module(module), name, command)
    cfg = object()
    assert getattr(stages, stage)(cfg, *extra) == {"from": name}
    assert calls == [(cfg, extra)]
    if stage == "evaluate":  # without a policy: the checkpoint's
        assert stages.evaluate(cfg) == {"from": name} and calls[-1] == (cfg, (None,))
