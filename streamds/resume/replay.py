"""Replays of the shuffle on record numbers: which records a reader's buffer held, without
reading them.

The shuffle's draws depend on the seed and the number of records only, never on their
content, so running the real `Shuffle` over a stand-in source of numbers tells which records
were handed out and which sit in the buffer. Positions of numbered records are found later,
by reading only the blocks that hold them.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from ..stages.chunks import ChunkCursor
from ..stages.numbers import NEW, Numbers
from ..stages.pipeline import numbers_shuffle
from ..stages.shuffle import Shuffle

__all__ = ["NEW", "Numbers", "replay"]


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
    shuffle, numbers = numbers_shuffle(total, size=size, seed_parts=seed_parts)
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
