"""The length of a reader (`StreamingJsonl`): records per worker, where known exactly.

`ReaderLength` is the part of `StreamingJsonl` that answers `len()` (through
`StreamdsDataset.__len__`), `worker_records` and `record_bytes` from the record counts the
manifest lists (shards from `streamds convert`) or a count already taken (even_ranks, a
plain-loader resume): never a guess.
"""

from __future__ import annotations

from typing import Any

from ..checks import check_int
from ..resume.block_counts import listed_counts
from ..resume.start import with_quota
from ..storage.read import open_decoded_at
from ..world import World, detect_world
from .base import batches_of

__all__ = ["SAMPLE_BYTES", "ReaderLength"]

SAMPLE_BYTES = 1 << 16  # read to guess the size of records where no manifest says it


class ReaderLength:
    """`StreamingJsonl`'s length: `record_bytes`, `worker_records`, `_worker_items`."""

    _block_counts: list[int] | None
    _batch: Any
    _shards: Any
    _block_list: Any
    _plan: Any
    _steps: Any
    shuffle: bool
    even_ranks: str | None
    rank: int | None
    world_size: int | None
    epoch: int

    def record_bytes(self) -> float | None:
        """Mean bytes of a record's JSON line: from decoded sizes and record counts (a
        converted corpus), else from the lines in the first SAMPLE_BYTES of the first
        shard; None when neither says (no whole line there)."""
        counts = self._block_counts or listed_counts(self._shards, self._block_list)
        sizes = [shard.decoded_size for shard in self._shards]
        if counts is not None and sum(counts) and all(size is not None for size in sizes):
            return sum(sizes) / sum(counts)  # type: ignore[arg-type]
        if not self._shards or not self._shards[0].format.line_positions:
            return None
        with open_decoded_at(self._shards[0], 0, SAMPLE_BYTES) as stream:
            head = stream.read(SAMPLE_BYTES)
        lines = head.count(b"\n")
        return head.rindex(b"\n") / lines if lines else None

    def worker_records(self, num_workers: int = 0) -> list[int]:
        """Records each DataLoader worker of this rank yields in every epoch, for a loader
        with `num_workers` (0: one list entry, the main process).

        Known from the manifest's records per frame (shards from `streamds convert`) or from a
        count already taken (even_ranks, `resume_after_batches`), and only where every epoch
        gives the same counts (Trainer and Lightning take the first epoch's length for all):
        shuffle=False, one reader in all, or blocks that all hold as many records. Never
        guessed: a TypeError otherwise, and for a dataset with a `.filter()` (it may drop any
        number). Under even_ranks these are the quotas. A map that returns None, or bad lines
        skipped under on_error="skip", make the epoch shorter than this.
        """
        check_int("num_workers", num_workers, 0, "the DataLoader's num_workers")
        if any(step.kind == "filter" for step in self._steps):
            raise TypeError("len() is unknown for a StreamingJsonl with a .filter(): it may "
                            "drop any number of records")
        if self._block_counts is None:
            self._block_counts = listed_counts(self._shards, self._block_list)
        if self._block_counts is None:
            raise TypeError(
                "len() of this StreamingJsonl is unknown: its shards list no record counts; "
                "convert them with `streamds convert` (the manifest lists them), or pass "
                "max_steps to the trainer"
            )
        here = detect_world(self.rank, self.world_size)
        readers = max(1, num_workers)
        if (self.shuffle and here.world_size * readers > 1
                and len(set(self._block_counts)) > 1):
            raise TypeError(
                f"len() differs from epoch to epoch here: shuffle=True deals blocks of unequal "
                f"record counts to {here.world_size * readers} readers (ranks x workers) anew "
                "each epoch; Trainer and Lightning would take the first epoch's length for "
                "all. Pass max_steps to the trainer (StreamdsTrainer then streams epoch after "
                "epoch), or use shuffle=False"
            )
        seats = [World(here.rank, here.world_size, worker, readers) for worker in range(readers)]
        if self.even_ranks is not None:
            layout = self._layout()
            return [with_quota(self._fresh(seat), layout, self._resolve).quota  # type: ignore[misc]
                    for seat in seats]
        counts = self._block_counts
        return [sum(counts[block] for block, _ in self._plan.work(self.epoch, seat))
                for seat in seats]

    def _worker_items(self, num_workers: int) -> list[int]:
        """Records (batches after `.batch(n)`) of each worker: see `worker_records`."""
        records = self.worker_records(num_workers)
        if self._batch is None:
            return records
        if self._batch.size is None or self._batch.rule is not None:
            raise TypeError("len() is unknown for batches cut by a LengthBuckets or "
                            "TokenBudget rule")
        return [batches_of(count, self._batch.size, self._batch.drop_last) for count in records]
