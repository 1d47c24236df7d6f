"""The commit queue: closed shards are journaled strictly in order, as soon as they are whole.

With ``--workers`` > 1 several shards compress at once in a thread pool and finish in any
order; the journal must still list them in order, each with where the input continues after
it. A shard is journaled as soon as it and every older shard are renamed, by whichever pool
thread finishes last, so a kill loses only shards still being written.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future

from streamds.formats.manifest import ShardEntry

from .conversion_counts import Counts
from .journal import Journal
from .sources import Position

__all__ = ["CommitQueue"]

ShardResult = ShardEntry | Future[ShardEntry | None]  # written now, or by a pool thread


class CommitQueue:
    """Shards closed but not yet journaled, oldest first.

    The main thread waits in `add` while `limit` shards are in flight. `written` counts the
    shards journaled through this queue.
    """

    def __init__(self, journal: Journal, limit: int) -> None:
        self.journal = journal
        self._limit = limit
        self._queue: deque[tuple[ShardResult, Position | None, Counts, int, tuple[str, ...]]] = (
            deque())
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.written = 0

    def add(self, result: ShardResult, next_position: Position | None, counts: Counts,
            stored_bytes: int, skipped: tuple[str, ...] = ()) -> None:
        with self._lock:
            self._queue.append((result, next_position, counts, stored_bytes, skipped))
        if isinstance(result, Future):
            result.add_done_callback(self._on_done)
        self.commit(wait_until=self._limit - 1)

    def _on_done(self, _: Future[ShardEntry | None]) -> None:
        try:
            self._journal_finished()
        except BaseException as err:  # raised in the main thread by the next commit()
            self._error = err

    def _journal_finished(self) -> None:
        """Journal the finished shards at the head of the queue; never waits for a shard."""
        with self._lock:
            while self._queue:
                result, next_position, counts, stored_bytes, skipped = self._queue[0]
                if isinstance(result, Future):
                    if not result.done() or result.exception() is not None:
                        return
                    entry = result.result()
                    assert entry is not None
                else:
                    entry = result
                self._queue.popleft()
                self.journal.add(entry, next_position, counts, stored_bytes, skipped)
                self.journal.write()
                self.written += 1

    def commit(self, wait_until: int = 0) -> None:
        """Journal finished shards; wait until at most `wait_until` remain unjournaled.

        Raises the error of a shard that failed to write.
        """
        while True:
            self._journal_finished()
            if self._error is not None:
                raise self._error
            with self._lock:
                if len(self._queue) <= wait_until:
                    return
                head = self._queue[0][0]
            if isinstance(head, Future):
                head.result()

    def abandon(self) -> None:
        """After a failure: journal what finishes cleanly, in order; drop the rest."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                head = self._queue[0][0]
            if isinstance(head, Future) and head.exception() is not None:  # waits for it
                with self._lock:
                    self._queue.clear()
                return
            self._journal_finished()
