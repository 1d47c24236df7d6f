"""`PoolStage`: any re-iterable source -> batches, cut from pools of `pool_size` records.

The stage behind ``Mix.batch`` and ``Packed.batch`` (`streamds.datasets.batching.Batched`):
it reads its source `pool_size` records at a time, has `cut` turn the pool's lengths into
batches (lists of pool indices) with the generator of that pool, and yields
``collate(records)`` for each. Every record lands in exactly one batch.

State node (``get_state()``; the top of a saved state also carries the format)::

    {"stage": "batches", "config": [...], "epoch": e, "finished": bool,
     "pool": k,          # pools finished before the current one
     "emitted": j,       # batches of the current pool already yielded
     "consumed": n,      # source records read before the current pool
     "source": <the source's node where the current pool began> | None}

O(1) integers plus the source's state, never records: a resume re-reads that pool and skips
the batches already yielded. A source without `state_dict()` (a list) is fast-forwarded by
record count instead.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

from ..errors import StateMismatchError
from .state import FORMAT, check_node, nested, unnested
from .state import STAGE as STAGE_KEY

__all__ = ["PoolStage", "stateful"]

Cut = Callable[[list[int], random.Random], list[list[int]]]


def stateful(source: Any) -> bool:
    """Whether `source` can say and load where it stands."""
    return callable(getattr(source, "state_dict", None)) and callable(
        getattr(source, "load_state_dict", None))


class PoolStage:
    """Stage: batches cut from pools of `source` (see the module doc). `rng(epoch, pool)`
    makes the generator of a pool; `on_batch(lengths)` sees each batch's lengths."""

    STAGE = "batches"
    CONFIG = "config"
    EPOCH = "epoch"
    FINISHED = "finished"
    POOL = "pool"
    EMITTED = "emitted"
    CONSUMED = "consumed"
    SOURCE = "source"
    KEYS = frozenset((FORMAT, STAGE_KEY, CONFIG, EPOCH, FINISHED, POOL, EMITTED, CONSUMED,
                      SOURCE))

    def __init__(
        self, source: Iterable[Any], *, config: list[Any], pool_size: int,
        measure: Callable[[Any], int], cut: Cut, rng: Callable[[int, int], random.Random],
        collate: Callable[[list[Any]], Any], epoch: int,
        on_batch: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.source = source
        self.config = config
        self.pool_size = pool_size
        self.measure = measure
        self.cut = cut
        self.rng = rng
        self.collate = collate
        self.on_batch = on_batch
        self.epoch = epoch
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        """Start over at `state` (a node `get_state` made, strictly checked; None: the start
        of this stage's epoch)."""
        self.pool = 0
        self.emitted = 0
        self.consumed = 0
        self.start: Any = None  # the source's node where the current pool begins
        self.finished = False
        if state is not None:
            self.check(state, self.config)
            self.epoch, self.finished = state[self.EPOCH], state[self.FINISHED]
            self.pool, self.emitted = state[self.POOL], state[self.EMITTED]
            self.consumed, self.start = state[self.CONSUMED], state[self.SOURCE]
        self._count: int | None = None  # batches the current pool holds, once cut
        self._next_consumed = 0
        self._next_start: Any = None  # the source's node after the current pool

    @classmethod
    def check(cls, state: dict[str, Any], config: list[Any]) -> None:
        """Strict: a node of this stage, taken from a batcher configured as `config`."""
        check_node(state, cls.STAGE, cls.KEYS, "batcher")
        if state[cls.CONFIG] != config:
            raise StateMismatchError(
                f"the state was taken from a batcher configured as {state[cls.CONFIG]} but "
                f"this one is {config} (kind, pool size, seed, drop_last); build it with the "
                "same arguments"
            )

    def get_state(self) -> dict[str, Any]:
        """O(1): where the current pool began (or, once it is spent, where the next one does)."""
        if self._count is not None and self.emitted >= self._count:
            # the pool is spent: resume at the next one without re-reading this one
            pool, emitted, consumed, start = self.pool + 1, 0, self._next_consumed, self._next_start
        else:
            pool, emitted, consumed, start = self.pool, self.emitted, self.consumed, self.start
        if start is None and not self.finished and pool == 0 and stateful(self.source):
            start = nested(self.source.state_dict())  # not started: the source as it stands
        return {STAGE_KEY: self.STAGE, self.CONFIG: self.config, self.EPOCH: self.epoch,
                self.FINISHED: self.finished, self.POOL: pool, self.EMITTED: emitted,
                self.CONSUMED: consumed, self.SOURCE: start}

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """The batches from where the stage stands; the source is positioned at once."""
        if self.finished:
            return iter(())
        has_state = stateful(self.source)
        if has_state and self.start is not None:
            self.source.load_state_dict(unnested(self.start))
        return self._batches(has_state, skip=0 if has_state else self.consumed)

    def _batches(self, has_state: bool, skip: int) -> Iterator[Any]:
        records_in = iter(self.source)
        if skip:  # a source without state: fast-forward by record count
            for _ in islice(records_in, skip):
                pass
        measure, collate = self.measure, self.collate
        while True:
            self.start = nested(self.source.state_dict()) if has_state else None
            # -> the next pool of records, in arrival order
            pool = list(islice(records_in, self.pool_size))
            if not pool:
                self.finished = True
                if has_state:  # the source's state at its end: its counts are the epoch's
                    self.start = nested(self.source.state_dict())
                return
            self._next_consumed = self.consumed + len(pool)
            self._next_start = nested(self.source.state_dict()) if has_state else None
            lengths = [measure(record) for record in pool]
            # -> index lists, one per batch, in the order they are yielded
            batches = self.cut(lengths, self.rng(self.epoch, self.pool))
            self._count = len(batches)
            for number in range(self.emitted, len(batches)):
                indices = batches[number]
                self.emitted = number + 1
                if self.on_batch is not None:
                    self.on_batch([lengths[i] for i in indices])
                yield collate([pool[i] for i in indices])
            self.pool += 1
            self.emitted = 0
            self.consumed = self._next_consumed
            self._count = None

    # -- operations on nodes, for merge --------------------------------------------------

    @classmethod
    def check_merge(cls, node: dict[str, Any]) -> None:
        """Refuse to merge a batcher that has handed out some batches of its current pool: it
        keeps only its source's state where that pool began, so merging it would read the
        batches already handed out a second time."""
        if node[cls.EMITTED]:
            raise ValueError(
                f"merge_states cannot carry over a pool under way in a batcher wrapper "
                f"({node[cls.CONFIG][0]!r} batches, pool {node[cls.POOL]}: "
                f"{node[cls.EMITTED]} of its batches already handed out, and its state "
                "keeps only where the pool began, so they would be read again); resume in "
                "the same world with load_state_dict(), or, for a StreamingJsonl, batch "
                "inside the reader with ds.batch(LengthBuckets(...)) (merge_states carries "
                "its pools over, with shuffle=True)"
            )
