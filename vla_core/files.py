"""Result files written atomically: a reader (or a killed run) never sees half a file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vla_core import interrupt


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``."""
    tmp = temporary_beside(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def process_file(name: str, process_index: int) -> str:
    """The file ``name`` of a data-parallel run's process ``process_index``: the first process's is ``name``
    itself, process k's ``<stem>.process<k><suffix>`` (``ray_timeline.process1.json``)."""
    if process_index == 0:
        return name
    stem, dot, suffix = name.partition(".")
    return f"{stem}.process{process_index}{dot}{suffix}"


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, flushed to the disk, then rename it over ``path``."""
    tmp = temporary_beside(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def temporary_beside(path: str | Path) -> Path:
    """A temporary name beside ``path`` (same suffix, so writers that go by it still work); rename it over after."""
    path = Path(path)
    return path.with_name(f".tmp-{os.getpid()}-{path.name}")


def replace_directory(finished: Path, target: Path) -> None:
    """Move the complete directory ``finished`` to ``target``, replacing what is there.

    The old ``target`` is renamed aside before the new one moves in and is removed only after, so
    ``target`` is never a mix of the two; a stop signal meanwhile is acted on after the swap.
    """
    with interrupt.deferred():
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
            os.rename(finished, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(finished, target)
