"""Resume a plain `torch.utils.data.DataLoader` from the number of batches it yielded.

A plain DataLoader asks its workers for batches in turn (worker 0, 1, ..., skipping workers
that ran out), so the batches consumed tell how many records each reader yielded. Record
counts per block (`streamds.resume.block_counts`) turn that into a block and a line, and the shuffle
buffer is replayed on record numbers alone, so nothing is re-read except the blocks that
hold the resume point and the buffered records.

Exact as long as every line yields a record: filters that drop records and malformed lines
skipped under on_error="skip" shift the count, so `require_line_per_record` refuses such
pipelines (use torchdata's StatefulDataLoader then) unless the caller says every line
yields one. A block read to find the resume point is read to its end and its records
checked against the count it was planned with (from the manifest, or counted earlier), so a
manifest that is wrong about it fails naming the shard instead of resuming elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..formats.manifest import ManifestError
from ..stages.chunks import ChunkCursor, WorkItem
from ..stages.parse import cut_bom
from ..stages.pipeline import Reader
from ..stages.shuffle import Shuffle
from ..storage.plan import Block
from ..storage.read import read_lines
from ..storage.shards import Shard
from .replay import Numbers, replay

__all__ = [
    "CountMismatchError",
    "batches_after",
    "batches_per_reader",
    "epoch_batches",
    "records_state_after",
    "require_line_per_record",
]

_USE_STATEFUL = (
    "use torchdata's StatefulDataLoader and save and load its state_dict() instead, which "
    "is exact whatever the pipeline drops"
)


class CountMismatchError(ManifestError):
    """A block holds another number of records than the count a plain-loader resume was
    planned with: the manifest is wrong about its shard, or the file changed."""


def require_line_per_record(
    steps: Sequence[tuple[str, Any]], on_error: str, every_line_yields: bool
) -> None:
    """Refuse a plain-loader resume that cannot be exact: a pipeline whose `steps` (kind,
    function) hold a filter or a map (a map returning None drops its record), or that skips
    malformed lines (`on_error="skip"`), may yield fewer records than it has lines, and the
    batch count then points to the wrong record. `every_line_yields=True` is the caller's
    word that every non-blank line yields exactly one record."""
    if every_line_yields:
        return
    kinds = [step[0] for step in steps]
    why = []
    if "filter" in kinds:
        why.append("a .filter() step")
    if "map" in kinds:
        why.append("a .map() step (one that returns None drops its record)")
    if on_error == "skip":
        why.append('on_error="skip" (malformed lines are skipped)')
    if why:
        raise ValueError(
            f"resume_after_batches counts lines, and this dataset has {' and '.join(why)}, so "
            "records dropped before the resume point would make it repeat or skip records; "
            f"{_USE_STATEFUL}. If every line yields exactly one record, pass "
            "every_line_yields=True"
        )


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
            shard = shards[block.shard]
            # counts from a manifest are checked: the block is read to its end (frames of a
            # few MiB); others were counted by this process and are read up to the last one
            whole = shard.frame_records is not None and start is None
            wanted_here = set(inside)
            number = first
            for chunk in read_lines(shard, block, block_id, resume_at=start):
                lines = cut_bom(chunk.lines, chunk.offsets, chunk.labels)
                for offset, line in zip(chunk.offsets, lines, strict=False):
                    if shard.format.parses and not line.strip():  # else values: all records
                        continue
                    if number in wanted_here:
                        found[number] = (k, offset)
                    number += 1
                if number > inside[-1] and not whole:
                    break
            if (whole and number - first != count) or number <= inside[-1]:
                raise _count_mismatch(shard, block, number - first, count, whole)
        first += count
    return found


def _count_mismatch(
    shard: Shard, block: Block, held: int, planned: int, whole: bool
) -> CountMismatchError:
    where = f"{shard.url} (decoded bytes {block.start} to {block.end or 'the end'})"
    held_text = f"{held}" if whole else f"only {held}"
    if shard.frame_records is not None:
        return CountMismatchError(
            f"{where} holds {held_text} records, its folder's manifest.json says {planned} "
            "(records_per_frame); the manifest does not match the shard, so the batch count "
            "cannot be turned into a position. Run `streamds verify` on the folder and convert "
            f"again, or {_USE_STATEFUL}"
        )
    return CountMismatchError(
        f"{where} holds {held_text} records, {planned} when they were counted for this resume; the "
        f"file changed since. Build the dataset again, or {_USE_STATEFUL}"
    )


def records_state_after(
    reader: Reader,
    yielded: int,
    *,
    work: Sequence[WorkItem],
    counts: Sequence[int],
    shuffle: bool,
    buffer_size: int,
    seed_parts: tuple[int | str, ...],
) -> dict[str, Any]:
    """The state of `reader`'s records stage (the shuffle, or the in-order records) once it
    has handed out `yielded` records of its `work` (`counts[k]` records in `work[k]`): for
    `streamds.stages.pipeline.state_after`."""
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
    numbers = [number for _, number in Shuffle.positions_of(state)]
    located = _positions_of(numbers, work, counts, shards, blocks)
    # the records read up to the snapshot: the numbers source's next one is where it stood
    read = Numbers.next_of(ChunkCursor.source_of(Shuffle.source_of(state)))
    return Shuffle.moved(state, positions=[(work[located[n][0]][0], located[n][1])
                                           for n in numbers],
                         source=position_of(read))
