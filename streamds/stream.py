"""The record stream: blocks -> lines -> parsed -> transformed -> one record at a time.

`RecordStream` is the stage that knows each record's position (block id, offset), so its
state is exact at every record: where the next unread line begins, plus the counts of bad and
dropped lines passed so far. `fetch(positions)` re-reads records at given positions, which the
shuffle buffer uses to rebuild itself on resume.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .errors import CorruptShardError, StateMismatchError
from .parse import Marker, parse_chunk
from .plan import Block
from .read import LineChunk, Opener, count_lines_before, open_decoded_at, read_lines
from .retry import DEFAULT_RETRY, RetryPolicy
from .shards import Shard
from .transform import transform_items

__all__ = ["Position", "RecordStream", "WorkItem"]

log = logging.getLogger(__name__)

Position = tuple[int, int]  # (block id, offset of the record's line in the shard's decoded bytes)
WorkItem = tuple[int, int | None]  # (block id, offset to start at; None: the block's start)

COUNTERS = ("bad", "blank", "dropped", "corrupt_blocks")


class RecordStream:
    """Records of the blocks in `work`, in that order.

    With a `limit`, it yields exactly `limit` records: it stops early, or after `work` it
    cycles through `pad_work` again (even ranks).

    State: ``{"next_block": k, "offset": o | None, "emitted": n, "counts": {...}}``: the k-th
    work item resumes at the line beginning at offset o (None: where the item starts).
    """

    NEXT_BLOCK = "next_block"
    OFFSET = "offset"
    EMITTED = "emitted"
    COUNTS = "counts"

    def __init__(
        self,
        shards: Sequence[Shard],
        blocks: Sequence[Block],
        work: Sequence[WorkItem],
        *,
        on_error: str = "raise",
        apply: Callable[[Any], Any] | None = None,
        opener: Opener = open_decoded_at,
        retry: RetryPolicy = DEFAULT_RETRY,
        limit: int | None = None,
        pad_work: Sequence[WorkItem] = (),
    ) -> None:
        self._shards = shards
        self._blocks = blocks
        self._work = list(work)
        self._limit = limit
        self._pad_work = list(pad_work)
        self._on_error = on_error
        self._apply = apply
        self._opener = opener
        self._retry = retry
        self.reset()

    # -- state ---------------------------------------------------------------------------

    def reset(self, state: dict[str, Any] | None = None) -> None:
        """Start over, or continue from a `get_state()` result."""
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._next_block = 0
        self._resume_at: int | None = None
        self._offsets: list[int] = []  # offsets of the chunk being emitted
        self._index = 0  # items of that chunk already passed downstream
        self._clean: Iterator[Any] | None = None  # iterator over a marker-free chunk
        self._emitted = 0  # records yielded (tracked only under a limit)
        if state is not None:
            self._next_block = state[self.NEXT_BLOCK]
            self._resume_at = state[self.OFFSET]
            self._emitted = state[self.EMITTED]
            self._counts.update({name: state[self.COUNTS][name] for name in COUNTERS})

    def get_state(self) -> dict[str, Any]:
        offset = self._offsets[self._passed()] if self._offsets else self._resume_at
        return {
            self.NEXT_BLOCK: self._next_block,
            self.OFFSET: offset,
            self.EMITTED: self._emitted,
            self.COUNTS: dict(self._counts),
        }

    @property
    def counts(self) -> dict[str, int]:
        """Lines passed so far that yielded no record, by reason."""
        return dict(self._counts)

    def add_counts(self, counts: dict[str, int]) -> None:
        """Carry over counts from an earlier run (an elastic resume)."""
        self._counts.update(counts)

    @property
    def quota(self) -> int | None:
        """Records this stream yields in all (None: all it has), counted from its start."""
        return self._limit

    def _passed(self) -> int:
        """Items of the current chunk already passed downstream."""
        if self._clean is None:
            return self._index
        return len(self._offsets) - 1 - self._clean.__length_hint__()  # type: ignore[attr-defined]

    def _item(self, k: int) -> WorkItem:
        """The k-th work item; past the end of `work`, `pad_work` over and over."""
        if k < len(self._work):
            return self._work[k]
        return self._pad_work[(k - len(self._work)) % len(self._pad_work)]

    def _has_item(self, k: int) -> bool:
        if k < len(self._work):
            return True
        if self._limit is None or not self._pad_work or self._emitted >= self._limit:
            return False
        into_pad = k - len(self._work)
        if into_pad % len(self._pad_work) == 0:  # a new pass over pad_work begins
            if into_pad and self._emitted == self._cycle_start:
                raise ValueError(
                    "even_ranks could not fill this reader's quota: a whole pass over its "
                    "records yielded none (does a filter drop every record?)"
                )
            self._cycle_start = self._emitted
        return True

    # -- reading -------------------------------------------------------------------------

    def _locate(self, chunk: LineChunk, shard: Shard) -> Callable[[int], tuple[int | None, str]]:
        def locate(index: int) -> tuple[int | None, str]:
            if chunk.labels is not None:
                return None, f"{chunk.labels[index]} (record {chunk.offsets[index] + 1})"
            offset = chunk.offsets[index]
            line = count_lines_before(shard, offset, self._opener) + 1
            return line, f"line {line} (byte offset {offset})"

        return locate

    def _items(self, chunk: LineChunk, shard: Shard) -> tuple[list[Any], bool]:
        """Parsed, transformed items of a chunk, and whether all of them are records."""
        locate = self._locate(chunk, shard)
        items, clean = parse_chunk(chunk, on_error=self._on_error, url=shard.url, locate=locate)
        if self._apply is None:
            return items, clean
        return transform_items(self._apply, items), False  # a transform may drop records

    def _chunks(self) -> Iterator[tuple[list[Any], bool]]:
        """(items, all records?) of the remaining blocks; sets the chunk's offsets for
        `get_state`."""
        self._cycle_start = -1
        while self._has_item(self._next_block):
            block_id, start = self._item(self._next_block)
            block = self._blocks[block_id]
            shard = self._shards[block.shard]
            chunks = read_lines(
                shard, block, block_id,
                resume_at=start if self._resume_at is None else self._resume_at,
                opener=self._opener, retry=self._retry,
            )
            try:
                for chunk in chunks:
                    items, clean = self._items(chunk, shard)
                    self._offsets, self._index = chunk.offsets, 0
                    yield items, clean
                    self._resume_at = chunk.offsets[-1]
                    self._offsets = []
            except CorruptShardError as err:
                if self._on_error == "raise":
                    raise
                self._counts["corrupt_blocks"] += 1
                log.warning("skipping the rest of a damaged block: %s", err)
            self._next_block += 1
            self._resume_at = None
            self._offsets = []

    def __iter__(self) -> Iterator[Any]:
        return self._emit(positions=False)

    def with_positions(self) -> Iterator[tuple[Position, Any]]:
        """Like iterating, but each record comes as ((block id, offset), record)."""
        return self._emit(positions=True)

    def _emit(self, *, positions: bool) -> Iterator[Any]:
        counts, limit = self._counts, self._limit
        if limit is not None and self._emitted >= limit:
            return
        for items, clean in self._chunks():
            if clean and limit is None and not positions:  # the common case, at C speed
                self._clean = iter(items)
                yield from self._clean
                self._clean, self._index = None, len(items)
                continue
            block_id, offsets = self._item(self._next_block)[0], self._offsets
            for index, item in enumerate(items, 1):
                self._index = index
                if item.__class__ is Marker:
                    counts[item.kind] += 1
                    continue
                if limit is not None:
                    self._emitted += 1  # counted only under a limit
                yield ((block_id, offsets[index - 1]), item) if positions else item
                if limit is not None and self._emitted >= limit:
                    return

    # -- random access -------------------------------------------------------------------

    def fetch(self, positions: Sequence[Position]) -> list[Any]:
        """The records at `positions`, re-read in one forward pass per block.

        Raises StateMismatchError when a position no longer holds a record (the data or the
        transform changed since the positions were taken).
        """
        wanted: dict[int, set[int]] = defaultdict(set)
        for block_id, offset in positions:
            wanted[block_id].add(offset)
        found: dict[Position, Any] = {}
        for block_id, offsets in wanted.items():
            block = self._blocks[block_id]
            shard = self._shards[block.shard]
            remaining = set(offsets)
            chunks = read_lines(
                shard, block, block_id, resume_at=min(offsets),
                opener=self._opener, retry=self._retry,
            )
            for chunk in chunks:
                keep = [i for i, offset in enumerate(chunk.offsets[:-1]) if offset in remaining]
                if not keep:
                    continue
                picked = LineChunk(
                    block_id,
                    [chunk.offsets[i] for i in keep] + [chunk.offsets[-1]],
                    [chunk.lines[i] for i in keep],
                    None if chunk.labels is None else [chunk.labels[i] for i in keep],
                )
                items, _ = self._items(picked, shard)
                for offset, item in zip(picked.offsets[:-1], items, strict=True):
                    found[(block_id, offset)] = item
                    remaining.discard(offset)
                if not remaining:
                    break
        missing = [p for p in positions if p not in found or found[p].__class__ is Marker]
        if missing:
            raise StateMismatchError(
                f"{len(missing)} buffered record(s) could not be re-read, first at block "
                f"{missing[0][0]} offset {missing[0][1]}; the data or the transform changed "
                "since the state was taken (transforms must be deterministic)"
            )
        return [found[p] for p in positions]
