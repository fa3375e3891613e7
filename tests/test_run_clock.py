"""`vla_rl.bench_stages.RunClock`: a resumed benchmark's minutes count every process that worked on it."""

import json
import os
import signal
import subprocess
import sys
import time

from vla_rl.bench_stages import RunClock


def test_a_clock_adds_the_seconds_of_the_processes_before_it(tmp_path):
    """Two earlier processes left 90 s and 30 s: a new clock's count is 2 minutes plus its own few seconds, and its
    own entry is added beside theirs, which stay as they were."""
    path = tmp_path / "run_clock.json"
    path.write_text(json.dumps({"first": 90.0, "second": 30.0}))
    clock = RunClock(path)
    minutes = clock.stop()
    assert 2.0 <= minutes < 2.1
    saved = json.loads(path.read_text())
    assert saved["first"] == 90.0 and saved["second"] == 30.0 and len(saved) == 3


def test_a_process_killed_without_warning_keeps_what_its_heartbeat_saved(tmp_path):
    """A process killed by SIGKILL runs no exit code; its heartbeat (every 0.1 s here) already wrote its seconds,
    so the next process's count includes them."""
    path = tmp_path / "run_clock.json"
    code = (
        f"from vla_rl.bench_stages import RunClock; import time; RunClock({str(path)!r}, every_s=0.1); time.sleep(600)"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline, seconds = time.monotonic() + 120, 0.0
        while seconds < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
            if path.is_file():
                seconds = max(json.loads(path.read_text()).values())
        assert seconds >= 0.5, "the child's heartbeat never wrote half a second"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    before = json.loads(path.read_text())
    assert len(before) == 1
    clock = RunClock(path)
    assert clock.stop() * 60 >= sum(before.values()) >= 0.5
