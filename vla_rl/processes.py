"""`vla-rl` commands as child processes in a ROS 2 domain of their own: what a composition that runs a
served robot (`vla-rl bench robot-parity`) and the closed-loop tests start and stop them with.

Each child sees only the nodes of its ``ROS_DOMAIN_ID`` on this machine, so runs going on at the same
time (other benchmarks, other people's tests) never see each other's topics. No ROS import here: the
children load it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from vla_core.lifetime import child_environ

STOPPED_BY_SIGINT = 128 + signal.SIGINT  # the exit code of a `vla-rl` command ended by Ctrl-C


def ros_environ(domain_id: int) -> dict[str, str]:
    """This process's environment for a child in ROS domain ``domain_id``: discovery on this machine only,
    headless rendering, unbuffered output, and no download of a model the cache lacks."""
    return {**os.environ, "ROS_DOMAIN_ID": str(domain_id), "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
            "MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip


def start_command(args: list[str], domain_id: int, log_dir: Path, name: str) -> subprocess.Popen:
    """``vla-rl <args>`` as a subprocess; stdout and stderr go to ``log_dir/<name>.{out,err}``."""
    with (
        open(log_dir / f"{name}.out", "w") as out,
        open(log_dir / f"{name}.err", "w") as err,
    ):  # the child keeps its copies
        return subprocess.Popen(  # ends with this process, even if it is killed (`vla_core.lifetime`)
            [sys.executable, "-m", "vla_rl.cli", *args], stdout=out, stderr=err,
            env=child_environ(ros_environ(domain_id)),
        )  # fmt: skip


def stop_command(proc: subprocess.Popen, log_dir: Path, name: str, timeout: float = 20, exits_by_itself: bool = False,
                 sig: int = signal.SIGINT) -> tuple[int, str, str]:  # fmt: skip
    """Send ``sig`` (Ctrl-C by default; after ``timeout`` s if it ``exits_by_itself``); its exit code, stdout, stderr.

    A `vla-rl` command stopped by a signal still prints its summary, and exits with 128 + the signal
    number (130 for SIGINT: STOPPED_BY_SIGINT) to say it was stopped; one that ended by itself exits with 0.
    """
    if exits_by_itself:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode, (log_dir / f"{name}.out").read_text(), (log_dir / f"{name}.err").read_text()


def last_json(stdout: str) -> dict:
    """The JSON summary a `vla-rl` command prints (the indented block before its human line)."""
    start = stdout.index("{\n")
    end = stdout.rindex("\n}") + 2
    return json.loads(stdout[start:end])
