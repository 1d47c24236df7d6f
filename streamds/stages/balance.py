"""Even ranks: how many records each reader yields so that every rank yields the same batches.

The rule: every rank gives its worker w the same quota, so the per-worker quotas are one
vector for the whole world. A DataLoader (any batch size, `drop_last`, `.batch(n)`) makes
each worker's batches from that worker's records alone and takes them round-robin, skipping
a worker once it runs out, so identical vectors give every rank the same sequence of batch
sizes, and a DDP all-reduce never pairs across epochs. Evening only the rank totals is not
enough: with workers each worker's last batch is short, and the batch count follows how a
rank's total was dealt to its workers.

`quotas` is a pure function of the readers' record counts: with "drop" worker w yields, on
every rank, as many records as the fewest any rank's worker w has (never a record twice:
the fewest dropped this rule allows); with "pad" as many as the most any rank's worker w
has (the fewest repeated). A reader that runs out before its quota repeats its own records
(or, when it owns none, the first records of the epoch).

`check_split` refuses a split that would leave every rank nothing under "drop" and says how
many records a split drops or repeats, so that no loss goes unnoticed. `empty_rank` finds a
rank with nothing to read when ranks are not evened (a DDP job would wait for it forever).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from ..storage.plan import Plan
from ..world import World
from .chunks import SOURCE, STAGE, Chunk, WorkItem, checked, find
from .parse import Marker

__all__ = [
    "EVEN_RANKS", "WARN_FRACTION", "EvenRanks", "check_split", "empty_rank", "pad_work",
    "quotas", "records_in",
]

log = logging.getLogger(__name__)

EVEN_RANKS = (None, "drop", "pad")
WARN_FRACTION = 0.01  # a split that drops or repeats more than this share of records warns


def quotas(reader_counts: Sequence[int], world_size: int, mode: str) -> list[int]:
    """Records each reader yields, indexed like `World.reader` (rank-major).

    `reader_counts[i]` is what reader i would yield on its own. Every rank gets the same
    per-worker vector: worker w's quota is the fewest ("drop") or the most ("pad") records
    any rank's worker w has.
    """
    per_rank = len(reader_counts) // world_size
    pick = min if mode == "drop" else max
    vector = [pick(reader_counts[r * per_rank + w] for r in range(world_size))
              for w in range(per_rank)]
    return vector * world_size


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
    workers = len(reader_counts) // world_size
    each = ("every rank's worker w yields as many records as the {} of the ranks' workers w "
            f"({workers} per rank), so that every rank makes the same batches")
    if mode == "drop" and total and not given:
        if total < world_size:
            why = (f"even_ranks='drop' cannot split {total} records over {world_size} ranks: "
                   "every rank would yield 0 records")
            fix = "use even_ranks='pad' (ranks short of records repeat some) or fewer ranks"
        else:
            who = (f"some of the {world_size} ranks own no record" if workers == 1 else
                   f"for every worker index w some of the {world_size} ranks' worker w owns no "
                   f"record ({each.format('fewest')})")
            why = (f"even_ranks='drop' would drop all {total} records: readers own whole "
                   f"blocks ({blocks} in the corpus) and {who}, so every rank would yield 0 "
                   "records")
            fix = ("use even_ranks='pad', fewer ranks or DataLoader workers, or shards that "
                   "split finer (plain .jsonl, or `streamds convert` with a smaller frame size)")
        if not resumed:
            raise ValueError(f"{why}; {fix}")
        return f"{why} of what is left of this epoch; {fix}"
    changed = abs(given - total)
    if not total or changed <= WARN_FRACTION * total:
        return None
    verb, most, fix = (("drops", "fewest", "use even_ranks='pad' to repeat records instead")
                       if mode == "drop" else
                       ("repeats", "most", "use even_ranks='drop' to drop records instead"))
    how = ("their record counts differ" if workers == 1 else
           f"their record counts differ: {each.format(most)}")
    return (f"even_ranks={mode!r} {verb} {changed} of {total} records ({changed / total:.1%}) "
            f"this epoch over {world_size} ranks: readers own whole blocks ({blocks} in the "
            f"corpus) and {how}; {fix}, or use fewer ranks or DataLoader workers")


def empty_rank(num_blocks: int, world: World, *, corpus_bytes: int | None) -> str | None:
    """What is wrong when this reader's rank owns no block of the epoch (None: it owns some).
    `corpus_bytes`: None where a file's size is unknown (an HTTP server that does not say).

    Blocks (or, for Parquet, runs of them) are dealt worker-major
    (`streamds.storage.plan.assign`), so rank r owns a block exactly when there are more
    blocks than r.
    """
    if world.world_size == 1 or num_blocks > world.rank:
        return None
    readers = (f" ({world.num_workers} DataLoader workers per rank; the blocks are shared "
               "out among every worker of every rank)" if world.num_workers > 1 else "")
    return (f"rank {world.rank} of world_size={world.world_size} has nothing to read: the "
            f"corpus{'' if corpus_bytes is None else f' ({corpus_bytes:,} bytes)'} is cut into "
            f"{num_blocks} block(s), too few "
            f"for the world{readers}, and a DDP job waits forever for a rank without batches; "
            "use fewer ranks or DataLoader workers, even_ranks='pad' (ranks short of records "
            "repeat some; a small corpus is cut finer), or a smaller block_size / shards that "
            "split finer")


def pad_work(plan: Plan, epoch: int, own: Sequence[WorkItem]) -> list[WorkItem]:
    """What a reader short of its quota repeats: its own work, else the epoch's whole work
    (from its first block), so that a reader owning nothing still yields its quota."""
    return list(own) or plan.work(epoch, World())


def records_in(chunk: Chunk) -> int:
    """Records (not markers) in a chunk."""
    if chunk.clean:
        return len(chunk.items)
    return sum(1 for item in chunk.items if item.__class__ is not Marker)


class EvenRanks:
    """Stage: chunks -> chunks holding exactly `quota` records in all (None: pass through).

    Stops mid-chunk when the quota is reached; the source cycles through pad work when it
    would run short. State: ``{"stage": "even_ranks", "source": ..., "emitted": n, "cut":
    [k, o] | None}``: records
    passed on so far, and once the quota is reached, where the last one ends (work item k,
    offset o), since the source has read on to the end of that chunk (an elastic resume
    needs to know which records were passed on).
    """

    STAGE = "even_ranks"
    SOURCE = SOURCE
    EMITTED = "emitted"
    CUT = "cut"

    @classmethod
    def cut_of(cls, state: dict[str, Any]) -> tuple[int, int] | None:
        """(work item k, offset o) where the quota cut this stage's stream in `state` (its
        own state or one nested above it; the records passed on end before offset o of item
        k); None while the quota is not reached."""
        cut = find(state, cls.STAGE)[cls.CUT]
        return None if cut is None else (cut[0], cut[1])

    def __init__(
        self, source: Any, quota: int | None, *, work_items: int = 0, pad_items: int = 0,
        mode: str | None = None,
    ) -> None:
        self.source = source
        self.quota = quota
        self.mode = mode  # "drop": a repeat breaks its promise, and is logged
        self.work_items = work_items  # items of the reader's own work; then pad passes
        self.pad_items = pad_items
        self.reset()

    def _pass_of(self, item: int) -> int:
        """Which pass over the pad work `item` belongs to (-1: the reader's own work)."""
        if item < self.work_items or not self.pad_items:
            return -1
        return (item - self.work_items) // self.pad_items

    def reset(self, state: dict[str, Any] | None = None) -> None:
        if state is not None:
            checked(state, self.STAGE)
        self.source.reset(None if state is None else state[self.SOURCE])
        self._emitted = 0 if state is None else state[self.EMITTED]
        self._cut_at: list[int] | None = None if state is None else state[self.CUT]

    def get_state(self) -> dict[str, Any]:
        return {STAGE: self.STAGE, self.SOURCE: self.source.get_state(),
                self.EMITTED: self._emitted,
                self.CUT: self._cut_at}

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
            this = self._pass_of(chunk.work_index)
            if this != passes[0]:
                if passes[1] == 0:
                    break  # a whole pass over the pad work found no record
                if passes[0] < 0 and self.mode == "drop":
                    self._say_repeats(quota)
                passes = [this, 0 if passes[0] >= 0 else 1]
            passes[1] += count
            if self._emitted + count >= quota:
                cut = self._cut(chunk, quota - self._emitted)
                self._emitted = quota  # before the yield: a state taken there counts it
                self._cut_at = [cut.work_index, cut.offsets[-1]]
                yield cut
                return
            self._emitted += count
            yield chunk
        raise ValueError(
            f"even_ranks could not fill this reader's quota of {quota} records: it found "
            f"{self._emitted} (does a filter drop every record?)"
        )

    def _say_repeats(self, quota: int) -> None:
        """Under "drop" a reader's own records fell short of its quota (quotas count lines;
        a map returned None or lines were skipped): it repeats some rather than hang DDP."""
        log.warning(
            "even_ranks='drop': a reader's own records ran out %d short of its quota of %d "
            "(quotas count lines; its map returned None or on_error='skip' skipped lines), so "
            "it repeats %d records to keep every rank's batches the same; drop those records "
            "when converting the corpus (`streamds convert --transform`, None drops a record) "
            "to have none repeated", quota - self._emitted, quota, quota - self._emitted)

    @staticmethod
    def _cut(chunk: Chunk, keep: int) -> Chunk:
        """The chunk up to and including its `keep`-th record."""
        end = 0
        while keep:
            if chunk.items[end].__class__ is not Marker:
                keep -= 1
            end += 1
        labels = None if chunk.labels is None else chunk.labels[:end]
        return Chunk(chunk.work_index, chunk.block, chunk.offsets[: end + 1], chunk.items[:end],
                     chunk.clean, labels)
