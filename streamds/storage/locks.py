"""Advisory file locks shared by the processes of one machine (`fcntl.flock`), for the two
local caches (`cache`: shard copies; `records_cache`: stored records).

A lock is held on a descriptor of a ``.lock`` file beside what it guards: shared while a file
is in use, exclusive while it is written or removed. Nothing waits: a process that does not
get a lock at once does something else (reads the source, computes the records), so a dead
or slow process never stalls another; a dead process's lock goes with it.
"""

from __future__ import annotations

import errno
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: the caches refuse to open, everything else works
    fcntl = None  # type: ignore[assignment]

__all__ = ["fcntl", "remove_if_unused", "try_lock"]


def try_lock(fd: int, kind: int) -> bool:
    """Take `kind` (fcntl.LOCK_SH or LOCK_EX) on `fd` without waiting: False if held."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def remove_if_unused(path: Path, lock: int) -> bool:
    """Remove `path` if nobody else holds its lock (`lock`: our descriptor of it)."""
    if not try_lock(lock, fcntl.LOCK_EX):
        return False
    try:
        path.unlink(missing_ok=True)
        return True
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
