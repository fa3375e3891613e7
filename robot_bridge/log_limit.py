"""At most one log line per cause per second, for faults that repeat with every message.

A sensor stuck at NaN, or a hostile client publishing at 40 Hz, would otherwise write one WARN
line per message (about 200 identical lines for a 5-second fault), burying everything else in
the log. The exact counts go to /diagnostics; the log only needs to say that a cause is active,
and how many lines like it were held back since it last said so. No ROS import here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class LogLimiter:
    """Passes a line to ``sink(level, line)`` unless a line of the same cause passed less than ``period_s`` ago.

    ``clock`` (seconds, monotonic) is injectable, so tests can decide what "a second later" is.
    """

    def __init__(
        self, sink: Callable[[str, str], None], period_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.sink = sink  # (level: "info" | "warning" | "error", line)
        self.period_s = period_s
        self.clock = clock
        self._last: dict[str, float] = {}  # cause -> clock() when its last line passed
        self._held: dict[str, int] = {}  # cause -> lines held back since then

    def __call__(self, cause: str, level: str, line: str) -> bool:
        """Log ``line`` for ``cause`` unless rate-limited; True when it was logged."""
        now = self.clock()
        last = self._last.get(cause, -math.inf)
        if now - last < self.period_s:
            self._held[cause] = self._held.get(cause, 0) + 1
            return False
        held = self._held.pop(cause, 0)
        self._last[cause] = now
        if held:
            line += f" ({held} more like it in the last {now - last:.1f} s)"
        self.sink(level, line)
        return True
