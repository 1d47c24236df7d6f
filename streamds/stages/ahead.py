"""Ahead: a DataLoader worker makes its batches in a thread, a few ahead of the loader's requests.

A worker makes a batch only when the main process has asked for one, and the DataLoader asks
each worker for `prefetch_factor` (2) at a time. Where the main process and the workers take
turns on the CPUs, whenever the main process runs late, a worker with its 2 batches done sits
idle, and the CPU time it could have used is lost. A worker that keeps making batches ahead in
a thread uses that time, as a larger ``prefetch_factor`` would, without asking users to tune
the loader (`benchmarks/cpu_limits_bench.py` measures ``ahead=0`` against ``ahead=4``).
`MadeAhead` makes `depth` batches ahead, each kept with the state after it, so the state the
loader takes after a batch is the state after *that* batch, never after the ones made ahead
(a state taken after any batch still resumes exactly).

The thread runs the whole pipeline; the worker's own thread only hands batches over (and the
queue's feeder thread sends them), so the pipeline's Python work is never split across
threads. An error in the pipeline is raised where its batch would have been, after every batch
made before it. When the iterator is closed (a new epoch, the loader shut down) the thread
stops after the batch it is making and closes the pipeline. User code in the pipeline (map,
filter, collate) runs in that thread: thread-local torch settings made in a
`worker_init_fn` (grad mode, autocast) do not reach it; ``.batch(n, ahead=0)`` keeps it in the
worker's own thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["AHEAD", "MadeAhead"]

AHEAD = 4  # batches made ahead with ahead="auto", where workers and main processes share CPUs
_POLL = 0.5  # seconds a full queue is waited on before the thread checks whether to stop


class _Raised:
    """What the thread hands over in place of the next item when the pipeline raised."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _End:
    """What the thread hands over when the pipeline ran out: the state at the end (a batch
    stage may end without a batch after the last state: drop_last, a last full batch)."""

    def __init__(self, state: Any) -> None:
        self.state = state


class MadeAhead:
    """The items of `items`, made by a thread up to `depth` ahead of the consumer.

    `state_after()` is called in the thread after each item is made and once the items ran
    out; `state` is the value it returned for the last item handed out (`state_at_start`
    before the first; the state at the end once the consumer met the end).
    """

    def __init__(self, items: Iterable[Any], depth: int, state_after: Callable[[], Any],
                 state_at_start: Any) -> None:
        self.items = items
        self.depth = depth
        self.state_after = state_after
        self.state = state_at_start

    def __iter__(self) -> Iterator[Any]:
        made: queue.Queue[Any] = queue.Queue(self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._make, args=(made, stop), daemon=True,
                                  name="streamds-batches-ahead")
        thread.start()
        try:
            while True:
                entry = made.get()
                if entry.__class__ is _End:
                    self.state = entry.state
                    return
                if entry.__class__ is _Raised:
                    raise entry.error
                item, self.state = entry
                yield item
        finally:  # the thread stops after the item it is making (a waiting put polls)
            stop.set()

    def _make(self, made: queue.Queue[Any], stop: threading.Event) -> None:
        def hand_over(entry: Any) -> bool:
            while not stop.is_set():
                try:
                    made.put(entry, timeout=_POLL)
                    return True
                except queue.Full:
                    continue
            return False

        items = None
        try:
            items = iter(self.items)
            for item in items:
                if stop.is_set() or not hand_over((item, self.state_after())):
                    return
            hand_over(_End(self.state_after()))
        except BaseException as error:  # raised in the consumer, in order
            hand_over(_Raised(error))
        finally:
            close = getattr(items, "close", None)
            if close is not None:  # the pipeline's generators clean up in this thread
                close()
