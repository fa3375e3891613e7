"""CPU scheduling of the bridge's processes (Linux): real-time priority for control, normal for inference.

A 100 Hz control loop in Python meets its deadlines only if nothing else on its core can delay a
tick. Niceness and core pinning are not enough on two cores: the kernel still lets a busy
process finish its slice first, which costs milliseconds. SCHED_FIFO (what ros2_control uses for
its loops) makes the control thread preempt normal work at once; it sleeps between ticks, so it
cannot starve the machine. Threads inherit the policy when they are created, so call
``use_realtime`` before ``rclpy.init`` to cover the DDS threads too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def use_realtime(priority: int) -> str | None:
    """Put the calling thread (and threads it starts later) on SCHED_FIFO at ``priority`` (1-99).

    Returns None on success, or why it was not possible (no permission, not Linux); the caller
    logs it and runs with normal scheduling.
    """
    if not 1 <= priority <= 99:
        raise ValueError(f"real-time priority must be in [1, 99], got {priority}; 0 disables it")
    if not hasattr(os, "sched_setscheduler"):
        return "this platform has no SCHED_FIFO"
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except PermissionError:
        return "no permission for SCHED_FIFO (needs CAP_SYS_NICE or an rtprio limit, e.g. in limits.conf)"
    return None


def use_normal() -> None:
    """Put the calling thread back on normal (SCHED_OTHER) scheduling, e.g. in the inference worker,
    which inherits the control loop's policy when it is started from it."""
    if hasattr(os, "sched_setscheduler") and os.sched_getscheduler(0) != os.SCHED_OTHER:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


@contextmanager
def normal_scheduling() -> Iterator[None]:
    """Run the block with the calling thread on normal scheduling, then give its policy back.

    For starting a process from a real-time thread: a child inherits the policy at fork, and a
    spawned inference worker importing torch at SCHED_FIFO on the control core would keep the
    control loop (same priority, so no preemption) off the CPU for the second or two the imports
    take, before the worker's own ``use_normal`` runs.
    """
    if not hasattr(os, "sched_getscheduler") or os.sched_getscheduler(0) == os.SCHED_OTHER:
        yield
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    use_normal()
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, param)


def lock_memory() -> str | None:
    """Lock every page of this process in RAM, now and as it grows (``mlockall``), as real-time
    ROS 2 controllers do: a page the kernel reclaimed would cost the next tick that touches it a
    page fault of milliseconds. Locks are per process and not inherited, so the spawned inference
    worker stays unlocked.

    Returns None on success, or why it was not possible; the caller logs it and runs unlocked.
    """
    if not sys.platform.startswith("linux"):
        return "memory locking is only done on Linux"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    mcl_current, mcl_future = 1, 2
    if libc.mlockall(mcl_current | mcl_future) != 0:
        reason = os.strerror(ctypes.get_errno())
        return f"mlockall failed ({reason}); raise the memlock limit (ulimit -l, limits.conf) or grant CAP_IPC_LOCK"
    return None


def quiet_interpreter() -> None:
    """Keep garbage collection from pausing a control process, once its setup is done.

    Everything allocated during setup moves to a permanent generation, so later collections only
    scan the few objects a tick creates instead of walking every module and message type.
    """
    gc.collect()
    gc.freeze()
