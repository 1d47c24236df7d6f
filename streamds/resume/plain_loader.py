"""Resume a plain `torch.utils.data.DataLoader` from the number of batches it yielded.

A plain DataLoader asks its workers for batches in turn (worker 0, 1, ..., skipping workers
that ran out), so the batches consumed tell how many records each reader yielded. Record
counts per block (`streamds.resume.counts`) turn that into a block and a line, and the shuffle
buffer is replayed on record numbers alone, so nothing is re-read except the blocks that
hold the resume point and the buffered records.

Exact as long as every line yields a record: filters that drop records and malformed lines
skipped under on_error="skip" shift the count (use torchdata's StatefulDataLoader then).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..chunks import ChunkCursor, WorkItem
from ..parse import cut_bom
from ..pipeline import Reader
from ..plan import Block
from ..read import read_lines
from ..shards import Shard
from ..shuffle import Shuffle, pack_positions, unpack_positions
from .replay import replay

__all__ = ["batches_after", "batches_per_reader", "epoch_batches", "pipeline_state_after"]


def epoch_batches(records: Sequence[int], *, batch_size: int, drop_last: bool) -> int:
    """Batches a plain DataLoader yields in one epoch when worker w yields `records[w]`
    records (each worker batches its own records)."""
    rounding = math.floor if drop_last else math.ceil
    return sum(rounding(count / batch_size) for count in records)


def batches_after(
    records: Sequence[int], consumed: int, *, epoch: int, batch_size: int, num_workers: int,
    drop_last: bool,
) -> tuple[list[int], int]:
    """`batches_per_reader` for a `resume_after_batches(consumed, ...)` in `epoch`, which
    must lie within the epoch's batches (else a ValueError naming how many there are)."""
    length = epoch_batches(records, batch_size=batch_size, drop_last=drop_last)
    if consumed > length:
        raise ValueError(
            f"consumed={consumed} is past the end of epoch {epoch}: this rank's loader yields "
            f"{length} batches per epoch (batch_size={batch_size}, num_workers={num_workers}, "
            f"drop_last={drop_last}); pass the batches consumed in this epoch (0 to {length}), "
            "and set_epoch() to the epoch they belong to"
        )
    return batches_per_reader(records, consumed, batch_size=batch_size, drop_last=drop_last)


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
                lines = cut_bom(chunk.lines, chunk.offsets, chunk.labels)
                for offset, line in zip(chunk.offsets, lines, strict=False):
                    if not line.strip():
                        continue
                    if number in inside:
                        found[number] = (k, offset)
                    number += 1
                if number > inside[-1]:
                    break
        first += count
    return found


def pipeline_state_after(
    yielded: int,
    *,
    reader: Reader,
    work: Sequence[WorkItem],
    counts: Sequence[int],
    shuffle: bool,
    buffer_size: int,
    seed_parts: tuple[int | str, ...],
) -> dict[str, Any]:
    """The pipeline state of `reader` once it has yielded `yielded` records of its `work`.

    `counts[k]` is the number of records of `work[k]`.
    """
    shards, blocks = reader.spec.shards, reader.spec.blocks
    total = sum(counts)

    def position_of(number: int) -> dict[str, Any]:
        if number >= total:
            return reader.position_at(len(work), None)
        k, offset = _positions_of([number], work, counts, shards, blocks)[number]
        return reader.position_at(k, offset)

    if not shuffle:
        return position_of(min(yielded, total))
    replayed, _ = replay(size=buffer_size, seed_parts=seed_parts, handed_out=yielded,
                         total=total)
    state = replayed.get_state()
    numbers = [number for _, number in unpack_positions(state[Shuffle.POSITIONS])]
    located = _positions_of(numbers, work, counts, shards, blocks)
    state[Shuffle.POSITIONS] = pack_positions(
        [work[located[n][0]][0] for n in numbers], [located[n][1] for n in numbers]
    )
    state[Shuffle.SOURCE] = position_of(state[Shuffle.SOURCE][ChunkCursor.SOURCE]["next"])
    return state
