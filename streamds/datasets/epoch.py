"""`SharedEpoch`: the epoch a dataset and its copies share, with its DataLoader workers too."""

from __future__ import annotations

import multiprocessing
from typing import Any

__all__ = ["SharedEpoch"]


class SharedEpoch:
    """The epoch of a dataset and of every copy derived from it (`map`, `filter`, `batch`,
    `pack`, `with_resume`, `resume_after_batches`): `set_epoch` on any of them reaches them
    all, so a loader over ``base.map(f)`` follows ``base.set_epoch(e)``. `loaded`: a state
    loaded into one of them in the middle of its epoch, until its iterator starts (the
    epoch may not change under it).

    The value lives in shared memory (a multiprocessing RawValue), which DataLoader workers
    share with the main process (forked, or handed over while they are spawned): a worker
    reads it when each of its iterators starts, so `set_epoch` before an epoch's loop reaches
    persistent workers too (torch starts every epoch's iterator in the same workers). Any
    other pickle or deep copy takes the number and has an epoch of its own."""

    __slots__ = ("_shared", "loaded")

    def __init__(self, value: int) -> None:
        self._shared = multiprocessing.RawValue("q", value)
        self.loaded: Any = None  # a ReaderState (stages.state)

    @property
    def value(self) -> int:
        return int(self._shared.value)

    @value.setter
    def value(self, value: int) -> None:
        self._shared.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        if multiprocessing.context.get_spawning_popen() is not None:  # a worker starting
            return _shared_epoch, (self._shared, self.loaded)
        return _own_epoch, (self.value, self.loaded)


def _shared_epoch(shared: Any, loaded: Any) -> SharedEpoch:
    epoch = SharedEpoch.__new__(SharedEpoch)
    epoch._shared, epoch.loaded = shared, loaded
    return epoch


def _own_epoch(value: int, loaded: Any) -> SharedEpoch:
    epoch = SharedEpoch(value)
    epoch.loaded = loaded
    return epoch
