"""Records: chunks -> one record at a time, with an exact position at every record.

The last stage before the DataLoader when nothing is shuffled. A clean chunk (no markers) is
handed out at C speed; the position of the next record is read off the chunk's iterator only
when the state is taken. For `.batch(n)`, `batches` hands out lists of n records cut from the
chunks as slices (no step per record), with the same records and states. `fetch_records`
re-reads records at given positions, through the same parse and transform, for a shuffle
buffer to rebuild itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import StateMismatchError
from ..retry import DEFAULT_RETRY, RetryPolicy
from ..storage.plan import Block
from ..storage.read import Opener, open_decoded_at, read_lines
from ..storage.shards import Shard
from .chunks import Chunk, ChunkCursor, ChunkStage, Position
from .line_runs import LineRuns
from .parse import Marker

__all__ = ["PositionedBatch", "Records", "fetch_records"]

# records (raw lines: a list, or `LineRuns`), and the block id and line offset of each
# (`Records.batches_with_positions`)
PositionedBatch = tuple[Sequence[Any], list[int], list[int]]


class Records:
    """Stage: chunks -> records. State: a `ChunkCursor` position.

    `on_end` is called once when the last record has been handed out (the epoch is over).
    """

    def __init__(self, source: ChunkStage, *, on_end: Callable[[], None] | None = None) -> None:
        self.cursor = ChunkCursor(source)
        self.on_end = on_end
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        self.cursor.reset(state)
        self._loaded = state  # returned as the state until iteration starts
        self._chunk: Chunk | None = None
        self._left: Iterator[Any] | None = None  # the current chunk's items not yet passed
        self._index = 0
        self.done = False  # the last record has been handed out

    def get_state(self) -> dict[str, Any]:
        chunk = self._chunk
        if chunk is None:
            if self._loaded is not None:
                return self._loaded
            return self.cursor.position(None, 0)
        index = self._index
        if self._left is not None:
            index = len(chunk.items) - self._left.__length_hint__()  # type: ignore[attr-defined]
        return self.cursor.position(chunk, index)

    @property
    def counts(self) -> dict[str, int]:
        return self.cursor.source.counts

    def __iter__(self) -> Iterator[Any]:
        self._loaded = None
        for chunk in self.cursor.chunks():
            self._chunk = chunk
            if chunk.clean:  # the common case, at C speed
                self._left = iter(chunk.items)
                yield from self._left
                self._left = None
                self._index = len(chunk.items)
                continue
            for index, item in enumerate(chunk.items, 1):
                self._index = index
                if item.__class__ is not Marker:
                    yield item
        self._chunk = None
        self.done = True
        if self.on_end is not None:
            self.on_end()

    def batches(self, size: int) -> Iterator[list[Any]]:
        """The records in lists of `size` (the last may be short): the same records, and the
        same state after each list, as `size` steps of iteration."""
        for records, _, _ in self._batches(size, positions=False):
            yield records

    def batches_with_positions(self, size: int) -> Iterator[PositionedBatch]:
        """As `batches`, each list with the block id and offset of each record's line."""
        return self._batches(size, positions=True)

    def _batches(self, size: int, *, positions: bool) -> Iterator[PositionedBatch]:
        self._loaded = None
        self._left = None
        # with positions, the items are raw lines (for the main process to parse): kept as
        # slices of their read buffers where they lie one after another (`LineRuns`)
        new: Callable[[], Any] = LineRuns if positions else list
        batch, blocks, offsets = new(), [], []
        for chunk in self.cursor.chunks():
            self._chunk, self._index = chunk, 0
            items, at = chunk.items, chunk.offsets
            kept = None if chunk.clean else [
                index for index, item in enumerate(items) if item.__class__ is not Marker]
            count = len(items) if kept is None else len(kept)
            start = 0
            while start < count:
                end = min(count, start + size - len(batch))
                if kept is None:  # slices, at C speed
                    self._index = end
                    if positions:
                        batch.add_chunk(chunk, start, end)
                        offsets += at[start:end]
                    else:
                        batch += items[start:end]
                else:
                    picked = kept[start:end]
                    batch += [items[i] for i in picked]
                    self._index = picked[-1] + 1
                    if positions:
                        offsets += [at[i] for i in picked]
                if positions:
                    blocks += [chunk.block] * (end - start)
                start = end
                if len(batch) == size:  # the state now stands after its last record
                    yield batch, blocks, offsets
                    batch, blocks, offsets = new(), [], []
        self._chunk = None
        self.done = True
        if self.on_end is not None:
            self.on_end()
        if batch:
            yield batch, blocks, offsets


def fetch_records(
    positions: Sequence[Position],
    *,
    shards: Sequence[Shard],
    blocks: Sequence[Block],
    prepare: Callable[[Chunk], Chunk],
    opener: Opener = open_decoded_at,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> list[Any]:
    """The records at `positions`, re-read in one forward pass per block and run through
    `prepare` (parse, then transform).

    Raises StateMismatchError when a position no longer holds a record (the data or the
    transform changed since the positions were taken).
    """
    wanted: dict[int, set[int]] = defaultdict(set)
    for block_id, offset in positions:
        wanted[block_id].add(offset)
    found: dict[Position, Any] = {}
    for block_id, offsets in wanted.items():
        block = blocks[block_id]
        remaining = set(offsets)
        chunks = read_lines(shards[block.shard], block, block_id, resume_at=min(offsets),
                            opener=opener, retry=retry)
        for raw in chunks:
            keep = [i for i, offset in enumerate(raw.offsets[:-1]) if offset in remaining]
            if not keep:
                continue
            picked = Chunk(
                0, block_id, [raw.offsets[i] for i in keep] + [raw.offsets[-1]],
                [raw.lines[i] for i in keep], False,
                None if raw.labels is None else [raw.labels[i] for i in keep],
            )
            ready = prepare(picked)
            for offset, item in zip(ready.offsets[:-1], ready.items, strict=True):
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
