"""Real-time scheduling of the control loop, and the inference worker's return to normal scheduling."""

import os
import subprocess
import sys
import threading
from functools import partial

import pytest

from robot_bridge.inference import InferenceWorker
from robot_bridge.scheduling import normal_scheduling, use_normal, use_realtime

PRINT_CHILD_SCHEDULER = [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"]


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


def in_realtime_thread(body):
    """Run ``body`` in a thread of its own at SCHED_FIFO 10 (the test process is left untouched);
    returns what body returned, or None where real-time scheduling is refused."""
    seen = {}

    def run():
        if use_realtime(10) is None:
            seen["value"] = body()
            use_normal()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen.get("value")


def test_a_process_started_under_normal_scheduling_does_not_inherit_realtime():
    """A child inherits SCHED_FIFO at fork (the control of the check), but not inside the block;
    afterwards the thread has its policy and priority back."""

    def body():
        inherited = int(subprocess.run(PRINT_CHILD_SCHEDULER, capture_output=True, text=True, check=True).stdout)
        with normal_scheduling():
            inside = os.sched_getscheduler(0)
            started = int(subprocess.run(PRINT_CHILD_SCHEDULER, capture_output=True, text=True, check=True).stdout)
        return inherited, inside, started, os.sched_getscheduler(0), os.sched_getparam(0).sched_priority

    seen = in_realtime_thread(body)
    if seen is None:  # an unprivileged machine: nothing to give back
        with normal_scheduling():
            assert os.sched_getscheduler(0) == os.SCHED_OTHER
        return
    assert seen == (os.SCHED_FIFO, os.SCHED_OTHER, os.SCHED_OTHER, os.SCHED_FIFO, 10)


def test_inference_worker_process_starts_without_the_control_loops_realtime_policy():
    """The worker process is looked at right after it starts, while it is still importing (torch,
    the policy code): it must already be on normal scheduling, or it would hold the control
    loop's core at the same FIFO priority for as long as its imports take."""

    def body():
        # The loader fails (int("...") raises): the worker reports it and waits to retry; only its start matters.
        worker = InferenceWorker(partial(int, "not a policy"), mode="process", load_retry_s=60.0)
        try:
            return os.sched_getscheduler(worker._runner.pid), os.sched_getscheduler(0)
        finally:
            worker.close()

    seen = in_realtime_thread(body)
    if seen is not None:  # else an unprivileged machine, where nothing runs real-time to inherit from
        assert seen == (os.SCHED_OTHER, os.SCHED_FIFO)


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
