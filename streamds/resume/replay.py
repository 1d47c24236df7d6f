"""Replays of the shuffle on record numbers: which records a reader's buffer held, without
reading them.

The shuffle's draws depend on the seed and the number of records only, never on their
content, so running the real `Shuffle` over a stand-in source of numbers tells which records
were handed out and which sit in the buffer. Positions of numbered records are found later,
by reading only the blocks that hold them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

from ..stages.chunks import Chunk, ChunkCursor, Position
from ..stages.shuffle import Shuffle

__all__ = ["NEW", "Numbers", "replay"]

NEW = -1  # block id of a numbered record in a replay: (NEW, n) is the n-th record read


class Numbers:
    """A stand-in chunk source: records (NEW, 0), (NEW, 1), ... up to `total` (None: no end),
    one per chunk so that the records read are exactly those pulled."""

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        self.next = 0 if state is None else state["next"]

    def get_state(self) -> dict[str, Any]:
        return {"next": self.next}

    @property
    def counts(self) -> dict[str, int]:
        return {}

    def __iter__(self) -> Iterator[Chunk]:
        while self.total is None or self.next < self.total:
            number = self.next
            self.next += 1
            yield Chunk(0, NEW, [number, number + 1], [(NEW, number)], True)


def _identity(positions: Sequence[Position]) -> list[Any]:
    return list(positions)


def replay(
    *, size: int, seed_parts: tuple[int | str, ...], handed_out: int, total: int | None,
    snapshot: dict[str, Any] | None = None, handed: list[Any] | None = None,
) -> tuple[Shuffle, Numbers]:
    """A shuffle over numbers that has handed out `handed_out` records, from the start of the
    epoch or from a `snapshot` (the shuffle state's fields other than its source).

    Returns the shuffle (its `buffered()` and `get_state()`) and the numbers source (how many
    records it read: `.next`). `handed`, if given, receives the records handed out, in order.
    """
    numbers = Numbers(total)
    shuffle = Shuffle(numbers, size=size, seed_parts=seed_parts, fetch=_identity)
    if snapshot is not None:
        start = {ChunkCursor.SOURCE: {"next": 0}, ChunkCursor.ITEM: -1, ChunkCursor.OFFSET: 0}
        shuffle.reset({**snapshot, Shuffle.SOURCE: start, Shuffle.SINCE: 0})
    out = islice(iter(shuffle), handed_out)
    if handed is None:
        for _ in out:
            pass
    else:
        handed.extend(out)
    return shuffle, numbers
