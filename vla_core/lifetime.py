"""A child process that ends with its parent: no worker outlives the run that started it.

A parent killed with SIGKILL (an out-of-memory kill, a scheduler's hard stop, a crash) runs no cleanup, so its
children (an inference worker, a sim robot, a serve node a benchmark started) would be reparented and run on,
holding cores, ports and ROS topics. `exit_with_parent` is called in the child: a daemon thread watches the
parent's pid and, once the child has been reparented, ends the child as a SIGTERM would (its handlers run, so a
`vla-rl` command stops as after Ctrl-C), then for good if it is still there after ``grace_s``. A thread rather than
Linux's PR_SET_PDEATHSIG: that one fires when the *thread* that started the child ends, which in a node that
restarts its worker from a callback thread is not the parent's end.

A command started as a child learns its parent from the environment (``VLA_RL_PARENT_PID``, set by the parent:
`child_environ`), so the watch starts before anything is imported; `vla_rl.cli` starts it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_ENV = "VLA_RL_PARENT_PID"  # set by a parent for a `vla-rl` command it starts: its own pid


def exit_with_parent(parent_pid: int, poll_s: float = 0.2, grace_s: float = 15.0) -> threading.Thread | None:
    """Watch ``parent_pid`` from a daemon thread; when this process is no longer its child, SIGTERM to self, and
    ``os._exit(1)`` after ``grace_s`` (longer than a command's own shutdown) if that did not end it. Returns the
    thread (started); None, watching nothing, when ``parent_pid`` runs but is not this process's parent (a
    forkserver's child, say): no process is ended for a parent it never had. A parent already gone when the watch
    starts (killed while this process was still importing) ends it at once."""
    if os.getppid() != parent_pid and _running(parent_pid):
        return None

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="vla-rl-exit-with-parent", daemon=True)
    thread.start()
    return thread


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (a killed process its own parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: existence alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def child_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (this process's by default) with ``VLA_RL_PARENT_PID`` set to this process: a `vla-rl` command
    started with it ends when this process does."""
    return {**(os.environ if environ is None else environ), PARENT_ENV: str(os.getpid())}


def exit_with_parent_from_environ() -> threading.Thread | None:
    """`exit_with_parent` for the parent named in ``VLA_RL_PARENT_PID``, when it is set. The variable is taken out
    of this process's environment, so nothing this process starts inherits a pid that is not its parent."""
    value = os.environ.pop(PARENT_ENV, "")
    return exit_with_parent(int(value)) if value.isdigit() else None
