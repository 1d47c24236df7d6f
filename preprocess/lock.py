"""One conversion at a time per output folder: an advisory lock, and who holds it.

A conversion into a folder deletes what its journal does not list (a killed run's half
shards) and renames its own temporary files there, so a second run into the same folder
would delete the first one's work or fail on its renames. `output_lock` takes an exclusive
`flock` on ``.streamds-convert.lock`` (hidden, so readers skip it) for the whole run, and
writes who holds it (process, host, start time: no arguments, they may hold credentials);
a second run is refused at once (`OutputBusyError`) naming the holder. The run removes the
file as it ends; the lock goes with its process, so a killed run never blocks the rerun.
Parts lock their own folders, so the parts of one conversion still run at once. Where
`fcntl` is missing, nothing is locked.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from streamds.storage.locks import fcntl, try_lock

from .errors import ConversionError

__all__ = ["LOCK_NAME", "OutputBusyError", "output_lock"]

LOCK_NAME = ".streamds-convert.lock"


class OutputBusyError(ConversionError):
    """Another conversion is running into the same output folder."""


@contextlib.contextmanager
def output_lock(directory: Path) -> Iterator[None]:
    """Hold `directory`'s conversion lock while the block runs; OutputBusyError at once when
    another process (or another run in this one) holds it."""
    if fcntl is None:
        yield
        return
    path = directory / LOCK_NAME
    fd = _locked(path)
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n"
                  .encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # while still held: the next run makes a new one
        os.close(fd)  # releases the lock


def _locked(path: Path) -> int:
    """A descriptor of `path` holding its exclusive lock; OutputBusyError when held.

    A lock file is removed by its holder as it finishes; a run that opened it just before
    would lock a file no longer there, so the lock counts only while `path` still names the
    file locked (else open again)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not try_lock(fd, fcntl.LOCK_EX):
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                raise OutputBusyError(
                    f"{path.parent} is being converted by another run ({holder or 'starting'}); "
                    "two conversions into one folder would delete or overwrite each other's "
                    "shards. Wait for it to finish (or stop it, then rerun the same command to "
                    "resume), or convert into another directory"
                )
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
