"""The `vla-rl` console script's supervising parent: a native crash becomes one line naming it, where its stacks
are and how to resume.

A segmentation fault in a C library (a GPU driver, a simulator) kills a process without a Python traceback, and the
shell says only "Segmentation fault". So a long command run from the console script (`SUPERVISED_COMMANDS`) runs in
a child process (``python -m vla_rl.cli``, which ends with this one: `vla_core.lifetime`) while this process
waits. The child is in the terminal's process group, so Ctrl-C reaches it directly (this process lets it pass);
a SIGTERM sent to this process alone (a scheduler's) is passed on, so the child stops as it would alone. When the
child dies by a crash signal, this process prints the line and exits with 128 + the signal, as the shell would
have; otherwise it exits with the child's code. Commands called as functions (`vla_rl.cli.main`), or started with
``python -m vla_rl.cli``, are never supervised.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from vla_core.crash_log import CRASH_SIGNALS

# Commands that run long enough to meet a driver's crash; the ROS nodes and quick tools run unsupervised.
SUPERVISED_COMMANDS = ("quickstart", "record", "train", "eval", "finetune", "train-prm", "steer", "dsrl", "bench",
                       "pretrain-encoder", "probe-localization")  # fmt: skip
SUPERVISED_ENV = "VLA_RL_SUPERVISED"  # set in the child: it runs the command itself
RESUMABLE = ("train", "eval", "finetune")  # commands with --resume; the others resume by being run again


def supervises(argv: list[str]) -> bool:
    """Whether the console script runs ``argv`` in a supervised child."""
    return bool(argv) and argv[0] in SUPERVISED_COMMANDS and not os.environ.get(SUPERVISED_ENV)


def supervise(argv: list[str]) -> int:
    """Run ``vla-rl <argv>`` in a child (module docstring); its exit code, or 128 + a crash signal after one line."""
    from vla_core.lifetime import child_environ

    env = child_environ({**os.environ, SUPERVISED_ENV: "1"})
    child = subprocess.Popen([sys.executable, "-m", "vla_rl.cli", *argv], env=env)

    def pass_on(signum, _frame) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGINT, lambda *_: None)  # the terminal's Ctrl-C reaches the child itself
    signal.signal(signal.SIGTERM, pass_on)
    code = child.wait()
    if code < 0 and -code in CRASH_SIGNALS:
        print(crash_line(argv, signal.Signals(-code)), file=sys.stderr)
    return 128 - code if code < 0 else code


def crash_line(argv: list[str], signum: signal.Signals) -> str:
    """The one line: the command, the signal, where the stacks are, how to resume."""
    command = " ".join(["vla-rl", *argv])
    folder = next((a.split("=", 1)[1] for a in argv if a.startswith("--output_dir=")), "")
    where = f"native_crash.log in {folder} (or the folder of the stage it was running)" if folder else (
        "native_crash.log in the command's output folder, or on stderr above")  # fmt: skip
    if argv[0] in RESUMABLE:
        again = "resume: " + (command if "--resume=true" in argv else f"{command} --resume=true")
    elif argv[0] in ("bench", "quickstart"):
        again = f"resume: {command} (its finished stages are kept)"
    else:  # the same command runs it again (dsrl and steer go on from what they saved)
        again = f"run again: {command}"
    return f"vla-rl {argv[0]}: died natively ({signum.name}); its Python stacks: {where}; {again}"
