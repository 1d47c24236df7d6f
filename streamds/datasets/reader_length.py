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

__all__ = ["SAMPLES", "SAMPLE_BYTES", "ReaderLength"]

SAMPLE_BYTES = 1 << 16  # read at a time to guess the size of records where no manifest says it
SAMPLES = 8  # windows of SAMPLE_BYTES read across the files that can be read at any offset


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
        """Bytes of a record's JSON line: the mean from decoded sizes and record counts (a
        converted corpus); else, where the records are largest, the largest mean of the
        lines in SAMPLES windows of SAMPLE_BYTES spread evenly over the files that can be
        read at any offset (plain and seekable zstd JSON lines), or of the first SAMPLE_BYTES
        of the first file where none can; None when no window says (no lines there).

        The largest, not the mean, because the loader sends records below SMALL_RECORD in
        messages of thousands: a corpus whose first records are small and later ones 60 KB
        must not take that route from its first lines (a window holding no whole line counts
        as a line of its size at least)."""
        counts = self._block_counts or listed_counts(self._shards, self._block_list)
        sizes = [shard.decoded_size for shard in self._shards]
        if counts is not None and sum(counts) and all(size is not None for size in sizes):
            return sum(sizes) / sum(counts)  # type: ignore[arg-type]
        spread = [shard for shard in self._shards if shard.format.line_positions
                  and shard.ranged and shard.decoded_size]
        if spread:
            means = [_window_mean(shard, offset) for shard, offset in _windows(spread)]
        elif self._shards and self._shards[0].format.line_positions:
            means = [_window_mean(self._shards[0], 0)]
        else:
            return None
        known = [mean for mean in means if mean is not None]
        return max(known) if known else None

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


def _windows(shards: list[Any]) -> list[tuple[Any, int]]:
    """(shard, decoded offset) of SAMPLES windows spread evenly over `shards`' bytes taken
    end to end (the first at the start); fewer where the files hold fewer windows."""
    sizes = [shard.decoded_size for shard in shards]
    total = sum(sizes)
    count = max(1, min(SAMPLES, total // SAMPLE_BYTES))
    found: list[tuple[Any, int]] = []
    for k in range(count):
        at = total * k // count
        for shard, size in zip(shards, sizes, strict=True):
            if at < size:
                found.append((shard, at))
                break
            at -= size
    return found


def _window_mean(shard: Any, offset: int) -> float | None:
    """Mean JSON bytes (newlines left out) of the whole lines in SAMPLE_BYTES of `shard`'s
    decoded bytes from `offset` (the line cut at `offset` left out); a window without a whole
    line counts as one line of the window's bytes (records at least that long), and None
    where it holds no bytes."""
    with open_decoded_at(shard, offset, offset + SAMPLE_BYTES) as stream:
        window = stream.read(SAMPLE_BYTES)
    first = 0
    if offset:  # the line cut at `offset` began before the window
        cut = window.find(b"\n")
        if cut < 0:
            return float(len(window)) if window else None
        first = cut + 1
    last = window.rfind(b"\n")
    lines = window.count(b"\n", first)
    if lines == 0:
        return float(len(window) - first) if len(window) > first else None
    return (last + 1 - first - lines) / lines
