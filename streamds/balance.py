"""Even ranks: how many records each reader yields so that every rank yields the same number.

`quotas` is a pure function of the readers' record counts: with "drop" every rank yields as
many records as the smallest rank has, with "pad" as many as the largest; within a rank the
total is dealt to its workers. A reader that runs out before its quota repeats its own
records (or, when it owns none, the first records of the epoch).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["EVEN_RANKS", "quotas"]

EVEN_RANKS = (None, "drop", "pad")


def _trim(counts: Sequence[int], target: int) -> list[int]:
    """Lower the largest counts first until they sum to `target`."""
    quota = list(counts)
    excess = sum(quota) - target
    while excess > 0:
        top = max(quota)
        holders = [i for i, q in enumerate(quota) if q == top]
        below = max([q for q in quota if q < top], default=0)
        step = min(top - below, excess // len(holders)) if excess >= len(holders) else 0
        if step == 0:  # fewer records to remove than holders: one from the first few
            for i in holders[:excess]:
                quota[i] -= 1
            break
        for i in holders:
            quota[i] -= step
        excess -= step * len(holders)
    return quota


def _grow(counts: Sequence[int], target: int) -> list[int]:
    """Raise counts evenly, lowest worker first, until they sum to `target`."""
    quota = list(counts)
    extra = target - sum(quota)
    share, rest = divmod(extra, len(quota))
    return [q + share + (1 if i < rest else 0) for i, q in enumerate(quota)]


def quotas(reader_counts: Sequence[int], world_size: int, mode: str) -> list[int]:
    """Records each reader yields, indexed like `World.reader` (rank-major).

    `reader_counts[i]` is what reader i would yield on its own.
    """
    per_rank = len(reader_counts) // world_size
    ranks = [reader_counts[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]
    totals = [sum(rank) for rank in ranks]
    target = min(totals) if mode == "drop" else max(totals)
    adjust = _trim if mode == "drop" else _grow
    return [q for rank in ranks for q in adjust(rank, target)]
