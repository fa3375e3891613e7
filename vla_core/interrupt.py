"""Clean stops on SIGINT and SIGTERM, whatever signal disposition the process inherited.

Two ways a run gets stopped would otherwise go wrong:

- a process started with ``&`` by a non-interactive shell (a script, a batch job) inherits
  SIGINT as *ignored*, so Python never raises ``KeyboardInterrupt`` and Ctrl-C or ``kill -INT``
  does nothing;
- schedulers and container runtimes stop a job with SIGTERM, which Python does not handle at
  all: the process dies on the spot, in the middle of whatever it was writing.

Every ``vla-rl`` command therefore installs its own handlers for both signals (:func:`handlers`).
A signal then does one of two things:

- outside a :func:`deferred` block it raises :class:`Interrupted` at once, as Ctrl-C normally does;
- inside one (a training step, a checkpoint write, a recorded episode) it is only noted, and the
  loop stops at its next :func:`raise_if_stopped`, i.e. at a step boundary, where its state is whole.

Either way the command exits with ``128 + signal number`` (130 for SIGINT, 143 for SIGTERM), as
shells and schedulers expect. A run stuck inside one step still yields to SIGKILL; checkpoints
and datasets are written atomically, so even that loses only the work since the last save.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop signal ended the run. A ``KeyboardInterrupt``, so code that cleans up on Ctrl-C cleans up here too."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_received: int | None = None  # the first stop signal of this run
_defer_depth = 0  # > 0 while inside deferred(): signals are noted, not raised


def _on_signal(signum: int, frame) -> None:
    global _received
    if _received is None:
        _received = signum
    if _defer_depth == 0:
        raise Interrupted(signum)


def received() -> int | None:
    """The stop signal received since :func:`handlers` was entered, or None."""
    return _received


def raise_if_stopped() -> None:
    """Raise :class:`Interrupted` if a stop signal arrived: call it at step boundaries."""
    if _received is not None:
        raise Interrupted(_received)


@contextlib.contextmanager
def handlers() -> Iterator[None]:
    """Own SIGINT and SIGTERM for the block, whatever was inherited; restore the previous handlers after.

    Outside the main thread (where Python cannot set handlers) this does nothing.
    """
    global _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS}
    _received = None
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Give SIGINT's and SIGTERM's handlers back after the block, whatever it installed (``ray.init``
    installs its own SIGTERM handler and leaves it behind). Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within the block a stop signal only takes note; the block's loop calls :func:`raise_if_stopped`.

    Installs the handlers itself where none are (a library call of ``train()``, say), so SIGTERM
    ends such a run at a step boundary too. On leaving the block normally a noted signal is raised,
    so it is never lost.
    """
    global _defer_depth
    own = signal.getsignal(signal.SIGINT) is not _on_signal
    with handlers() if own else contextlib.nullcontext():
        _defer_depth += 1
        try:
            yield
        finally:
            _defer_depth -= 1
        raise_if_stopped()
