"""`StreamingJsonl`: the public IterableDataset, a picklable description of a pipeline.

Nothing opens in the constructor beyond listing the source. The dataset holds one `Start`
(where its next iterator starts: fresh, loaded, a merged state, a plain loader's batch count);
each iterator (one per DataLoader worker) detects its world, turns that into one `ReaderState`
(`streamds.resume.start.choose`) and builds its pipeline from it: one path. How the files are
reached is one `streamds.Storage`.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import get_worker_info

from ..checks import check_bool, check_choice, check_int, size_setting
from ..errors import StateMismatchError
from ..resume.counts import count_block_records, listed_counts
from ..resume.identity import Identity, check_identity, relative_names, source_root
from ..resume.merge import MERGED_STATE, START_KEYS, resolve_tails
from ..resume.plain_loader import batches_after, require_line_per_record
from ..resume.start import (
    AFTER_BATCHES,
    MERGED,
    Layout,
    Merged,
    Start,
    after_batches,
    after_records,
    choose,
    describe,
    pad_work_of,
    with_quota,
)
from ..retry import RetryPolicy
from ..stages.balance import EVEN_RANKS
from ..stages.batch import Batch, BatchSpec, RecordBatch
from ..stages.buckets import RULES, LengthBuckets, TokenBudget, is_pool_state
from ..stages.cache import RecordsCache
from ..stages.cpus import WORKER_CPUS
from ..stages.parse import ON_ERROR
from ..stages.pipeline import Reader, Spec
from ..stages.state import ReaderState, check_epoch_change, refuse_other_version, stage_of
from ..stages.timing import StageTimer
from ..stages.transform import Step, describe_step, step_settings
from ..storage.plan import Plan, make_blocks, small_corpus_piece
from ..storage.read import open_decoded_at
from ..storage.readahead import DEFAULT_READAHEAD, wants_readahead
from ..storage.records_cache import RecordStore, block_key, uncacheable
from ..storage.settings import Storage, storage_of
from ..storage.shards import Shard, resolve_shards, source_items, with_columns
from ..world import World, detect_world
from .base import StreamdsDataset
from .callers import check_outer_split, loader_len_call
from .epoch import SharedEpoch
from .pack import Packed, PackTokens

__all__ = ["StreamingJsonl"]

log = logging.getLogger(__name__)

MAX_SEED = (1 << 64) - 1  # seeds are 64-bit, as torch's and numpy's are
SAMPLE_BYTES = 1 << 16  # read to guess the size of records where no manifest says it



class StreamingJsonl(StreamdsDataset):
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
        self._batch: BatchSpec | None = None  # whole batches out of the workers (.batch)
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
        self._plan = Plan(len(self._block_list), seed, shuffle)
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

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_active"] = None  # a live pipeline stays in the process that made it
        return state

    @property
    def epoch(self) -> int:
        return self._epoch.value

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch.value = value

    def _detached(self) -> StreamingJsonl:
        """A copy with an epoch of its own, for a `streamds.Mix`, which sets the epochs of
        its sources itself (each source's pass may be in another epoch)."""
        clone = copy.copy(self)
        clone._epoch = SharedEpoch(self.epoch)
        clone._epoch.loaded = clone._start.loaded
        clone._active = None
        clone._in_mix = True
        return clone

    def _spec(self) -> Spec:
        opener = functools.partial(open_decoded_at, retry=self.retry, cache=self._cache)
        return Spec(self._shards, self._block_list, self._plan, self._steps, self.on_error,
                    self.buffer_size, self.retry, opener, batch=self._batch,
                    readahead=self.readahead, cache=self._cache, worker_cpus=self.worker_cpus,
                    records_cache=self._records_cache, even_ranks=self.even_ranks)

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
        clone = copy.copy(self)
        clone._steps = (*self._steps, step)
        clone._active = None
        clone._start = self._start.for_new_steps()  # merged tails resolve with the new steps
        return clone

    def cache(self, directory: str | os.PathLike, *, key: str,
              limit: int | str | None = None) -> StreamingJsonl:
        """A new dataset that stores the records the steps so far make (the parse and the
        `.map`/`.filter` steps added before it) in `directory` on local disk, in the first
        epoch that reads each block, and reads them back in later epochs and resumes instead
        of reading, parsing and mapping again: the same records in the same order, with the
        same states, as without it. Steps added after `.cache()` run on the stored records.

        `key` names what the steps compute (the tokenizer and its settings: steps are told
        apart by their names and their arguments' reprs where stable, never by their code;
        a step whose settings have no stable repr is logged): another key, a
        changed source file (name, size, manifest checksum, or modification time), another
        on_error or steps of other names never read records stored under the old one.
        `limit`: bytes the directory may hold (an int or a size such as "10GB"; None: no
        bound); least recently used blocks go first. The directory is shared by the workers
        and ranks of one machine (one writer per block). Each reader checks the shards it
        reads against their storage once per epoch (a stat; a HEAD request remotely), so a
        file rewritten under a long-lived dataset is read anew. Shards whose storage gives no
        modification time and no manifest checksum cannot be told stale: they are read as
        without a cache (logged once).
        What the steps make must be dicts of str, int, float, bool, None, lists, bytes,
        numpy arrays or torch tensors (`streamds.storage.records_cache`). Counts (dropped,
        blank and skipped lines) are the same as without the cache.

        ``ds.map(tokenize).cache("/content/cache", key="bpe-32k")``
        """
        if self._records_cache is not None:
            raise ValueError("cache() was called twice on this dataset; call it once, after "
                             "the steps whose records are worth storing")
        if not isinstance(directory, (str, os.PathLike)) or "://" in os.fspath(directory):
            raise ValueError(f"cache directory must be a local path, got {directory!r}; "
                             "put the cache on the machine's own disk (e.g. /content/cache "
                             "on Colab), not on a remote or mounted source")
        directory = os.path.expanduser(os.fspath(directory))  # "~/cache": the home's
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"cache directory {directory!r} is a file; pass a directory "
                             "(made if missing)")
        if not isinstance(key, str) or not key:
            raise ValueError(f"cache key must be a non-empty str naming what the steps "
                             f"compute (e.g. the tokenizer and its settings), got {key!r}")
        limit = None if limit is None else size_setting(
            "limit", limit, "the bytes the cache directory may hold, or None for no bound")
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
        clone = copy.copy(self)
        clone._records_cache = RecordsCache(
            RecordStore(directory, limit), keys, len(steps), tuple(self._shards),
            tuple(self._block_list), tuple(names), key, upstream)
        clone._active = None
        return clone

    def pack(self, packer: PackTokens) -> Packed:
        """Tokenized records packed into fixed-length sequences (`streamds.PackTokens`)."""
        return Packed(self, packer)

    def with_resume(self, merged: dict[str, Any]) -> StreamingJsonl:
        """A copy that finishes the epoch of `merged` (from `streamds.merge_states`) under this
        dataset's world (elastic resume)."""
        clone = copy.copy(self)
        clone._start = Start(MERGED, Merged(clone._check_merged(merged)))
        clone._active = None
        return clone

    def batch(
        self, size: int | LengthBuckets | TokenBudget, *,
        collate: Callable[[list[Any]], Any] | None = None, drop_last: bool = False,
        ahead: int | str = "auto", worker_cpus: str = "auto",
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
            if drop_last:
                raise ValueError(
                    f"drop_last=True with {size!r}: pass drop_last to LengthBuckets instead "
                    "(a token budget drops nothing)"
                )
            spec = BatchSpec(getattr(size, "batch_size", None), collate,
                             getattr(size, "drop_last", False), rule=size, ahead=ahead)
        else:
            check_int("size", size, 1, "the number of records per batch, or a "
                      "streamds.LengthBuckets / TokenBudget rule")
            spec = BatchSpec(size, collate, drop_last, ahead=ahead)
        clone = copy.copy(self)
        clone._batch = spec
        clone.worker_cpus = worker_cpus
        clone._active = None
        return clone

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch: it seeds the block order and the shuffle buffer.

        A dataset and every copy derived from it (`map`, `filter`, `batch`, `pack`,
        `with_resume`, `resume_after_batches`) share one epoch: ``base.set_epoch(e)`` reaches
        a loader over ``base.map(f)``. A `streamds.Mix` sets its sources' epochs itself: call
        ``mix.set_epoch(e)`` (a source's own call that the mix would ignore is refused).

        A loaded state in the middle of another epoch refuses: finish that epoch first.
        Call it before each epoch's loop: DataLoader workers read the epoch when their
        iterator starts; forked persistent workers (Linux's default) follow it too
        (`streamds.datasets.epoch.SharedEpoch`), spawned ones keep the epoch they started
        with. A worker that starts the same shuffled epoch twice logs a warning.
        """
        check_int("epoch", epoch, 0, "epochs count from 0")
        check_epoch_change(self._epoch.loaded, epoch,
                           or_else="or build a fresh dataset to skip its remaining records")
        # accelerate's loaders call this on every process before an epoch's first batch
        check_outer_split(self, lambda: detect_world(self.rank, self.world_size).world_size)
        self.epoch = epoch

    # -- where a reader starts (`streamds.resume.start`) ------------------------------------------

    def _layout(self) -> Layout:
        return Layout(self._identity.to_state(), self._shards, self._block_list, self._plan,
                      self.seed, self.shuffle, self.buffer_size, self.even_ranks,
                      self.rank is not None or self.world_size is not None, self._block_counts,
                      in_mix=self._in_mix)

    def _fresh(self, world: World) -> ReaderState:
        return ReaderState(self._identity.to_state(), self.epoch, world,
                           (self._plan.num_blocks, self.seed, self.shuffle))

    def _resolve(self, merged: dict[str, Any]) -> dict[str, Any]:
        """A merged state's tails read (they depend on the final map and filter steps)."""
        return resolve_tails(merged, self._spec())

    # -- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
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

    # -- length: where the record count is known ----------------------------------------

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

    def __len__(self) -> int:
        """This rank's records per epoch (batches after `.batch(n)`), where known.

        Seen from a DataLoader with workers and a batch_size, which divides len() by its
        batch_size while each worker's last batch is short, every worker's short batch counts
        as a whole one, so that `len(loader)` is the number of batches the loader yields (what
        Trainer and progress bars use it for). See `worker_records` for when it is known.
        """
        call = loader_len_call()
        records = self.worker_records(0 if call is None else call.num_workers)
        if self._batch is not None:
            if self._batch.size is None or self._batch.rule is not None:
                raise TypeError("len() is unknown for batches cut by a LengthBuckets or "
                                "TokenBudget rule")
            return sum(_batches(count, self._batch.size, self._batch.drop_last)
                       for count in records)
        if call is not None and call.batch_size is not None and len(records) > 1:
            return call.batch_size * sum(_batches(count, call.batch_size, call.drop_last)
                                         for count in records)
        return sum(records)

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position of this process's iterator, for torchdata's StatefulDataLoader.

        O(1) to take: positions of buffered records are packed once per buffer's worth of
        records (see `streamds.stages.shuffle`), never per call. Before the first `iter()` it is
        where that iterator will start, as described (a loaded state, a merged state as
        merged, a plain-loader start, or a fresh epoch): taking it reads no data and refuses
        nothing, and loading it starts the same way.
        """
        if self._active is not None:
            return self._active.reader_state().to_dict()
        world = detect_world(self.rank, self.world_size)
        return describe(self._start, self._layout(), self.epoch, world)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` at the next `iter()`; refuses a state of another dataset.

        A state taken in the middle of an epoch sets the epoch to its own. A state taken after
        its epoch ran out leaves the epoch as it is: the next iterator of that same epoch yields
        nothing (it is finished), and any other epoch (`set_epoch`, before or after loading)
        starts at its beginning, as an uninterrupted run would. A merged state (what
        `state_dict()` returns before the first `iter()` of a dataset that finishes one)
        loads as `with_resume` takes it.
        """
        if isinstance(state, dict):
            refuse_other_version(state)
        if stage_of(state) == MERGED_STATE:
            self._active = None
            self._start = Start(MERGED, Merged(self._check_merged(state)))
            return
        loaded = ReaderState.from_dict(state)
        check_identity(loaded.fingerprint, self._identity, "the state")
        if loaded.plan[0] != self._plan.num_blocks:
            raise StateMismatchError(
                f"the state was taken with the corpus cut into {loaded.plan[0]} blocks, but "
                f"this dataset cuts it into {self._plan.num_blocks} (another streamds "
                "version?); finish the epoch with the version that took the state, or "
                "restart the epoch"
            )
        if loaded.pipeline is not None:
            made, taking = _batching(loaded.pipeline), self._batching()
            if made != taking:
                raise StateMismatchError(
                    f"the state was taken from a dataset {made} but is loaded into one "
                    f"{taking}; build the dataset the same way (streamds.merge_states() of it "
                    "resumes a dataset batched any way)"
                )
        self._active = None
        if not loaded.finished:
            self.epoch = loaded.epoch
        self._start = self._start.load(copy.deepcopy(loaded))
        self._epoch.loaded = self._start.loaded

    def _epoch_of_state(self, state: dict[str, Any]) -> tuple[int, bool]:
        """(epoch, finished) of a state this dataset's `state_dict()` returned (a reader's, or
        the merged state a resumed reader starts from), for a stage built on this one."""
        if stage_of(state) == MERGED_STATE:
            return state["epoch"], False
        loaded = ReaderState.from_dict(state)
        return loaded.epoch, loaded.finished

    def _batching(self) -> str:
        """How this dataset batches, in the words of `_batching(pipeline state)`."""
        if self._batch is None:
            return "without .batch()"
        return "with .batch(n)" if self._batch.rule is None else "with .batch(rule)"

    def _check_merged(self, merged: dict[str, Any] | None) -> dict[str, Any] | None:
        if merged is None:
            return None
        if isinstance(merged, dict):
            refuse_other_version(merged)
        if stage_of(merged) != MERGED_STATE:
            raise ValueError(
                "with_resume needs the dict streamds.merge_states() returns; to resume with "
                "the same world, use load_state_dict() instead"
            )
        check_identity(merged["fingerprint"], self._identity, "the merged state")
        self.epoch = merged["epoch"]
        # a reader's start (state_dict() before iter()) loads as the merged state it names
        return {key: copy.deepcopy(value) for key, value in merged.items()
                if key not in START_KEYS}

    # -- resuming a plain DataLoader -----------------------------------------------------

    def resume_after_batches(
        self, consumed: int, *, batch_size: int, num_workers: int, drop_last: bool = False,
        every_line_yields: bool = False,
    ) -> StreamingJsonl:
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
        clone = copy.copy(self)
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

def _batches(records: int, size: int, drop_last: bool) -> int:
    return records // size if drop_last else -(-records // size)


def _batching(pipeline: dict[str, Any]) -> str:
    """How the dataset that took a pipeline state batched."""
    if is_pool_state(pipeline):
        return "with .batch(rule)"
    return "with .batch(n)" if Batch.owns(pipeline) else "without .batch()"
