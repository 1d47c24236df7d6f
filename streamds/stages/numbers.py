"""`Numbers`: a stand-in chunk source of record numbers, for replays of the shuffle.

The shuffle's draws depend on the seed and the number of records only, never on their
content, so the real `Shuffle` over numbers tells which records a reader handed out and which
sit in its buffer, without reading them (`streamds.resume.replay`; built by
`streamds.stages.pipeline.numbers_shuffle`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .chunks import Chunk

__all__ = ["NEW", "Numbers"]

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
