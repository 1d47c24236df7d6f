"""Even ranks: how many records each reader yields so that every rank yields the same number.

`quotas` is a pure function of the readers' record counts: with "drop" every rank yields as
many records as the smallest rank has, with "pad" as many as the largest; within a rank the
total is dealt to its workers. A reader that runs out before its quota repeats its own
records (or, when it owns none, the first records of the epoch).

`check_split` refuses a split that would leave every rank nothing under "drop" and says how
many records a split drops or repeats, so that no loss goes unnoticed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .chunks import Chunk
from .parse import Marker

__all__ = ["EVEN_RANKS", "WARN_FRACTION", "EvenRanks", "check_split", "quotas", "records_in"]

EVEN_RANKS = (None, "drop", "pad")
WARN_FRACTION = 0.01  # a split that drops or repeats more than this share of records warns


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


def check_split(
    reader_counts: Sequence[int], quota: Sequence[int], world_size: int, mode: str, *,
    blocks: int, resumed: bool = False,
) -> str | None:
    """Refuse a "drop" split that leaves every rank nothing; else a warning when more than
    WARN_FRACTION of the records are dropped or repeated (None: nothing to say).

    `resumed`: the counts are what is left of an epoch resumed in another world; its last few
    records may not split evenly, which is said, not refused.
    """
    total, given = sum(reader_counts), sum(quota)
    if mode == "drop" and total and not given:
        if total < world_size:
            why = (f"even_ranks='drop' cannot split {total} records over {world_size} ranks: "
                   "every rank would yield 0 records")
            fix = "use even_ranks='pad' (ranks short of records repeat some) or fewer ranks"
        else:
            why = (f"even_ranks='drop' would drop all {total} records: ranks own whole blocks "
                   f"({blocks} in the corpus) and some of the {world_size} ranks own no "
                   "record, so every rank would yield 0 records")
            fix = ("use even_ranks='pad', fewer ranks, or shards that split finer (plain "
                   ".jsonl, or `streamds convert` with a smaller frame size)")
        if not resumed:
            raise ValueError(f"{why}; {fix}")
        return f"{why} of what is left of this epoch; {fix}"
    changed = abs(given - total)
    if not total or changed <= WARN_FRACTION * total:
        return None
    verb, fix = (("drops", "use even_ranks='pad' to repeat records instead")
                 if mode == "drop" else
                 ("repeats", "use even_ranks='drop' to drop records instead"))
    return (f"even_ranks={mode!r} {verb} {changed} of {total} records ({changed / total:.1%}) "
            f"this epoch over {world_size} ranks: ranks own whole blocks ({blocks} in the "
            f"corpus) and their record counts differ; {fix}, or use fewer ranks")


def records_in(chunk: Chunk) -> int:
    """Records (not markers) in a chunk."""
    if chunk.clean:
        return len(chunk.items)
    return sum(1 for item in chunk.items if item.__class__ is not Marker)


class EvenRanks:
    """Stage: chunks -> chunks holding exactly `quota` records in all (None: pass through).

    Stops mid-chunk when the quota is reached; the source cycles through pad work when it
    would run short. State: ``{"source": ..., "emitted": n}`` (records passed on so far).
    """

    SOURCE = "source"
    EMITTED = "emitted"

    def __init__(
        self, source: Any, quota: int | None, *, work_items: int = 0, pad_items: int = 0
    ) -> None:
        self.source = source
        self.quota = quota
        self.work_items = work_items  # items of the reader's own work; then pad passes
        self.pad_items = pad_items
        self.reset()

    def _pass_of(self, item: int) -> int:
        """Which pass over the pad work `item` belongs to (-1: the reader's own work)."""
        if item < self.work_items or not self.pad_items:
            return -1
        return (item - self.work_items) // self.pad_items

    def reset(self, state: dict[str, Any] | None = None) -> None:
        self.source.reset(None if state is None else state[self.SOURCE])
        self._emitted = 0 if state is None else state[self.EMITTED]

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE: self.source.get_state(), self.EMITTED: self._emitted}

    @property
    def counts(self) -> dict[str, int]:
        return self.source.counts

    def __iter__(self) -> Iterator[Chunk]:
        quota = self.quota
        if quota is None:
            yield from self.source
            return
        if self._emitted >= quota:
            return
        passes = [-1, 1]  # (the pad pass under way, its records; the first may be partial)
        for chunk in self.source:
            count = records_in(chunk)
            this = self._pass_of(chunk.item)
            if this != passes[0]:
                if passes[1] == 0:
                    break  # a whole pass over the pad work found no record
                passes = [this, 0 if passes[0] >= 0 else 1]
            passes[1] += count
            if self._emitted + count >= quota:
                cut = self._cut(chunk, quota - self._emitted)
                self._emitted = quota  # before the yield: a state taken there counts it
                yield cut
                return
            self._emitted += count
            yield chunk
        raise ValueError(
            f"even_ranks could not fill this reader's quota of {quota} records: it found "
            f"{self._emitted} (does a filter drop every record?)"
        )

    @staticmethod
    def _cut(chunk: Chunk, keep: int) -> Chunk:
        """The chunk up to and including its `keep`-th record."""
        end = 0
        while keep:
            if chunk.items[end].__class__ is not Marker:
                keep -= 1
            end += 1
        labels = None if chunk.labels is None else chunk.labels[:end]
        return Chunk(chunk.item, chunk.block, chunk.offsets[: end + 1], chunk.items[:end],
                     chunk.clean, labels)
