"""Reading small files ahead: many opens in flight, results in order, memory bounded in bytes.

`FilesAhead(items, fetch, ...)` yields ``(item, result)`` for every item, in the items' order;
for the items it `wants` it calls ``fetch(item)`` in up to `threads` threads ahead of the
consumer, and ``result()`` returns what it returned (or raises what it raised). Other items
come with ``None``: the consumer reads those itself (a big JSONL file streams).

Items are fetched in the consumer's thread, one at a time, until `SLOW_IN_A_ROW` fetches in a
row take longer than `SLOW_FETCH` (local disk does not, and threads there only contend for
the GIL); then `threads` threads take over.

Why folders: a network mount (Drive's FUSE, the testbed's) serialises name lookups within
one folder, so opens in one folder go about one per round trip however many are in flight,
while opens in different folders overlap. The threads therefore spread over the folders
ahead (`group`): each free thread takes the next file of the folder with the fewest reads in
flight, the folders the consumer reaches first winning ties. A folder whose next file lies
more than `threads` items past the consumer is only read while the results held (fetched,
not yet consumed) stay under `max_bytes`; files that near are always read, so the consumer
never waits on the budget. Memory: `max_bytes` plus one file per thread, plus a byte per
item and a queue entry per item up to `LOOKAHEAD` items ahead.

The output cannot depend on any of this: results come back strictly in item order.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Hashable, Iterator, Sequence
from itertools import islice
from typing import Generic, TypeVar

__all__ = ["LOOKAHEAD", "SLOW_FETCH", "SLOW_IN_A_ROW", "FilesAhead"]

T = TypeVar("T")
R = TypeVar("R")

LOOKAHEAD = 1 << 16  # items ahead of the consumer that may be scheduled
SLOW_FETCH = 0.002  # seconds: fetches slower than this (not local disk) start the threads...
SLOW_IN_A_ROW = 4  # ...when this many in a row are (one can be a busy machine's hiccup)


class _Outcome(Generic[R]):
    """A finished fetch: its value or its error, and the bytes it holds."""

    __slots__ = ("error", "size", "value")

    def __init__(self, value: R | None, error: BaseException | None, size: int) -> None:
        self.value = value
        self.error = error
        self.size = size

    def result(self) -> R:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class FilesAhead(Generic[T, R]):
    """Fetch `items` that `wants` says in threads, hand back every item in order.

    `group(item)` names its folder; `size(result)` the bytes a result holds in memory.
    `threads` 0: always one at a time. Threads (daemons) stop when iteration ends or the
    iterator is closed; a fetch under way then finishes and its result is dropped.
    """

    def __init__(
        self,
        items: Sequence[T],
        fetch: Callable[[T], R],
        *,
        wants: Callable[[T], bool],
        group: Callable[[T], Hashable],
        size: Callable[[R], int],
        threads: int,
        max_bytes: int,
    ) -> None:
        self.items = items
        self.fetch = fetch
        self.wants = wants
        self.group = group
        self.size = size
        self.threads = threads
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # idle threads wait here
        self._ready = threading.Condition(self._lock)  # the consumer waits here
        self._queues: dict[Hashable, deque[int]] = {}  # folder -> its unscheduled items
        self._flying: dict[Hashable, int] = {}  # folder -> fetches under way
        self._results: dict[int, _Outcome[R]] = {}
        self._held = 0  # bytes of results not yet consumed
        self._head = 0  # the item the consumer is at
        self._scanned = 0  # items before this one are in `_queues` (or not wanted)
        self._started = bytearray(len(items))  # 1: fetch started, or not wanted
        self._low = 0  # items before this one have started
        self._closed = False
        self.peak_held = 0  # the most bytes held at once (for tests and benchmarks)

    def __iter__(self) -> Iterator[tuple[T, _Outcome[R] | None]]:
        first = yield from self._one_at_a_time()
        if first < len(self.items):
            yield from self._pooled(first)

    def _one_at_a_time(self) -> Generator[tuple[T, _Outcome[R] | None], None, int]:
        """Fetch in this thread while fetches are fast; returns where the pool takes over."""
        slow = 0  # fetches in a row slower than SLOW_FETCH
        for index, item in enumerate(self.items):
            if self.threads > 0 and slow >= SLOW_IN_A_ROW:
                return index
            outcome = None
            if self.wants(item):
                began = time.perf_counter()
                try:
                    outcome = _Outcome(self.fetch(item), None, 0)
                except Exception as err:
                    outcome = _Outcome(None, err, 0)
                slow = slow + 1 if time.perf_counter() - began > SLOW_FETCH else 0
            yield item, outcome
        return len(self.items)

    def _pooled(self, first: int) -> Iterator[tuple[T, _Outcome[R] | None]]:
        with self._lock:
            self._head = self._scanned = self._low = first
        for n in range(self.threads):
            threading.Thread(target=self._run, name=f"streamds-read-{n}", daemon=True).start()
        try:
            for index in range(first, len(self.items)):
                item = self.items[index]
                with self._lock:
                    self._head = index
                    self._work.notify()  # the window moved: maybe more work
                    if not self.wants(item):
                        outcome = None
                    else:
                        while index not in self._results:
                            self._ready.wait()
                        outcome = self._results.pop(index)
                        self._held -= outcome.size
                yield item, outcome
        finally:
            with self._lock:
                self._closed = True
                self._results.clear()
                self._work.notify_all()

    # -- the threads -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                index = self._pick()
                while index is None and not self._closed:
                    self._work.wait()
                    index = self._pick()
                if self._closed:
                    return
                self._work.notify()  # pass the baton: another idle thread may find work too
            item = self.items[index]
            try:
                value: R | None = self.fetch(item)
                outcome = _Outcome(value, None, self.size(value))  # type: ignore[arg-type]
            except BaseException as err:  # handed to the consumer at this item
                outcome = _Outcome(None, err, 0)
            folder = self.group(item)
            with self._lock:
                self._flying[folder] -= 1
                if not self._flying[folder]:
                    del self._flying[folder]
                if self._closed:
                    return
                self._results[index] = outcome
                self._held += outcome.size
                self.peak_held = max(self.peak_held, self._held)
                if index == self._head:
                    self._ready.notify()

    def _scan(self) -> None:
        """Queue the wanted items up to `LOOKAHEAD` past the consumer by folder."""
        end = min(len(self.items), self._head + LOOKAHEAD)
        while self._scanned < end:
            item = self.items[self._scanned]
            if self.wants(item):
                self._queues.setdefault(self.group(item), deque()).append(self._scanned)
            else:
                self._started[self._scanned] = 1
            self._scanned += 1

    def _pick(self) -> int | None:
        """The next item to fetch, or None when none may start now (lock held).

        Candidates: the first `threads` folders queued and the folder of the earliest item
        not started; the one with the fewest fetches under way wins, then the earliest.
        """
        self._scan()
        while self._low < self._scanned and self._started[self._low]:
            self._low += 1
        candidates = list(islice(self._queues, self.threads))
        if self._low < self._scanned:
            candidates.append(self.group(self.items[self._low]))
        near = self._head + self.threads
        over = self._held >= self.max_bytes
        best: tuple[int, int] | None = None
        chosen: Hashable = None
        for folder in candidates:
            first = self._queues[folder][0]
            if over and first >= near:
                continue
            rank = (self._flying.get(folder, 0), first)
            if best is None or rank < best:
                best, chosen = rank, folder
        if best is None:
            return None
        queue = self._queues[chosen]
        index = queue.popleft()
        if not queue:
            del self._queues[chosen]
        self._started[index] = 1
        self._flying[chosen] = self._flying.get(chosen, 0) + 1
        return index
