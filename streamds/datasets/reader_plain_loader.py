"""Resuming a reader (`StreamingJsonl`) after a plain DataLoader's batches, and the record
counts a `streamds.Mix` replays for its own plain-loader resume.

`PlainLoaderResume` is the part of `StreamingJsonl` that turns a batch count into where each
worker starts (`streamds.resume.plain_loader`, `streamds.resume.start.after_batches`), from
record counts per block (one counting pass, kept), never by reading and discarding records.
"""

from __future__ import annotations

from typing import Any, Self

from ..checks import check_int
from ..resume.block_counts import count_block_records
from ..resume.plain_loader import batches_after, require_line_per_record
from ..resume.start import AFTER_BATCHES, Start, after_batches, after_records
from ..stages.buckets import TokenBudget
from ..world import World, detect_world

__all__ = ["PlainLoaderResume"]


class PlainLoaderResume:
    """`StreamingJsonl.resume_after_batches` and the counts a Mix's resume replays."""

    _block_counts: list[int] | None
    _batch: Any
    _shards: Any
    _block_list: Any
    _plan: Any
    _steps: Any
    _start: Start
    _copy: Any
    on_error: str
    even_ranks: str | None
    rank: int | None
    world_size: int | None
    epoch: int

    def resume_after_batches(
        self, consumed: int, *, batch_size: int, num_workers: int, drop_last: bool = False,
        every_line_yields: bool = False,
    ) -> Self:
        """A copy that continues this epoch after a plain DataLoader yielded `consumed` batches.

        Pass the `batch_size`, `num_workers` and `drop_last` of that DataLoader and use the same
        again. Computed from record counts per block (one counting pass over the data, kept
        for later calls), never by reading and discarding records; the resumed loader yields
        exactly what the interrupted one would have, in the same order. Exact only when
        every line yields a record, so a dataset with a `.filter`, a `.map` (returning None
        drops a record) or `on_error="skip"` is refused unless
        `every_line_yields=True` says each non-blank line yields exactly one record; use
        torchdata's StatefulDataLoader with `state_dict()` for those. A dataset batched by
        `LengthBuckets` resumes at its pool (re-read and cut again, the batches already
        yielded skipped); one batched by `TokenBudget` is refused (its batch count depends on
        the records' lengths).

        Example::

            loader = DataLoader(ds.resume_after_batches(step, batch_size=32, num_workers=4),
                                batch_size=32, num_workers=4)
        """
        check_int("consumed", consumed, 0, "pass the number of batches the loader yielded")
        check_int("batch_size", batch_size, 1, "pass the DataLoader's batch_size")
        check_int("num_workers", num_workers, 0, "pass the DataLoader's num_workers")
        self._require_line_per_record(every_line_yields)
        rule = None if self._batch is None else self._batch.rule
        if isinstance(rule, TokenBudget):
            raise ValueError(
                "resume_after_batches cannot count batches cut by a token budget (how many a "
                "worker yields depends on the lengths of its records); use torchdata's "
                "StatefulDataLoader and state_dict(), or LengthBuckets"
            )
        if self._batch is not None and (batch_size, drop_last) != (self._batch.size,
                                                                   self._batch.drop_last):
            raise ValueError(
                f"batch_size={batch_size}, drop_last={drop_last}: this dataset makes batches of "
                f"{self._batch.size} (drop_last={self._batch.drop_last}) itself; pass those"
            )
        if self.even_ranks is not None or self._start.merged is not None:
            raise ValueError(
                "resume_after_batches does not combine with even_ranks or with_resume; use "
                "torchdata's StatefulDataLoader and state_dict() for those"
            )
        if self._block_counts is None:
            self._block_counts = count_block_records(self._shards, self._block_list)
        here = detect_world(self.rank, self.world_size)
        readers = max(1, num_workers)
        seats = [World(here.rank, here.world_size, worker, readers) for worker in range(readers)]
        records = [sum(self._block_counts[block] for block, _ in self._plan.work(self.epoch, seat))
                   for seat in seats]
        taken, next_worker = batches_after(
            records, consumed, epoch=self.epoch, batch_size=batch_size, num_workers=num_workers,
            drop_last=drop_last,
        )
        starts = after_batches(
            self._layout(), self._spec(), self.epoch, here, taken=taken, next_worker=next_worker,
            batch_size=batch_size, rule=rule)
        clone = self._copy()
        clone._start = self._start.under(Start(AFTER_BATCHES, starts))
        return clone

    def _require_line_per_record(self, every_line_yields: bool) -> None:
        """Refuse a plain-loader resume this pipeline may make inexact (it can drop lines)."""
        require_line_per_record(self._steps, self.on_error, every_line_yields)

    # -- record counts, for the plain-loader resume of a streamds.Mix ---------------------

    def _share_records(self, epoch: int, seat: World) -> int:
        """Records of the share of reader `seat` in `epoch` (one counting pass, kept)."""
        if self._block_counts is None:
            self._block_counts = count_block_records(self._shards, self._block_list)
        return sum(self._block_counts[block] for block, _ in self._plan.work(epoch, seat))

    def _state_after_records(self, epoch: int, seat: World, world: World,
                             yielded: int) -> dict[str, Any]:
        """The state of reader `world`, reading the share (and shuffle seed) of `seat`, once
        it has yielded `yielded` records of `epoch` (0: not started): exact when every line
        is a record."""
        if (self._batch is not None or self.even_ranks is not None
                or self._start.merged is not None):
            raise ValueError(
                "a plain-loader resume of a Mix needs sources without .batch(), even_ranks or "
                "with_resume; use torchdata's StatefulDataLoader and state_dict() for those"
            )
        self._share_records(epoch, seat)  # the record counts, taken once
        return after_records(self._layout(), self._spec(), epoch, seat, world, yielded).to_dict()
