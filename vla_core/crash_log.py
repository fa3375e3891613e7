"""Where a native crash's Python stacks go (`faulthandler`): the process's stderr, and while a run writes
into its output directory, a file there, so the stack is kept with the run it ended.

A segmentation fault in a C library (a renderer, a physics step) kills the process without a Python
traceback; `faulthandler` prints every thread's Python stack from the signal handler instead. It writes to
one file, so inside ``into(directory)`` it writes to ``directory / CRASH_LOG`` and the shell shows only
"Segmentation fault": the stack is in the run's folder. The file is removed when the run leaves without a
crash (it is empty then), and appended to, never replaced, so a resumed run keeps an earlier crash's stack.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from vla_core.files import process_file

CRASH_LOG = "native_crash.log"
# The signals a native crash raises: those faulthandler reports. A SIGKILL (the out-of-memory killer) or a SIGTERM
# ends a process too, but is no crash.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)


def exit_cause(returncode: int) -> str:
    """A child's end as words: the signal's name for a negative return code (``subprocess``'s), else the code."""
    return f"signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"


_files: list[IO[str]] = []  # the files faulthandler writes to, innermost last (a run inside a run)


def on_stderr() -> None:
    """Send a native crash's stacks to the process's own stderr (a caller that captured ``sys.stderr`` in
    memory has no file descriptor there)."""
    if sys.__stderr__ is not None:
        faulthandler.enable(file=sys.__stderr__, all_threads=True)


@contextlib.contextmanager
def into(directory: Path, process_index: int = 0) -> Iterator[Path]:
    """While inside, a native crash writes its stacks to ``directory / CRASH_LOG`` (a data-parallel run's
    other processes to their own, `vla_core.files.process_file`; the directory is made if missing: enter
    once the run has accepted its output directory); afterwards they go where they went before. Yields the
    file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / process_file(CRASH_LOG, process_index)
    on_before = faulthandler.is_enabled()  # the outermost: on stderr (a command) or off (a library call)
    log = open(path, "a")  # noqa: SIM115 - held open for the signal handler, closed below
    _files.append(log)
    faulthandler.enable(file=log, all_threads=True)
    try:
        yield path
    finally:
        _files.remove(log)
        if _files:
            faulthandler.enable(file=_files[-1], all_threads=True)
        else:
            faulthandler.disable()
            if on_before:
                on_stderr()
        log.close()
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_size == 0:
                path.unlink()
