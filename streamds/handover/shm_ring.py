"""Shared-memory hand-over: batch payloads from a DataLoader worker to the main process,
past the pipe.

A worker's result crosses a pipe: its queue's feeder thread writes the pickled batch in pieces
of the pipe's size (64 KiB) and the main process reads them back, with a wake-up for each
piece, on a machine where the main process and the workers share few cores. Here a worker
writes a batch's payload (its records, marshalled) into a ring of shared memory it owns and
only a descriptor of ~100 bytes crosses the pipe; the main process builds the records straight
from the shared pages, then marks their space free.

The ring: one file in /dev/shm per worker process, made on its first payload and sized from
it (and from the free space there, which the other workers and torch's own tensors need too):
``[consumed: u64 | pad to 64 | entries]``, an entry ``[seq: u64 | length: u64 | payload]``
at position % size, never split across the end. Positions only grow. Only the reader writes
`consumed` (the end of the last entry it has read), and the writer writes only where the
reader is done, so an entry is never overwritten before it is read. The writer never waits: a
payload larger than half the ring, or one that does not fit in the free space, or any payload
where shared memory cannot be had (no /dev/shm, no space left there), crosses the pipe as
before (`put` returns None). The reader takes a ring's entries in the order they were written
(one worker's messages arrive in order); an entry may be skipped (unpickled elsewhere, or
never), but one older than the last taken raises instead of yielding records that may have
been overwritten: every entry newer than the last taken lies where the writer does not write.
An entry unpickled in the process that wrote it (a copy made in the worker) is read there
without touching the ring.

Files: the reader unlinks a ring's file when it first maps it; the writer unlinks it at exit if
no reader did (a worker killed before its first batch was read leaves one behind). A reader
unmaps a ring once its worker has exited and another ring is mapped.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Callable
from multiprocessing import util
from typing import NamedTuple, TypeVar

from torch.utils.data import get_worker_info

__all__ = ["Entry", "RingReader", "RingWriter", "batches_taken", "put", "take"]

T = TypeVar("T")
log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MIN_SIZE = 4 << 20  # bytes of entries in a ring, at least
MAX_SIZE = 64 << 20  # ... and at most; a ring is sized to 8 of its first payloads
SHM_SHARE = 4  # ... and to at most 1 / (SHM_SHARE x workers) of the free space in SHM_DIR
RESERVE_STEP = 1 << 20  # a ring's memory is reserved this much at a time, as entries reach it
DATA = 64  # entries start here, after `consumed`
_CONSUMED = struct.Struct("<Q")
_HEADER = struct.Struct("<QQ")  # seq, length


class Entry(NamedTuple):
    """What crosses the pipe for one payload in a ring."""

    name: str  # the ring's file in SHM_DIR
    pid: int  # the writer's process
    seq: int  # 1, 2, ... per ring
    start: int  # position of the entry's header
    end: int  # position after it (aligned to 64)
    length: int  # payload bytes


def _aligned(n: int) -> int:
    return (n + DATA - 1) // DATA * DATA


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # the reader took it
        os.unlink(path)


class RingWriter:
    """The writing end, in a worker process: `put(payload)` -> an `Entry`, or None (send the
    payload some other way)."""

    def __init__(self, size: int, shm_dir: str | None = None) -> None:
        self.pid = os.getpid()
        self.name = f"streamds-{self.pid}-{secrets.token_hex(6)}"
        self.size = size
        path = os.path.join(shm_dir or SHM_DIR, self.name)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self.fd, DATA + size)  # its length; memory is reserved as entries come
            os.posix_fallocate(self.fd, 0, DATA)  # `consumed`; no space: OSError now
            self.map = mmap.mmap(self.fd, DATA + size)
        except BaseException:
            os.close(self.fd)
            os.unlink(path)
            raise
        util.Finalize(self, _unlink_quietly, args=(path,), exitpriority=0)
        self.reserved = 0  # bytes of entries backed by memory
        self.head = 0  # position after the last entry written
        self.seq = 0

    def _reserve(self, upto: int) -> bool:
        """Back the entries up to `upto` with memory before they are written, RESERVE_STEP at a
        time (writing to pages of a full /dev/shm that were never reserved is a SIGBUS; this
        is an OSError); False: no space left."""
        new = min(self.size, -(-upto // RESERVE_STEP) * RESERVE_STEP)
        try:
            os.posix_fallocate(self.fd, DATA + self.reserved, new - self.reserved)
        except OSError as err:
            log.debug("no space for more of the shared-memory ring (%s); the pipe it is", err)
            return False
        self.reserved = new
        return True

    def put(self, *pieces: bytes | memoryview) -> Entry | None:
        """The pieces, one after another, as one entry."""
        views = [memoryview(piece).cast("B") for piece in pieces]
        length = sum(view.nbytes for view in views)
        need = _aligned(_HEADER.size + length)
        if need > self.size // 2:
            return None
        start = self.head
        offset = start % self.size
        if offset + need > self.size:  # would cross the end: start over at the beginning
            start += self.size - offset
            offset = 0
        end = start + need
        (consumed,) = _CONSUMED.unpack_from(self.map, 0)
        if end - consumed > self.size:  # would overwrite entries not read yet
            return None
        if offset + need > self.reserved and not self._reserve(offset + need):
            return None
        self.seq += 1
        at = DATA + offset
        _HEADER.pack_into(self.map, at, self.seq, length)
        at += _HEADER.size
        for view in views:
            self.map[at : at + view.nbytes] = view
            at += view.nbytes
        self.head = end
        return Entry(self.name, self.pid, self.seq, start, end, length)

    def peek(self, entry: Entry, build: Callable[[memoryview], T]) -> T:
        """`build` of an entry's payload, leaving the ring as it is (for the writing process
        itself). Its space is safe while the reader has not passed it."""
        (consumed,) = _CONSUMED.unpack_from(self.map, 0)
        if entry.start < consumed:
            raise RuntimeError(
                f"batch {entry.seq} was pickled in DataLoader worker {self.pid} and unpickled "
                "there after later batches had reached the main process: its space in shared "
                "memory may have been reused; unpickle a batch before yielding the next")
        at = DATA + entry.start % self.size + _HEADER.size
        with memoryview(self.map) as whole, whole[at : at + entry.length] as payload:
            return build(payload)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class RingReader:
    """The reading end, in the main process: `take(entry, build)` -> build(payload view)."""

    def __init__(self, name: str, pid: int, shm_dir: str | None = None) -> None:
        path = os.path.join(shm_dir or SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as err:
            raise RuntimeError(
                f"the shared-memory ring {path} of DataLoader worker {pid} is gone before its "
                "first batch was read: was the batch unpickled in a second process, or the "
                "worker's /dev/shm file removed?") from err
        try:
            self.map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        _unlink_quietly(path)  # mapped here and in the writer: the file is no longer needed
        self.name = name
        self.pid = pid
        self.size = len(self.map) - DATA
        self.seq = 0  # the last entry taken

    def take(self, entry: Entry, build: Callable[[memoryview], T]) -> T:
        if entry.seq <= self.seq:
            raise RuntimeError(
                f"batch {entry.seq} of DataLoader worker {self.pid} arrived after batch "
                f"{self.seq}: a batch in shared memory was read twice or out of order "
                "(unpickled twice?), and its space may have been reused")
        at = DATA + entry.start % self.size
        if _HEADER.unpack_from(self.map, at) != (entry.seq, entry.length):
            raise RuntimeError(
                f"batch {entry.seq} of DataLoader worker {self.pid} was overwritten in shared "
                "memory before it was read")
        with memoryview(self.map) as whole:
            payload = whole[at + _HEADER.size : at + _HEADER.size + entry.length]
            try:
                value = build(payload)
            finally:
                payload.release()
        self.seq = entry.seq
        _CONSUMED.pack_into(self.map, 0, entry.end)  # the writer may reuse the space now
        return value

    def close(self) -> None:
        self.map.close()


# -- one writer per worker process, one reader per ring in the main process ----------------

_lock = threading.Lock()
_writer: RingWriter | None = None
_writer_pid = 0  # the process `_writer` was made in (None there: no shared memory to be had)
_readers: dict[str, RingReader] = {}
_taken = 0  # entries taken in this process


def _after_fork_in_child() -> None:
    """A fork (a DataLoader starting workers) may happen while another thread holds the lock
    (a pin-memory thread reading a batch): the child starts with its own, and no readers."""
    global _lock, _readers
    _lock = threading.Lock()
    _readers = {}


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _ring_size(payload: int, budget: int | None = None) -> int:
    """Bytes of entries for a ring whose first payload has `payload` bytes: room for 8 such,
    within [MIN_SIZE, MAX_SIZE] and at most `budget`; 0 when the budget is too small."""
    size = MIN_SIZE
    while size < 8 * payload and size < MAX_SIZE:
        size *= 2
    if budget is not None and size > budget:
        while size > budget:
            size //= 2
        if size < 2 * _aligned(_HEADER.size + payload):  # not even the first one would fit
            return 0
    return size


def _budget() -> int | None:
    """Bytes this worker's ring may take: a share of the free space in SHM_DIR, which the
    other workers' rings and torch's own hand-over of tensors need too (a container's
    /dev/shm is often 64 MB); None: SHM_DIR cannot be asked (`_new_writer` will say why)."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return None
    info = get_worker_info()
    workers = 1 if info is None else info.num_workers
    return stat.f_bavail * stat.f_frsize // (SHM_SHARE * workers)


def put(*pieces: bytes | memoryview) -> Entry | None:
    """Write the pieces (bytes-like), one after another, as one entry of this process's ring
    (made on the first call); None: send them some other way (too big, ring full, or no
    shared memory here)."""
    global _writer, _writer_pid
    pid = os.getpid()
    with _lock:
        if _writer_pid != pid:  # first call in this process (or in a fork of it)
            first = sum(memoryview(piece).nbytes for piece in pieces)
            _writer, _writer_pid = _new_writer(_ring_size(first, _budget())), pid
        return None if _writer is None else _writer.put(*pieces)


def _new_writer(size: int) -> RingWriter | None:
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows: no /dev/shm either
        return None
    if size == 0:
        log.debug("too little free space in %s for a ring; batches cross the pipe", SHM_DIR)
        return None
    try:
        return RingWriter(size)
    except OSError as err:  # no /dev/shm, or no space left in it: the pipe it is
        log.debug("no shared-memory ring for batches (%s); they cross the pipe", err)
        return None


def take(entry: Entry, build: Callable[[memoryview], T]) -> T:
    """`build` applied to the payload of `entry`, read where the writer put it."""
    global _taken
    with _lock:
        if entry.pid == os.getpid() and _writer is not None and _writer.name == entry.name:
            return _writer.peek(entry, build)  # pickled and unpickled in the worker itself
        reader = _readers.get(entry.name)
        if reader is None:
            _close_exited()
            reader = _readers[entry.name] = RingReader(entry.name, entry.pid)
        value = reader.take(entry, build)
        _taken += 1
    return value


def _close_exited() -> None:
    for name, reader in list(_readers.items()):
        if not _alive(reader.pid):
            reader.close()
            del _readers[name]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def batches_taken() -> int:
    """Payloads this process has read from rings (for tests and benchmarks)."""
    return _taken
