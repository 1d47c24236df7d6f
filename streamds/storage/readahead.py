"""Read-ahead: the stored bytes a reader will read next, fetched by threads while it parses.

A reader's work is known from the plan, so its coming stored byte ranges are too: the spans
of its blocks, in order, across block and shard boundaries. `ReadAhead` cuts them into
pieces (up to MAX_PIECE bytes, never a line at a time) and keeps pieces in flight on a few
threads, never more than `budget` bytes fetched or in flight and not yet passed by the
reader. The reader's `RangeFile`s take pieces as they reach them (`take`); pieces the reader
has moved past are dropped. Bytes not fetched ahead (a retry that reopens behind, a line
crossing a block's end) are read directly, so what comes out never depends on what was
prefetched: only speed does. A fetch that fails after its retries raises in the reader when
it reaches that piece, never in a thread nobody waits on.

Closing stops the work: no fetch starts after `close`, pieces queued but not started are
dropped, and a fetch in progress is not retried (its request, already sent, is let finish:
a running HTTP request cannot be interrupted safely; a filesystem's own retries inside one
request, such as huggingface_hub's backoff, are its own).

Threads are daemons started per `ReadAhead` (one per reader and epoch, in the process that
reads), so nothing here crosses a fork or keeps a process from exiting.

By default (`wants_readahead`) it runs for remote URLs and for local paths on network and FUSE
mounts (a mounted Drive), not on local disks, whose kernel read-ahead already keeps up (there
the extra copies and threads only add cost; `benchmarks/remote_bench.py` reads local disk with
and without).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from ..retry import DEFAULT_RETRY, RetryPolicy
from .mounts import on_fuse_mount, on_remote_mount
from .ranges import RangeReader, stored_span
from .shard_cache import CLAIMS, ShardCacheSettings
from .shards import Shard, process_fs

__all__ = ["DEFAULT_READAHEAD", "ReadAhead", "Span", "block_span", "on_fuse",
           "wants_readahead"]

DEFAULT_READAHEAD = 32 << 20  # bytes fetched ahead per reader, by default
MAX_THREADS = 16  # requests in flight per reader: a slow mount serves each one at a time
MAX_PIECE = 4 << 20  # bytes per request: a quarter of the budget, within these bounds
MIN_PIECE = 64 << 10
# On a FUSE mount the kernel splits reads into requests of 128 KiB and, through the page cache,
# keeps at most `max_background` (12 by default) in flight whatever the threads: at 100 ms a
# request that is 15 MB/s. Reads that bypass the page cache (O_DIRECT) are one request in
# flight per thread, so there many threads each read small pieces.
FUSE_THREADS = 64
FUSE_PIECE = 256 << 10

Span = tuple[Shard, int, int]  # stored bytes [start, end) of a shard


def wants_readahead(shards: Iterable[Shard]) -> bool:
    """Whether any shard is remote (an fsspec URL) or on a network or FUSE mount."""
    from fsspec.implementations.local import LocalFileSystem

    local = []
    for shard in shards:
        if not isinstance(process_fs(shard.fs), LocalFileSystem):
            return True
        local.append(shard.path)
    return on_remote_mount(local)


def on_fuse(shards: Iterable[Shard]) -> bool:
    """Whether any shard is a local path on a FUSE mount (a mounted Drive)."""
    from fsspec.implementations.local import LocalFileSystem

    folders = {os.path.dirname(shard.path) for shard in shards
               if isinstance(process_fs(shard.fs), LocalFileSystem)}
    return on_fuse_mount(folders)


def block_span(shard: Shard, start: int, end: int | None, *, at_line: bool) -> Span | None:
    """The stored bytes a reader reads for positions [start, end) of a block of `shard`, as
    its format says (`Format.read_range`: formats read whole, the whole file); None when the
    file's size is unknown, or for a file read as one stream (`Shard.ranged` false: nothing
    can be fetched ahead by ranges). `at_line`: a record begins at `start` (a resume point)."""
    if not shard.ranged:
        return None
    decoded_start, decoded_end = shard.format.read_range(shard, start, end, at_line=at_line)
    first, _, last = stored_span(shard, decoded_start, decoded_end)
    return None if last is None else (shard, first, last)


def _holds(piece: tuple[Shard, int, int], shard: Shard, pos: int) -> bool:
    return piece[1] <= pos < piece[2] and piece[0].path == shard.path


@dataclass
class _Piece:
    shard: Shard
    start: int
    end: int
    future: Future[bytes]


class ReadAhead:
    """Pieces of `spans` fetched ahead of the reader, at most `budget` bytes at a time.

    `take(shard, pos)` gives the piece holding stored byte `pos` (waiting for it if it is in
    flight) or None when none was planned there; `reader` serves direct reads with the same
    descriptors and retry policy. With `fuse` (the spans are on a FUSE mount), reads bypass
    the page cache, in FUSE_PIECE pieces on FUSE_THREADS threads. Close it when the reader
    stops.
    """

    def __init__(
        self, spans: Iterable[Span], *, budget: int, retry: RetryPolicy = DEFAULT_RETRY,
        cache: ShardCacheSettings | None = None, threads: int = MAX_THREADS, fuse: bool = False,
    ) -> None:
        self._stop = threading.Event()  # set by close: no fetch starts or is retried after it
        self.reader = RangeReader(retry, cache, fuse_direct=fuse, stop=self._stop)
        self._caching = cache is not None
        largest = min(MAX_PIECE, max(MIN_PIECE, budget // 4))
        if fuse:
            threads, largest = FUSE_THREADS, min(largest, FUSE_PIECE)
        self._pieces = self._cut(iter(spans), largest)
        self._budget = budget
        self._next: tuple[Shard, int, int] | None = None  # cut, waiting for room in the budget
        self._ahead: deque[_Piece] = deque()
        self._held = 0  # bytes of the pieces in _ahead
        self._jobs: queue.SimpleQueue[_Piece | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._fetch_loop, name="streamds-readahead", daemon=True)
            for _ in range(threads)
        ]
        self._started = False
        self._closed = False

    @staticmethod
    def _cut(spans: Iterator[Span], largest: int) -> Iterator[tuple[Shard, int, int]]:
        """Pieces of the spans: the first MIN_PIECE bytes, each next one twice as large up
        to `largest`, so the first bytes arrive soon and later requests are large."""
        size = MIN_PIECE
        for shard, start, end in spans:
            at = start
            while at < end:
                yield shard, at, min(at + size, end)
                at += size
                size = min(largest, size * 2)

    def _fetch_loop(self) -> None:
        while (piece := self._jobs.get()) is not None:
            self._fetch(piece)
            del piece  # hold no piece while waiting for the next: the budget counts them all

    def _fetch(self, piece: _Piece) -> None:
        try:
            if self._stop.is_set() or not piece.future.set_running_or_notify_cancel():
                return
            try:
                data = self.reader.read(piece.shard, piece.start, piece.end)
            except BaseException as err:  # handed to the reader, raised where it waits
                piece.future.set_exception(err)
            else:
                piece.future.set_result(data)
        finally:
            if self._caching:
                CLAIMS.remove(piece.shard.path, piece.start, piece.end)

    def _fill(self) -> None:
        if not self._started:
            self._started = True
            for thread in self._threads:
                thread.start()
        while True:
            if self._next is None:
                self._next = next(self._pieces, None)
                if self._next is None:
                    return
            shard, start, end = self._next
            if self._ahead and self._held + (end - start) > self._budget:
                return
            self._next = None
            piece = _Piece(shard, start, end, Future())
            self._ahead.append(piece)
            self._held += end - start
            if self._caching:  # a copier of this shard leaves these bytes to us
                CLAIMS.add(shard.path, start, end)
            self._jobs.put(piece)

    def _drop_first(self) -> None:
        piece = self._ahead.popleft()
        piece.future.cancel()
        self._held -= piece.end - piece.start

    def _find(self, shard: Shard, pos: int) -> int | None:
        for index, piece in enumerate(self._ahead):
            if _holds((piece.shard, piece.start, piece.end), shard, pos):
                return index
        return None

    def take(self, shard: Shard, pos: int) -> tuple[int, bytes] | None:
        """(start, data) of the fetched piece holding stored byte `pos` of `shard`, or None.

        Pieces planned before it are dropped (the reader has moved past them); a fetch error
        of this piece is raised here.
        """
        if self._closed:
            return None
        if not self._started:
            self._fill()
        passed = self._find(shard, pos)  # pieces before the one holding `pos`: passed
        if passed is None:
            upcoming = self._next
            if upcoming is None or not _holds(upcoming, shard, pos):
                return None
            passed = len(self._ahead)  # the reader is past every fetched piece: make room
        for _ in range(passed):
            self._drop_first()
        self._fill()
        piece = self._ahead[0]
        try:
            data = piece.future.result()
        except BaseException:
            self._drop_first()
            self._fill()
            raise
        return piece.start, data

    def close(self) -> None:
        """Stop fetching: pieces not started are dropped, a fetch in progress is not retried;
        descriptors close once the requests in flight return."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        while self._ahead:
            self._drop_first()
        if not self._started:
            self.reader.close()
            return
        for _ in self._threads:
            self._jobs.put(None)
        threading.Thread(target=self._close_when_idle, name="streamds-readahead-close",
                         daemon=True).start()

    def _close_when_idle(self) -> None:
        for thread in self._threads:
            thread.join()
        self.reader.close()
