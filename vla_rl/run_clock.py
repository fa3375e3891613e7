"""The wall minutes a resumable benchmark (or one of its runs) has taken, over every process that worked on it.

A benchmark killed and resumed runs in several processes; the time since the last one started leaves the earlier
ones out. `RunClock` keeps each process's seconds in one JSON file, under a key of its own (its start time and
pid), refreshed by a daemon thread every ``every_s`` seconds and whenever `minutes` is read, so a process killed
without warning loses at most ``every_s`` seconds of the count.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from vla_core.files import write_text_atomic


class RunClock:
    """Minutes spent on the work whose clock file is ``path``, by this process and every earlier one."""

    def __init__(self, path: str | Path, every_s: float = 30.0):
        self.path = Path(path)
        self._key = f"{time.time():.6f}-{os.getpid()}"
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._save()
        threading.Thread(target=self._beat, args=(every_s,), daemon=True, name="run-clock").start()

    def _beat(self, every_s: float) -> None:
        while not self._stopped.wait(every_s):
            self._save()

    def _save(self) -> dict[str, float]:
        with self._lock:
            seconds = json.loads(self.path.read_text()) if self.path.is_file() else {}
            seconds[self._key] = round(time.monotonic() - self._start, 3)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(seconds, indent=1))
            return seconds

    def minutes(self) -> float:
        """Minutes over every process so far (this one up to now), rounded to 0.01."""
        return round(sum(self._save().values()) / 60, 2)

    def stop(self) -> float:
        """The final count (`minutes`); the clock stops refreshing."""
        self._stopped.set()
        return self.minutes()
