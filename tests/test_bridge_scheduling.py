"""Real-time scheduling of the control loop, and the inference worker's return to normal scheduling."""

import os
import subprocess
import sys
import threading

import pytest

from robot_bridge.scheduling import use_normal, use_realtime


def test_realtime_then_normal_in_a_thread():
    """Runs in a thread of its own: the policy is per thread, so the test process is left untouched."""
    seen = {}

    def body():
        seen["problem"] = use_realtime(10)
        seen["rt"] = os.sched_getscheduler(0)
        seen["priority"] = os.sched_getparam(0).sched_priority
        use_normal()
        seen["after"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if seen["problem"] is not None:  # an unprivileged machine: the reason is reported, nothing changes
        assert "permission" in seen["problem"] and seen["rt"] == os.SCHED_OTHER
    else:
        assert seen["rt"] == os.SCHED_FIFO and seen["priority"] == 10
    assert seen["after"] == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the calling thread never changed


def test_priority_out_of_range_names_the_fix():
    with pytest.raises(ValueError, match=r"\[1, 99\]"):
        use_realtime(0)


def test_lock_memory_locks_the_whole_process_or_says_why():
    """In a child process, since a lock covers the whole process: afterwards its pages are locked
    (VmLck close to VmRSS), including memory allocated after the call."""
    code = (
        "from robot_bridge.scheduling import lock_memory\n"
        "problem = lock_memory()\n"
        "grown = bytearray(64 * 2**20)\n"
        "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
        "print(problem, int(status['VmLck'].split()[0]), int(status['VmRSS'].split()[0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    problem, locked_kb, rss_kb = " ".join(out[:-2]), int(out[-2]), int(out[-1])
    if problem != "None":  # an unprivileged machine: the reason names the fix, nothing is locked
        assert "memlock" in problem and locked_kb == 0
    else:
        assert locked_kb >= 0.9 * rss_kb and locked_kb > 64 * 1024  # the 64 MB allocated later is locked too
