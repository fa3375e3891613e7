"""Real-time scheduling of the control loop, and the inference worker's return to normal scheduling."""

import os
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
