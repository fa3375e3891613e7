"""No process outlives its parent (`vla_core.lifetime`): a parent killed with SIGKILL runs no cleanup, and its
children must still end within 5 s: a `vla-rl` command it started, and serve's inference worker process. The
control case, a child started without the watch, survives the same kill: the test can fail."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}

CHILD = "import time; from vla_core.lifetime import exit_with_parent_from_environ as watch; watch(); time.sleep(120)"
PARENT_OF_CHILD = f"""
import subprocess, sys, time
from vla_core.lifetime import child_environ
env = child_environ() if sys.argv[1] == "watched" else None
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env)
print(child.pid, flush=True)
time.sleep(120)
"""
PARENT_OF_WORKER = """
import time
from functools import partial
from bridge_policies import ramp_policy
from robot_bridge.inference import InferenceWorker
worker = InferenceWorker(partial(ramp_policy, 8), mode="process", cpu=-1)
print(worker._runner.pid, flush=True)
time.sleep(120)
"""


def _ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaped (a container's init may not reap): either way it runs no more."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _kill_parent_and_watch(script: str, *args: str, within_s: float = 5.0) -> tuple[bool, int]:
    """Start ``script`` (which prints its child's pid), SIGKILL it, and whether the child ended within ``within_s``."""
    parent = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, env=ENV)
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child is up and watching
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not _ended(child):
        time.sleep(0.1)
    return _ended(child), child


def test_a_command_started_as_a_child_ends_when_its_parent_is_killed():
    ended, _ = _kill_parent_and_watch(PARENT_OF_CHILD, "watched")
    assert ended
    survived, orphan = _kill_parent_and_watch(PARENT_OF_CHILD, "unwatched", within_s=2.0)
    try:
        assert not survived  # without the watch the orphan runs on: what the watch prevents
    finally:
        os.kill(orphan, signal.SIGKILL)


def test_serves_inference_worker_process_ends_when_the_node_is_killed():
    ended, _ = _kill_parent_and_watch(PARENT_OF_WORKER)
    assert ended


def test_the_parents_pid_is_taken_out_of_the_environment_so_no_grandchild_inherits_it(monkeypatch):
    from vla_core.lifetime import PARENT_ENV, exit_with_parent_from_environ

    monkeypatch.setenv(PARENT_ENV, "not a pid")
    assert exit_with_parent_from_environ() is None and PARENT_ENV not in os.environ
