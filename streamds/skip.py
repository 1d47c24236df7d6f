"""Resume a plain `torch.utils.data.DataLoader` from the number of batches it yielded.

A plain DataLoader asks its workers for batches in turn (worker 0, 1, ..., skipping workers
that ran out), so the batches consumed tell how many records each reader yielded. Record
counts per block (`streamds.index`) turn that into a block and a line, and the shuffle
buffer is replayed on record numbers alone, so nothing is re-read except the blocks that
hold the resume point and the buffered records.

Exact as long as every line yields a record: filters that drop records and malformed lines
skipped under on_error="skip" shift the count (use torchdata's StatefulDataLoader then).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from .plan import Block
from .read import read_lines
from .seeds import derive_seed
from .shards import Shard
from .shuffle import ShuffleBuffer, pack_positions, unpack_positions
from .stream import COUNTERS, Position, RecordStream, WorkItem

__all__ = ["batches_per_reader", "reader_state_after"]


def batches_per_reader(
    records: Sequence[int], consumed: int, *, batch_size: int, drop_last: bool
) -> tuple[list[int], int]:
    """Batches each worker had yielded after `consumed` batches, and the next worker in line.

    `records[w]` is how many records worker w yields in the epoch.
    """
    rounding = math.floor if drop_last else math.ceil
    left = [rounding(count / batch_size) for count in records]
    taken = [0] * len(records)
    worker = 0
    for _ in range(consumed):
        if not any(left):
            break
        while not left[worker]:
            worker = (worker + 1) % len(records)
        taken[worker] += 1
        left[worker] -= 1
        worker = (worker + 1) % len(records)
    return taken, worker


class _Numbers:
    """A stand-in record stream whose records are their own numbers 0, 1, 2, ..."""

    def __init__(self, total: int, start: int = 0) -> None:
        self.total = total
        self.next = start

    def reset(self, state: Any = None) -> None:
        pass

    def get_state(self) -> None:
        return None

    def with_positions(self) -> Iterator[tuple[Position, int]]:
        while self.next < self.total:
            number = self.next
            self.next += 1
            yield (0, number), number


def _positions_of(
    numbers: Sequence[int], work: Sequence[WorkItem], counts: Sequence[int],
    shards: Sequence[Shard], blocks: Sequence[Block],
) -> dict[int, tuple[int, int]]:
    """(work index, offset) of the records with the given numbers in the reader's stream."""
    wanted = sorted(set(numbers))
    found: dict[int, tuple[int, int]] = {}
    first = 0
    for k, ((block_id, start), count) in enumerate(zip(work, counts, strict=True)):
        inside = [n for n in wanted if first <= n < first + count]
        if inside:
            block = blocks[block_id]
            number = first
            for chunk in read_lines(shards[block.shard], block, block_id, resume_at=start):
                for offset, line in zip(chunk.offsets, chunk.lines, strict=False):
                    if not line.strip():
                        continue
                    if number in inside:
                        found[number] = (k, offset)
                    number += 1
                if number > inside[-1]:
                    break
        first += count
    return found


def reader_state_after(
    yielded: int,
    *,
    work: Sequence[WorkItem],
    counts: Sequence[int],
    shards: Sequence[Shard],
    blocks: Sequence[Block],
    shuffle: bool,
    buffer_size: int,
    rng_seed_parts: tuple[Any, ...],
) -> dict[str, Any]:
    """The stream state of a reader that has yielded `yielded` records of its `work`.

    `counts[k]` is the number of records of `work[k]`.
    """
    total = sum(counts)
    zeros = {name: 0 for name in COUNTERS}
    if not shuffle:
        source_next = min(yielded, total)
        return _source_state(source_next, work, counts, shards, blocks, zeros)
    numbers = _Numbers(total)
    replay = ShuffleBuffer(numbers, size=buffer_size, rng_seed=derive_seed(*rng_seed_parts))  # type: ignore[arg-type]
    replay.reset()
    for _, _ in zip(range(yielded), replay, strict=False):
        pass
    state = replay.get_state()
    buffered = [number for _, number in unpack_positions(state[ShuffleBuffer.POSITIONS])]
    located = _positions_of(buffered, work, counts, shards, blocks)
    state[ShuffleBuffer.POSITIONS] = pack_positions(
        [(work[located[n][0]][0], located[n][1]) for n in buffered]
    )
    state[ShuffleBuffer.SOURCE] = _source_state(numbers.next, work, counts, shards, blocks, zeros)
    return state


def _source_state(
    next_number: int, work: Sequence[WorkItem], counts: Sequence[int],
    shards: Sequence[Shard], blocks: Sequence[Block], zeros: dict[str, int],
) -> dict[str, Any]:
    """A RecordStream state whose next record is number `next_number`."""
    state = {RecordStream.NEXT_BLOCK: len(work), RecordStream.OFFSET: None,
             RecordStream.EMITTED: 0, RecordStream.COUNTS: dict(zeros)}
    if next_number >= sum(counts):
        return state
    k, offset = _positions_of([next_number], work, counts, shards, blocks)[next_number]
    state[RecordStream.NEXT_BLOCK], state[RecordStream.OFFSET] = k, offset
    return state
