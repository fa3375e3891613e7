import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_POLICY = ROOT / "tests" / "fixtures" / "v0_2" / "train" / "checkpoints" / "last" / "pretrained_model"


def vla_rl(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "vla_rl.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, check=False
    )


def test_overview_lists_commands():
    res = vla_rl("--help")
    assert res.returncode == 0
    for cmd in ("record", "train", "eval", "quickstart"):
        assert f"  {cmd}" in res.stdout


def test_help_explains_every_field():
    res = vla_rl("train", "--help")
    assert res.returncode == 0
    assert "--policy.horizon" in res.stdout and "action steps predicted per chunk" in res.stdout
    assert "--resume" in res.stdout and "continue from output_dir/checkpoints/last" in res.stdout
    assert "--dataset.root" in res.stdout


def _every_command():
    from vla_rl.cli import COMMANDS

    for name, command in COMMANDS.items():
        yield from ([f"{name} {sub}" for sub in command.subcommands] if command.subcommands else [name])


def test_every_command_and_bench_subcommand_explains_its_fields(capsys):
    """Each `--help` exits 0 and lists its fields, a field whose comment holds a percent sign included (argparse
    %-formats help strings: robot-parity's comment "episode e runs in world e % num_envs" once crashed it)."""
    import pytest

    from vla_rl.cli import main

    names = list(_every_command())
    assert {"bench robot-parity", "bench delay-beyond", "sim-robot", "dsrl", "train"} <= set(names)
    for name in names:
        with pytest.raises(SystemExit) as stop:
            main([*name.split(), "--help"])
        out = capsys.readouterr().out
        assert stop.value.code == 0, name
        assert out.startswith(f"usage: vla-rl {name}") and "  --" in out, name
    with pytest.raises(SystemExit):
        main(["bench", "robot-parity", "--help"])
    assert "episode e runs in world e %" in capsys.readouterr().out


def test_a_steer_mode_outside_its_choices_is_refused_when_parsed(capsys):
    """`steer.mode` and its siblings are Literals: a wrong value is one line at parse time, before any steering
    loads, naming the choices; the policy server refuses steering flags without a steering as serve does."""
    from vla_rl.cli import main

    for argv in (["eval", "--steer.mode=sometimes"], ["serve", "--steer_mode=sometimes"],
                 ["policy-server", "--steer_mode=sometimes"]):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "sometimes" in err[0] and "gated" in err[0] and "always" in err[0], (argv, err)
    assert main(["policy-server", "--steer_mode=always", "--address=127.0.0.1:0"]) == 2
    assert "steer nothing without --steer_dir" in capsys.readouterr().err


def test_unknown_key_is_one_line_error():
    res = vla_rl("train", "--policy.horizn=8")
    assert res.returncode == 2
    lines = [line for line in res.stderr.strip().splitlines() if line]
    assert len(lines) == 1, res.stderr
    assert "policy.horizn" in lines[0] and "vla-rl train --help" in lines[0]


def test_unknown_command():
    res = vla_rl("fly")
    assert res.returncode == 2 and "choose one of: record, train, finetune, eval, report, quickstart" in res.stderr


def test_missing_dataset_is_one_line_error(tmp_path):
    res = vla_rl("train", f"--dataset.root={tmp_path / 'nope'}", f"--output_dir={tmp_path / 'out'}")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "no LeRobotDataset at" in res.stderr and "vla-rl record" in res.stderr


def test_missing_checkpoint_is_one_line_error(tmp_path):
    res = vla_rl("eval", f"--checkpoint={tmp_path}")
    assert res.returncode == 2 and "no checkpoint at" in res.stderr
    assert res.stderr.strip().count("\n") == 0, res.stderr


def test_checkpoint_of_another_policy_type(tiny_checkpoint, tmp_path, capsys):
    from types import SimpleNamespace

    from vla_rl.checkpoint import resolve_policy_dir
    from vla_rl.cli import main

    def eval_in_process(*args):  # the same entry point as the command line, without a new interpreter each time
        code = main(["eval", *args])
        return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)

    src = resolve_policy_dir(tiny_checkpoint[0])
    other = tmp_path / "act"
    shutil.copytree(src, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["type"] = "act"
    (other / "config.json").write_text(json.dumps(cfg))
    # Another type goes to LeRobot (its policies enter through the same loader), which cannot read this one.
    res = eval_in_process(f"--checkpoint={other}")
    assert res.returncode == 2 and "is neither a vla-rl checkpoint nor a policy LeRobot can load" in res.stderr

    # LeRobot's own diffusion policy (vla-rl's is `vla_rl_diffusion`), here without the features it needs.
    (other / "config.json").write_text(json.dumps({"type": "diffusion", "n_obs_steps": 2}))
    res = eval_in_process(f"--checkpoint={other}")
    assert res.returncode == 2 and "must read observation.state and at least one camera" in res.stderr

    # A vla-rl type this version does not have.
    (other / "config.json").write_text(json.dumps({**cfg, "type": "vla_rl_world_model"}))
    res = eval_in_process(f"--checkpoint={other}")
    assert res.returncode == 2 and "'vla_rl_world_model' policy, which this vla-rl does not know" in res.stderr
    assert "vla_rl_diffusion_vla" in res.stderr  # the types it writes

    # A field this version does not know (another vla-rl version) is named.
    (other / "config.json").write_text(json.dumps({**cfg, "type": "vla_rl_diffusion", "down_dims": [512]}))
    res = eval_in_process(f"--checkpoint={other}")
    assert res.returncode == 2 and "fields vla-rl's 'diffusion' policy does not have (down_dims)" in res.stderr

    (other / "config.json").write_text(json.dumps({"policy_type": "diffusion", "policy": {}}))  # vla-rl 0.1's layout
    res = eval_in_process(f"--checkpoint={other}")
    assert res.returncode == 2 and "written by vla-rl 0.1: retrain it" in res.stderr


def test_a_yaml_config_sets_the_run_and_flags_override_it(tmp_path):
    from vla_rl.cli import parse_config
    from vla_rl.record import record

    config = tmp_path / "record.yaml"
    config.write_text(f"num_episodes: 5\nenv:\n  num_envs: 2\n  image_size: 32\noutput_dir: {tmp_path / 'ds'}\n")
    summary = record(parse_config("record", [f"--config_path={config}", "--num_episodes=2"]))
    assert summary["episodes"] == 2  # the flag wins over the file's 5
    info = json.loads((tmp_path / "ds" / "meta" / "info.json").read_text())  # written where the file said
    assert info["features"]["observation.images.front"]["shape"] == [32, 32, 3]  # the file's size, not 64
    # The shipped configs name only current fields: a renamed field must fail here, not for a user.
    for name in ("record", "train", "eval", "quickstart"):
        parse_config(name, [f"--config_path={ROOT / 'configs' / f'{name}.yaml'}"])


def test_record_command_writes_dataset(tmp_path):
    res = vla_rl("record", "--num_episodes=2", "--env.num_envs=2", f"--output_dir={tmp_path / 'ds'}")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["episodes"] == 2 and summary["frames"] > 20
    assert (tmp_path / "ds" / "meta" / "info.json").is_file()


def test_a_native_crash_in_a_command_leaves_every_threads_python_stack_on_stderr():
    """A command that dies in native code (here a read of address 0, as a renderer's segfault would) prints
    the Python stack of the crash, not only the shell's "Segmentation fault"."""
    crash = (
        "import ctypes, sys\n"
        "from vla_rl import cli\n"
        "def crash_in_run(cfg):\n"
        "    ctypes.string_at(0)\n"
        "cli.COMMANDS['eval'].run = crash_in_run\n"
        "sys.exit(cli.main(['eval', '--checkpoint=unused']))\n"
    )
    done = subprocess.run([sys.executable, "-c", crash], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == -11  # SIGSEGV
    assert "Fatal Python error: Segmentation fault" in done.stderr and " in crash_in_run" in done.stderr


def test_a_native_crash_inside_a_run_leaves_its_python_stack_in_the_runs_folder(tmp_path):
    """`vla-rl eval` dying in native code while its envs step (a read of address 0 where a renderer would
    segfault): the stack, down to the function that crashed, is in <output_dir>/native_crash.log."""
    out = tmp_path / "eval"
    crash = (
        "import ctypes, sys\n"
        "from vla_core.runtime import delayed_env\n"
        "def reset_and_crash(self, seed=None, **kwargs):\n"
        "    ctypes.string_at(0)\n"
        "delayed_env.DelayedChunkEnv.reset = reset_and_crash\n"
        "from vla_rl import cli\n"
        f"sys.exit(cli.main(['eval', '--checkpoint={FIXTURE_POLICY}', '--env.image_size=32', '--output_dir={out}']))\n"
    )
    done = subprocess.run([sys.executable, "-c", crash], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == -11, done.stderr[-2000:]  # SIGSEGV
    log = (out / "native_crash.log").read_text()
    assert "Fatal Python error: Segmentation fault" in log and " in reset_and_crash" in log and " in evaluate" in log


def test_a_run_without_a_crash_leaves_no_crash_log(tmp_path):
    """Outside ``into`` the stacks go back where they went (stderr, or nowhere), and an empty log is removed;
    the folder stays, with what the run wrote into it. Nested, the inner folder gets them, then the outer."""
    import faulthandler

    from vla_core import crash_log

    was = faulthandler.is_enabled()
    faulthandler.disable()
    try:
        with crash_log.into(tmp_path / "a" / "b") as path:
            assert path == tmp_path / "a" / "b" / "native_crash.log" and path.is_file() and faulthandler.is_enabled()
            (tmp_path / "a" / "b" / "result.json").write_text("{}")
            with crash_log.into(tmp_path / "c", process_index=2) as inner:  # a data-parallel run's third process
                assert inner == tmp_path / "c" / "native_crash.process2.log" and inner.is_file()
            assert faulthandler.is_enabled() and not inner.exists()
        assert not faulthandler.is_enabled() and not path.exists() and (tmp_path / "a" / "b" / "result.json").is_file()
    finally:
        if was:
            crash_log.on_stderr()
