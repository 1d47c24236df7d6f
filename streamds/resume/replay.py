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
    one per chunk so that the records read are exactly those pulled.

    State: ``{"next": n}``, the number of the next record."""

    NEXT = "next"

    @classmethod
    def state_at(cls, number: int) -> dict[str, Any]:
        """The state before record `number`."""
        return {cls.NEXT: number}

    @classmethod
    def next_of(cls, state: dict[str, Any]) -> int:
        """The number of the next record of a state."""
        return int(state[cls.NEXT])

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        self.next = 0 if state is None else self.next_of(state)

    def get_state(self) -> dict[str, Any]:
        return self.state_at(self.next)

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
    epoch or from a `snapshot` (`Shuffle.snapshot_of` a state: the buffer without its source;
    the records it says were handed out since are among `handed_out`).

    Returns the shuffle (its `buffered()` and `get_state()`) and the numbers source (how many
    records it read: `.next`). `handed`, if given, receives the records handed out, in order.
    """
    numbers = Numbers(total)
    shuffle = Shuffle(numbers, size=size, seed_parts=seed_parts, fetch=_identity)
    if snapshot is not None:
        start = ChunkCursor.between(Numbers.state_at(0))
        shuffle.reset(Shuffle.restarted(snapshot, start))
    out = islice(iter(shuffle), handed_out)
    if handed is None:
        for _ in out:
            pass
    else:
        handed.extend(out)
    return shuffle, numbers
