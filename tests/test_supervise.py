"""The `vla-rl` console script's supervising parent (`vla_rl.supervise`): a native crash of the command becomes one
line naming the signal, the stacks and the resume command; a stop signal still stops the command as it would alone."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vla_rl.supervise import crash_line, supervises

CONSOLE = "import sys; from vla_rl.cli import console_main; sys.argv[0] = 'vla-rl'; sys.exit(console_main())"


def _child_of(pid: int, timeout: float = 120.0) -> int:
    """The one child process of ``pid``, once it has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.1)
    raise AssertionError("the supervised command never started")


def _train(tiny_dataset, out: Path) -> subprocess.Popen:
    """`vla-rl train` on the tiny dataset for long enough to be stopped, through the console script."""
    args = ["train", f"--dataset.root={tiny_dataset[0]}", f"--output_dir={out}", "--steps=100000", "--batch_size=4",
            "--log_with=none", "--num_threads=1"]  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", CONSOLE, *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MUJOCO_GL": "egl"})  # fmt: skip


def test_a_crashed_command_ends_in_one_line_naming_the_signal_the_stacks_and_the_resume_command(tiny_dataset, tmp_path):
    parent = _train(tiny_dataset, tmp_path / "run")
    child = _child_of(parent.pid)
    time.sleep(3)  # importing: a crash there is a crash all the same
    os.kill(child, signal.SIGSEGV)
    _, err = parent.communicate(timeout=120)
    assert parent.returncode == 128 + signal.SIGSEGV
    line = err.strip().splitlines()[-1]
    assert line == crash_line(["train", f"--dataset.root={tiny_dataset[0]}", f"--output_dir={tmp_path / 'run'}",
                               "--steps=100000", "--batch_size=4", "--log_with=none", "--num_threads=1"],
                              signal.SIGSEGV)  # fmt: skip
    assert line.startswith("vla-rl train: died natively (SIGSEGV); its Python stacks: native_crash.log in ")
    assert line.endswith("--num_threads=1 --resume=true")


def test_a_sigterm_to_the_console_script_stops_the_command_as_it_would_alone(tiny_dataset, tmp_path):
    """The scheduler's SIGTERM reaches the supervisor only: passed on, the command stops cleanly (143), no crash line."""
    parent = _train(tiny_dataset, tmp_path / "run")
    _child_of(parent.pid)
    time.sleep(3)
    parent.send_signal(signal.SIGTERM)
    _, err = parent.communicate(timeout=300)
    assert parent.returncode == 128 + signal.SIGTERM
    assert "died natively" not in err


def test_which_commands_are_supervised(monkeypatch):
    monkeypatch.delenv("VLA_RL_SUPERVISED", raising=False)
    assert supervises(["finetune", "--checkpoint=x"]) and supervises(["bench", "rl"])
    assert not supervises(["serve"]) and not supervises(["record-ros"]) and not supervises([])
    monkeypatch.setenv("VLA_RL_SUPERVISED", "1")  # the child runs the command itself
    assert not supervises(["finetune"])
    assert crash_line(["record", "--output_dir=d"], signal.SIGBUS).endswith("; run again: vla-rl record --output_dir=d")
    assert crash_line(["bench", "rl", "--seed=1"], signal.SIGABRT) == (
        "vla-rl bench: died natively (SIGABRT); its Python stacks: native_crash.log in the command's output folder, "
        "or on stderr above; resume: vla-rl bench rl --seed=1 (its finished stages are kept)"
    )
