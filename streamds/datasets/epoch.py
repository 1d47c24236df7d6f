"""`SharedEpoch`: the epoch a dataset and its copies share, with its forked DataLoader workers
too."""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

__all__ = ["SharedEpoch"]

_INT = struct.Struct("q")


class SharedEpoch:
    """The epoch of a dataset and of every copy derived from it (`map`, `filter`, `batch`,
    `pack`, `with_resume`, `resume_after_batches`): `set_epoch` on any of them reaches them
    all, so a loader over ``base.map(f)`` follows ``base.set_epoch(e)``. `loaded`: a state
    loaded into one of them in the middle of its epoch, until its iterator starts (the
    epoch may not change under it).

    The value lives in an anonymous shared memory map, which forked DataLoader workers share
    with the main process: a worker reads it when each of its iterators starts, so
    `set_epoch` before an epoch's loop reaches persistent workers too (torch starts every
    epoch's iterator in the same workers). A pickle (spawned workers, a saved copy) and a
    deep copy take the number: spawned persistent workers keep the epoch they started with
    (a worker that starts the same shuffled epoch twice warns). No finalizer and no file
    descriptor: the map is freed with the object (multiprocessing's shared values free
    theirs in a finalizer that fails in a forked child)."""

    __slots__ = ("_owner", "_shared", "loaded")

    def __init__(self, value: int) -> None:
        self._shared = mmap.mmap(-1, _INT.size)  # MAP_SHARED: forked children see writes
        self._owner = os.getpid()
        self.value = value
        self.loaded: Any = None  # a ReaderState (stages.state)

    @property
    def value(self) -> int:
        return int(_INT.unpack_from(self._shared)[0])

    @value.setter
    def value(self, value: int) -> None:
        # the main process's epoch reaches its workers, never the other way: a worker that
        # sets an epoch (a Mix sets its sources' in each worker) gets a map of its own first
        if os.getpid() != self._owner:
            self._shared, self._owner = mmap.mmap(-1, _INT.size), os.getpid()
        _INT.pack_into(self._shared, 0, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return _own_epoch, (self.value, self.loaded)


def _own_epoch(value: int, loaded: Any) -> SharedEpoch:
    epoch = SharedEpoch(value)
    epoch.loaded = loaded
    return epoch
