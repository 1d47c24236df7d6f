"""Elastic resume: merge the states of every reader into one world-independent state.

A reader's state says which of its blocks are finished, where its current block stands, and
which records sit in its shuffle buffer. `merge_states` turns the states of all readers of
one world into the list of unfinished work and unyielded records; `share_of` deals that list
out to the readers of any new world, so the epoch finishes with every remaining record
exactly once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from .errors import StateMismatchError
from .plan import assign, epoch_order
from .shuffle import unpack_positions
from .stream import COUNTERS, Position, RecordStream, WorkItem
from .world import World

__all__ = ["MERGED_FORMAT", "STATE_FORMAT", "merge_states", "reader_work", "share_of"]

STATE_FORMAT = "streamds.state/1"
MERGED_FORMAT = "streamds.merged/1"


def reader_work(plan: dict[str, Any], epoch: int, world: World) -> list[WorkItem]:
    """The work items of one reader: explicit in `plan`, or derived from (seed, epoch, world)."""
    if plan["work"] is not None:
        return [(block, start) for block, start in plan["work"]]
    order = epoch_order(plan["blocks"], seed=plan["seed"], epoch=epoch, shuffle=plan["shuffle"])
    return [(block, None) for block in assign(order, world)]


def _reader_states(found: Any) -> Iterator[dict[str, Any]]:
    """Every reader state nested anywhere in `found` (StatefulDataLoader states included)."""
    if isinstance(found, dict):
        if found.get("format") == STATE_FORMAT:
            yield found
            return
        for value in found.values():
            yield from _reader_states(value)
    elif isinstance(found, (list, tuple)):
        for value in found:
            yield from _reader_states(value)


def _check_complete(states: list[dict[str, Any]]) -> None:
    worlds = [tuple(state["world"]) for state in states]
    world_size, num_workers = worlds[0][1], worlds[0][3]
    expected = {(r, world_size, w, num_workers) for r in range(world_size)
                for w in range(num_workers)}
    missing = sorted(expected - set(worlds))
    extra = sorted(set(worlds) - expected)
    if missing or extra or len(worlds) != len(set(worlds)):
        raise ValueError(
            f"merge_states needs exactly one state per reader of the world "
            f"(world_size={world_size}, num_workers={num_workers}); missing (rank, worker): "
            f"{[(m[0], m[2]) for m in missing]}, unexpected or repeated: "
            f"{extra or 'duplicates'}; pass the loader states of every rank"
        )


def _unfinished(state: dict[str, Any]) -> tuple[list[WorkItem], list[Position], Counter]:
    world = World(*state["world"])
    work = reader_work(state["plan"], state["epoch"], world)
    stream = state["stream"]
    if stream is None:  # the reader had not started
        return work, [], Counter()
    shuffled = state["plan"]["shuffle"]
    source = stream["source"] if shuffled else stream
    k, offset = source[RecordStream.NEXT_BLOCK], source[RecordStream.OFFSET]
    remaining: list[WorkItem] = []
    if k < len(work):
        block, start = work[k]
        remaining = [(block, start if offset is None else offset), *work[k + 1 :]]
    pending = unpack_positions(stream["positions"]) if shuffled else []
    return remaining, pending, Counter(source[RecordStream.COUNTS])


def merge_states(states: Any) -> dict[str, Any]:
    """One world-independent state from the states of every reader of one epoch.

    `states`: the `state_dict()` of each rank's StatefulDataLoader (or of each dataset), in
    a list; reader states are found wherever they nest. Load the result with
    ``StreamingJsonl(source, ..., resume_from=merged, rank=r, world_size=n)``.
    """
    readers = sorted(_reader_states(states), key=lambda s: (s["world"][0], s["world"][2]))
    if not readers:
        raise ValueError("merge_states found no streamds reader state in its argument")
    first = readers[0]
    for state in readers:
        if state["fingerprint"] != first["fingerprint"] or state["epoch"] != first["epoch"]:
            raise StateMismatchError(
                "the states come from different datasets or epochs; merge the states taken "
                "at one checkpoint of one run"
            )
    _check_complete(readers)
    remaining: list[WorkItem] = []
    pending: list[Position] = []
    counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
    for state in readers:
        work, buffered, reader_counts = _unfinished(state)
        remaining.extend(work)
        pending.extend(buffered)
        counts.update(reader_counts)
    return {
        "format": MERGED_FORMAT,
        "fingerprint": first["fingerprint"],
        "epoch": first["epoch"],
        "remaining": [list(item) for item in remaining],
        "pending": [list(position) for position in pending],
        "counts": dict(counts),
    }


def share_of(
    merged: dict[str, Any], world: World
) -> tuple[list[WorkItem], list[Position], dict[str, int] | None]:
    """This reader's part of a merged state: work items, buffered records, and (for reader
    0 only) the counts carried over."""
    step, first = world.readers, world.reader
    work: Sequence[list] = merged["remaining"][first::step]
    pending: Sequence[list] = merged["pending"][first::step]
    counts = merged["counts"] if first == 0 else None
    return [(b, s) for b, s in work], [(b, o) for b, o in pending], counts
