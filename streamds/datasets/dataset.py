"""`StreamingJsonl`: the public IterableDataset, a picklable description of a pipeline.

Nothing opens in the constructor beyond listing the source. The dataset holds one `Start`
(where its next iterator starts: fresh, loaded, a merged state, a plain loader's batch count);
each iterator (one per DataLoader worker) detects its world, turns that into one `ReaderState`
(`streamds.resume.start.choose`) and builds its pipeline from it: one path. How the files are
reached is one `streamds.Storage`.

This module holds the description (its checks, the listing, identity, blocks and plan built
once in the constructor), the builders (`_spec`, `_layout`) and iteration; the rest of the
class is one module a job: `reader_length` (len, record counts), `reader_state` (state_dict,
load_state_dict, with_resume), `reader_plain_loader` (resume_after_batches, the counts a
Mix replays); what every dataset type shares is `base.StreamdsDataset`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import get_worker_info

from ..checks import check_bool, check_choice, check_int
from ..resume.block_counts import count_block_records
from ..resume.identity import Identity, relative_names, source_root
from ..resume.merge import resolve_tails
from ..resume.start import Layout, Start, choose, pad_work_of
from ..retry import RetryPolicy
from ..stages.balance import EVEN_RANKS
from ..stages.batch import BatchSettings, RecordBatch
from ..stages.buckets import RULES, LengthBuckets, TokenBudget
from ..stages.cpus import WORKER_CPUS
from ..stages.description import ReaderDescription
from ..stages.parse import ON_ERROR
from ..stages.parse_later import lines_for_main
from ..stages.pipeline import Reader
from ..stages.record_cache import RecordsCache
from ..stages.state import ReaderState
from ..stages.timing import StageTimer
from ..stages.transform import Step, describe_step, step_settings
from ..storage.plan import Plan, decode_units, make_blocks, small_corpus_piece
from ..storage.read import open_decoded_at
from ..storage.readahead import DEFAULT_READAHEAD, wants_readahead
from ..storage.record_keys import block_key, uncacheable
from ..storage.record_store import RecordStore
from ..storage.settings import Storage, storage_of
from ..storage.shards import Shard, resolve_shards, source_items, with_columns
from ..world import World, detect_world
from .base import StreamdsDataset
from .callers import check_outer_split
from .epoch import SharedEpoch
from .reader_length import ReaderLength
from .reader_plain_loader import PlainLoaderResume
from .reader_state import ReaderCheckpoints

__all__ = ["StreamingJsonl"]

log = logging.getLogger(__name__)

MAX_SEED = (1 << 64) - 1  # seeds are 64-bit, as torch's and numpy's are


class StreamingJsonl(ReaderLength, ReaderCheckpoints, PlainLoaderResume, StreamdsDataset):
    """Stream JSON-lines records from files, directories, globs or fsspec URLs.

    Each epoch yields every record of the corpus exactly once across all DataLoader workers
    and distributed ranks. With ``shuffle=False`` and one reader, records come in file order.

    Example::

        ds = StreamingJsonl("data/train-*.jsonl.zst", shuffle=True, seed=0)
        ds = ds.map(to_text)  # a function defined at module level (workers pickle it)
        loader = DataLoader(ds, batch_size=32, num_workers=4)

    Parquet (``.parquet``, ``.pq``) and Arrow IPC (``.arrow``) files are read by row group:
    ``columns=["article", "abstract"]`` reads only those columns, ``format="parquet"`` (any
    registered format's name) reads files whose names say nothing (docs/reading.md).

    How the files are reached (fsspec options, read-ahead, a local cache of the shards,
    retries, the block size) is one `streamds.Storage` value:
    ``storage=Storage(options={"anon": True})``. Steps are added with `.map` / `.filter`, an
    elastic resume with `.with_resume(merged)`.
    """

    KIND = "reader"

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        shuffle: bool = False,
        seed: int = 0,
        buffer_size: int = 1000,
        on_error: str = "raise",
        rank: int | None = None,
        world_size: int | None = None,
        even_ranks: str | None = None,
        storage: Storage | None = None,
        columns: Sequence[str] | None = None,
        format: str | None = None,
    ) -> None:
        super().__init__()
        check_bool("shuffle", shuffle)
        check_int("seed", seed, 0, "pass a non-negative integer seed below 2**64",
                  maximum=MAX_SEED)
        check_int("buffer_size", buffer_size, 1, "use shuffle=False to disable shuffling")
        storage = storage_of(storage)
        check_choice("on_error", on_error, ON_ERROR)
        if world_size is not None:
            check_int("world_size", world_size, 1, "the number of distributed processes")
        if rank is not None:
            check_int("rank", rank, 0, "this process's index among world_size processes")
            if world_size is not None and rank >= world_size:
                raise ValueError(
                    f"rank must be < world_size={world_size}, got {rank}; ranks count from 0"
                )
        check_choice("even_ranks", even_ranks, EVEN_RANKS,
                     "'drop' trims every rank to the smallest, 'pad' repeats records up to "
                     "the largest")
        storage_options, block_size = storage.options, storage.block_size
        self.storage = storage
        self.shuffle = shuffle
        self.seed = seed
        self.buffer_size = buffer_size
        self.on_error = on_error
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.even_ranks = even_ranks
        self.worker_cpus = "auto"  # where the workers run (`.batch(worker_cpus=)`)
        self.retry = RetryPolicy() if storage.retry is None else storage.retry
        self._epoch = SharedEpoch(0)
        self._steps: tuple[Step, ...] = ()  # map and filter of the records (.map/.filter)
        self._batch: BatchSettings | None = None  # whole batches out of the workers (.batch)
        self._records_cache: RecordsCache | None = None  # stored records (.cache)
        self._shards: list[Shard] = with_columns(
            resolve_shards(source, storage_options, on_error=on_error, retry=self.retry,
                           format=format), columns)
        # even ranks cut a small corpus finer, so that ranks' shares differ by little
        self._fine_piece = small_corpus_piece(self._shards) if even_ranks is not None else None
        # what a state says about the corpus (names under the source root, sizes, checksums)
        # and the settings, so that it loads wherever the same files are mounted
        self._identity = Identity.of(
            self._shards,
            relative_names(self._shards, [source_root(item, self._shards, storage_options or {})
                                          for item in source_items(source)]),
            {"seed": seed, "shuffle": shuffle, "buffer_size": buffer_size,
             "block_size": block_size, "even_ranks": even_ranks},
        )
        self._cache = storage.cache_of(self._shards)
        ahead = storage.ahead_bytes
        if ahead is None:  # "auto": remote and mounted shards read ahead; local disks do not
            ahead = DEFAULT_READAHEAD if wants_readahead(self._shards) else 0
        self.readahead = ahead
        # -> Block(shard, start, end) list: the corpus cut into line-aligned units, once
        self._block_list = make_blocks(self._shards, self.block_size,
                                       fine=self._fine_piece is not None)
        # Parquet: a row group's ranges stay together, so one reader decodes it once
        self._plan = Plan(len(self._block_list), seed, shuffle,
                          decode_units(self._shards, self._block_list))
        # records per block, counted once here so every worker shares them (even ranks only)
        self._block_counts: list[int] | None = None
        if even_ranks is not None:
            self._block_counts = count_block_records(self._shards, self._block_list)
        # where the next iterators start (`streamds.resume.start`): a fresh epoch unless resumed
        self._start = Start()
        self._active: Reader | None = None
        self._in_mix = False  # a source of a streamds.Mix (`_detached`): no empty-rank check
        self._worker_epoch: int | None = None  # the epoch a DataLoader worker last started
        self.timer: StageTimer | None = None  # set by `streamds bench` to time each stage

    # -- description ---------------------------------------------------------------------

    @property
    def shards(self) -> list[Shard]:
        return list(self._shards)

    def __repr__(self) -> str:
        return (
            f"StreamingJsonl({len(self._shards)} shards, shuffle={self.shuffle}, seed={self.seed}, "
            f"epoch={self.epoch}, steps={len(self._steps)})"
        )

    def _detached(self) -> StreamingJsonl:
        """A copy with an epoch of its own, for a `streamds.Mix`, which sets the epochs of
        its sources itself (each source's pass may be in another epoch)."""
        clone = self._copy()
        clone._epoch = SharedEpoch(self.epoch)
        clone._epoch.loaded = clone._start.loaded
        clone._in_mix = True
        return clone

    def _spec(self) -> ReaderDescription:
        opener = functools.partial(open_decoded_at, retry=self.retry, cache=self._cache)
        return ReaderDescription(
            self._shards, self._block_list, self._plan, self._steps, self.on_error,
            self.buffer_size, self.retry, opener, batch=self._batch, readahead=self.readahead,
            cache=self._cache, worker_cpus=self.worker_cpus, records_cache=self._records_cache,
            even_ranks=self.even_ranks)

    def wants_main_cpu(self) -> bool:
        """Whether its DataLoader workers, placed by streamds (``worker_cpus="auto"``), only
        copy lines in order for the main process to parse (`streamds.stages.parse_later`):
        the main process then does most of the work and gains from a CPU of its own. A
        shuffle's workers do enough (the buffer's draws) to gain from every CPU instead
        (`benchmarks/workers_vs_none.py` measures the in-order case)."""
        batch = self._batch
        return (self.worker_cpus == "auto" and batch is not None and not self.shuffle
                and lines_for_main(self._spec(), batch.collate))

    def _taken_on_main_cpu(self) -> StreamingJsonl:
        """A copy (of a dataset that `wants_main_cpu`) whose workers keep off the
        main process's CPU from their start, where a loader takes its batches on that CPU
        (`streamds.train.loader.OnMainCpu`)."""
        assert self._batch is not None
        clone = self._copy()
        clone._batch = dataclasses.replace(self._batch, main_cpu=True)
        return clone

    def _with_step(self, step: Step) -> StreamingJsonl:
        if step.kind == "filter" and self.even_ranks == "drop":
            # quotas count lines (records before the steps): a rank the filter leaves short
            # would have to repeat records, which "drop" promises never to do
            raise ValueError(
                "filter() under even_ranks='drop': the ranks' quotas count records before the "
                "steps, so a filter would leave ranks short and they would repeat records; "
                "filter the corpus when converting it (`streamds convert --transform "
                "module:function`, a function returning None drops a record), or use "
                "even_ranks='pad' (ranks short of records repeat some, by design)")
        clone = super()._with_step(step)
        clone._start = self._start.for_new_steps()  # merged tails resolve with the new steps
        return clone

    def _with_cache(self, directory: str, key: str, limit: int | None) -> StreamingJsonl:
        """A copy that stores the records the steps so far make (the parse and the
        `.map`/`.filter` steps added before `.cache`) in `directory`, in the first epoch that
        reads each block, and reads them back in later epochs and resumes instead of reading
        and parsing the source and running those steps again (`streamds.stages.record_cache`)."""
        if self._records_cache is not None:
            raise ValueError("cache() was called twice on this dataset; call it once, after "
                             "the steps whose records are worth storing")
        steps = self._steps
        # steps are told apart by their names and, where stable, their settings (a
        # partial's arguments, a callable object's repr); the rest only by `key`
        settings = [step_settings(step.fn) for step in steps]
        upstream = "; ".join([f"on_error={self.on_error}"]
                             + [f"{describe_step(steps, step)} {said}"
                                for step, said in zip(steps, settings, strict=True)])
        vague = [describe_step(steps, step) for step, said in zip(steps, settings, strict=True)
                 if said is None]
        if vague:
            log.warning("ds.cache: %s is told apart from other steps of its name by key=%r "
                        "alone (its settings have no stable repr): put what it computes "
                        "with (the tokenizer, its settings) in key, or another step of that "
                        "name reads these records", vague[0], key)
        names = [name for name, _, _ in self._identity.files]
        keys = tuple(block_key(self._shards[block.shard], block, name=names[block.shard],
                               key=key, upstream=upstream) for block in self._block_list)
        stale = [i for i, shard in enumerate(self._shards) if uncacheable(shard)]
        if stale:
            log.warning("ds.cache: %d of %d shards are read without the cache, every epoch "
                        "(the first: %s): %s", len(stale), len(self._shards),
                        names[stale[0]], uncacheable(self._shards[stale[0]]))
        clone = self._copy()
        clone._records_cache = RecordsCache(
            RecordStore(directory, limit), keys, len(steps), tuple(self._shards),
            tuple(self._block_list), tuple(names), key, upstream)
        return clone

    def batch(
        self, size: int | LengthBuckets | TokenBudget, *,
        collate: Callable[[list[Any]], Any] | None = None, drop_last: bool = False,
        ahead: int | str = "auto", worker_cpus: str = "auto", max_bytes: int | None = None,
    ) -> StreamingJsonl:
        """A new dataset that yields whole batches, made in the workers.

        `size` is the number of records per batch, or a rule that cuts batches of similar
        length from pools of records: ``streamds.LengthBuckets(32, buffer_size=2048)`` (fixed
        size, little padding) or ``streamds.TokenBudget(16384)`` (as many records as fit in a
        budget of padded tokens).

        Use it with ``DataLoader(ds.batch(n, collate=...), batch_size=None)``: each worker
        sends one message per batch, and the batch is made where the records are. `collate`
        (a module-level function, so spawned workers can pickle it) turns the list of records
        into what the model takes, e.g. a `streamds.PadCollate` for padded tensors (the
        tensors of a dict cross from a worker in its shared-memory ring,
        `streamds.handover.shm_tensors`). None yields a `RecordBatch`, a list-like
        holder of the records that torch's default conversion hands over untouched; from a
        worker it crosses in shared memory (`streamds.handover.shm_ring`), as the records' JSON
        lines that the main process parses when nothing in the worker needs the values (no
        map or filter, on_error="raise": `streamds.stages.parse_later`), else marshalled.
        A collate that returns lists or dicts of Python values is walked value by value by
        that default conversion (with ``batch_size=None``): pass
        ``collate_fn=streamds.as_list`` to the DataLoader then. `.map()`/`.filter()` still
        apply to records. A state taken after any batch resumes exactly.

        `ahead`: batches a DataLoader worker makes in a thread ahead of the loader's requests
        (each kept with the state after it; `streamds.stages.ahead`), so that a worker keeps busy
        while the main process runs late; 0 makes each batch when asked, as torch does. "auto" makes
        4 ahead where the workers and the main processes outnumber the CPUs (where they take
        turns on a CPU), else none, and none under a CPU quota or on one CPU (there the
        workers have no idle CPU time to use: `streamds.stages.cpus`). They are held in the worker's
        memory, on top of the loader's ``prefetch_factor`` batches.

        `worker_cpus`: "auto" leaves the main process a CPU where that pays (workers that fit
        beside it keep off one CPU; workers that do not measure both ways and keep the
        faster: `streamds.stages.cpus`); "all" lets the OS place the workers, as torch does.
        A dataset without `.batch()` places its workers as "auto" does.

        `max_bytes`: a batch that crosses from a worker as JSON lines (no collate, map or
        filter) ends early once its lines hold this many bytes, so that a message stays
        bounded where records grow (``ds.loader`` sets it); batches of parsed records are
        not measured. A state taken after any batch still resumes exactly.
        """
        if collate is not None and not callable(collate):
            raise ValueError(f"collate must be callable or None, got {collate!r}")
        check_bool("drop_last", drop_last)
        if ahead != "auto":
            check_int("ahead", ahead, 0, "'auto', or the batches a worker makes ahead of "
                      "requests (0: none)")
        check_choice("worker_cpus", worker_cpus, WORKER_CPUS,
                     "'auto' leaves the main process a CPU where that pays, 'all' lets the OS "
                     "place the workers")
        collate = RecordBatch if collate is None else collate
        if isinstance(size, RULES):
            if max_bytes is not None:
                raise ValueError(f"max_bytes with {size!r}: a rule cuts batches by length "
                                 "itself; pass max_bytes with a number of records")
            if drop_last:
                raise ValueError(
                    f"drop_last=True with {size!r}: pass drop_last to LengthBuckets instead "
                    "(a token budget drops nothing)"
                )
            spec = BatchSettings(getattr(size, "batch_size", None), collate,
                             getattr(size, "drop_last", False), rule=size, ahead=ahead)
        else:
            check_int("size", size, 1, "the number of records per batch, or a "
                      "streamds.LengthBuckets / TokenBudget rule")
            if max_bytes is not None:
                check_int("max_bytes", max_bytes, 1, "the bytes of lines a batch ends at, or "
                          "None")
                if drop_last:
                    raise ValueError("drop_last=True with max_bytes: a batch cut by bytes may "
                                     "be short anywhere; pass one or the other")
            spec = BatchSettings(size, collate, drop_last, ahead=ahead, max_bytes=max_bytes)
        clone = self._copy()
        clone._batch = spec
        clone.worker_cpus = worker_cpus
        return clone

    # -- epochs (`StreamdsDataset.set_epoch`) ----------------------------------------------

    _EPOCH_FIX = "or build a fresh dataset to skip its remaining records"

    def _loaded_position(self) -> ReaderState | None:
        return self._epoch.loaded

    def _check_epoch_call(self) -> None:
        # accelerate's loaders call set_epoch on every process before an epoch's first batch
        check_outer_split(self, lambda: detect_world(self.rank, self.world_size).world_size,
                          depth=4)

    # -- where a reader starts (`streamds.resume.start`) ------------------------------------------

    def _layout(self) -> Layout:
        return Layout(self._identity.to_state(), self._shards, self._block_list, self._plan,
                      self.seed, self.shuffle, self.buffer_size, self.even_ranks,
                      self.rank is not None or self.world_size is not None, self._block_counts,
                      in_mix=self._in_mix)

    def _fresh(self, world: World) -> ReaderState:
        return ReaderState(self._identity.to_state(), self.epoch, world, self._plan.described())

    def _resolve(self, merged: dict[str, Any]) -> dict[str, Any]:
        """A merged state's tails read (they depend on the final map and filter steps)."""
        return resolve_tails(merged, self._spec())

    # -- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        # a reader runs its steps inside its pipeline (before or after the shuffle buffer),
        # not after it as `StreamdsDataset.__iter__` does for the types stacked on readers
        world = detect_world(self.rank, self.world_size)
        check_outer_split(self, lambda: world.world_size)
        self._note_worker_epoch()
        state = choose(self._start, self._layout(), self.epoch, world, self._resolve,
                       report=True)
        pad = pad_work_of(self._plan, state) if state.quota is not None else []
        self._active = Reader(self._spec(), state, pad_work=pad, timer=self.timer)
        if self._start.loaded is not None:  # a loaded state starts one iterator
            if self._epoch.loaded is self._start.loaded:
                self._epoch.loaded = None
            self._start = self._start.base
        return iter(self._active)

    def _note_worker_epoch(self) -> None:
        """Warn when a DataLoader worker starts the same shuffled epoch a second time.

        Only a persistent worker (``persistent_workers=True``) iterates its copy of the dataset
        twice; a forked one reads the epoch that the main process set (the same epoch again:
        set_epoch() was not called between the two), a spawned one keeps its own.
        """
        if get_worker_info() is None:
            return
        again = self._worker_epoch == self.epoch and self._start.loaded is None
        if again and self.shuffle:
            log.warning(
                "a DataLoader worker (persistent_workers=True) starts epoch %d again: every "
                "epoch repeats this order; call ds.set_epoch(epoch) before each epoch's loop "
                "(spawned persistent workers do not follow it: use forked workers, or "
                "persistent_workers=False)",
                self.epoch)
        self._worker_epoch = self.epoch

    @property
    def counts(self) -> dict[str, int]:
        """This process's counts of lines without a record (bad, blank, dropped, ...).

        Raises RuntimeError when no iterator of this dataset ran in this process, e.g. in the
        main process of a DataLoader with workers, where each worker counts in its own
        process: an empty dict would read as "nothing skipped".
        """
        if self._active is None:
            raise RuntimeError(
                "no iterator of this dataset ran in this process, so it has no counts here: "
                "with DataLoader workers each worker counts the lines it skipped in its own "
                "process; read them with streamds.counts_of(loader.state_dict()) (torchdata's "
                "StatefulDataLoader: every worker's counts) or in each worker's 'epoch N done' "
                "log line, or iterate with num_workers=0 to read ds.counts"
            )
        return self._active.counts
