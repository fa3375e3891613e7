import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_unknown_key_is_one_line_error():
    res = vla_rl("train", "--policy.horizn=8")
    assert res.returncode == 2
    lines = [line for line in res.stderr.strip().splitlines() if line]
    assert len(lines) == 1, res.stderr
    assert "policy.horizn" in lines[0] and "vla-rl train --help" in lines[0]


def test_unknown_command():
    res = vla_rl("finetune")
    assert res.returncode == 2 and "choose one of: record, train, eval, quickstart" in res.stderr


def test_missing_dataset_is_one_line_error(tmp_path):
    res = vla_rl("train", f"--dataset.root={tmp_path / 'nope'}", f"--output_dir={tmp_path / 'out'}")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "no LeRobotDataset at" in res.stderr and "vla-rl record" in res.stderr


def test_missing_checkpoint_is_one_line_error(tmp_path):
    res = vla_rl("eval", f"--checkpoint={tmp_path}")
    assert res.returncode == 2 and "no checkpoint at" in res.stderr
    assert res.stderr.strip().count("\n") == 0, res.stderr


def test_checkpoint_of_another_policy_type(tiny_checkpoint, tmp_path):
    from vla_rl.checkpoint import resolve_checkpoint

    src = resolve_checkpoint(tiny_checkpoint[0])
    other = tmp_path / "act"
    shutil.copytree(src, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["policy_type"] = "act"
    (other / "config.json").write_text(json.dumps(cfg))
    res = vla_rl("eval", f"--checkpoint={other}")
    assert res.returncode == 2 and "unknown policy type 'act'" in res.stderr and "diffusion" in res.stderr

    (other / "config.json").write_text(json.dumps({"type": "act", "chunk_size": 100}))  # a LeRobot policy dir
    res = vla_rl("eval", f"--checkpoint={other}")
    assert res.returncode == 2 and "not a vla-rl checkpoint" in res.stderr and "'act'" in res.stderr


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
