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
PARENT_OF_RENDER_WORKERS = """
import time, mujoco
from sim.render import ProcessRenderers
model = mujoco.MjModel.from_xml_string('<mujoco><worldbody><camera name="front" pos="0 0 1"/><geom size=".1"/></worldbody></mujoco>')
renderers = ProcessRenderers(model, 2)
print(" ".join(str(process.pid) for process, _ in renderers._workers), flush=True)
time.sleep(120)
"""
PARENT_OF_ASYNC_WORLDS = """
import time
from test_subprocess_env import SlideWorld, to_lerobot
from sim.subprocess_env import SubprocessBatchedEnv
env = SubprocessBatchedEnv([SlideWorld] * 2, to_lerobot, ["a", "b"], 3, [], 0.05)
print(" ".join(str(process.pid) for process in env._vector.processes), flush=True)
time.sleep(120)
"""


def _ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaped (a container's init may not reap): either way it runs no more."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _kill_parent_and_watch(script: str, *args: str, within_s: float = 5.0) -> tuple[bool, list[int]]:
    """Start ``script`` (which prints its children's pids on one line), SIGKILL it, and whether every child ended
    within ``within_s``; returns that and the children's pids."""
    parent = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.DEVNULL, env=ENV)  # fmt: skip
    children = [int(pid) for pid in parent.stdout.readline().split()]
    time.sleep(1.0)  # the children are up and watching
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not all(map(_ended, children)):
        time.sleep(0.1)
    return all(map(_ended, children)), children


def _kill_survivors(children: list[int]) -> None:
    """A failing test leaves nothing behind."""
    for pid in children:
        if not _ended(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_command_started_as_a_child_ends_when_its_parent_is_killed():
    ended, _ = _kill_parent_and_watch(PARENT_OF_CHILD, "watched")
    assert ended
    survived, orphans = _kill_parent_and_watch(PARENT_OF_CHILD, "unwatched", within_s=2.0)
    try:
        assert not survived  # without the watch the orphan runs on: what the watch prevents
    finally:
        _kill_survivors(orphans)


def test_serves_inference_worker_process_ends_when_the_node_is_killed():
    ended, _ = _kill_parent_and_watch(PARENT_OF_WORKER)
    assert ended


def test_the_parents_pid_is_taken_out_of_the_environment_so_no_grandchild_inherits_it(monkeypatch):
    from vla_core.lifetime import PARENT_ENV, exit_with_parent_from_environ

    monkeypatch.setenv(PARENT_ENV, "not a pid")
    assert exit_with_parent_from_environ() is None and PARENT_ENV not in os.environ


def test_render_worker_processes_end_when_their_env_is_killed():
    """`sim.render.ProcessRenderers`' workers end with their parent (the watch, and the pipe's end)."""
    ended, children = _kill_parent_and_watch(PARENT_OF_RENDER_WORKERS)
    _kill_survivors(children)
    assert ended


def test_gymnasiums_async_workers_of_a_subprocess_env_end_when_their_env_is_killed():
    """LIBERO's and robosuite's worlds run in gymnasium's AsyncVectorEnv workers (forkserver children, not the
    env's): they end when the killed env's end of their pipes closes."""
    ended, children = _kill_parent_and_watch(PARENT_OF_ASYNC_WORLDS)
    _kill_survivors(children)
    assert ended
