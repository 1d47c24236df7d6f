"""`StreamingJsonl`: the public IterableDataset, a picklable description of a pipeline.

Nothing opens in the constructor beyond listing the source; each iterator (one per DataLoader
worker) detects its world, plans its blocks and builds its own pipeline.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import orjson
from torch.utils.data import IterableDataset

from .balance import EVEN_RANKS, quotas
from .errors import StateMismatchError
from .index import count_block_records, count_from
from .parse import ON_ERROR
from .plan import DEFAULT_BLOCK_SIZE, MIN_BLOCK_SIZE, make_blocks
from .resume import MERGED_FORMAT, STATE_FORMAT, reader_work, share_of
from .retry import RetryPolicy
from .seeds import derive_seed
from .shards import Shard, resolve_shards
from .shuffle import ShuffleBuffer
from .skip import batches_per_reader, reader_state_after
from .stream import Position, RecordStream, WorkItem
from .transform import Step, compose
from .world import World, detect_world

__all__ = ["StreamingJsonl"]


def _check_int(name: str, value: Any, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}; {fix}")


class StreamingJsonl(IterableDataset):
    """Stream JSON-lines records from files, directories, globs or fsspec URLs.

    Each epoch yields every record of the corpus exactly once across all DataLoader workers
    and distributed ranks. With ``shuffle=False`` and one reader, records come in file order.

    Example::

        ds = StreamingJsonl("data/train-*.jsonl.zst", shuffle=True, seed=0)
        ds = ds.map(lambda r: {"text": r["article_text"]})
        loader = DataLoader(ds, batch_size=32, num_workers=4)
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        shuffle: bool = False,
        seed: int = 0,
        buffer_size: int = 1000,
        transform: Callable[[Any], Any] | None = None,
        on_error: str = "raise",
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        resume_from: dict[str, Any] | None = None,
        even_ranks: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be True or False, got {shuffle!r}")
        _check_int("seed", seed, 0, "pass a non-negative integer seed")
        _check_int("buffer_size", buffer_size, 1, "use shuffle=False to disable shuffling")
        _check_int("block_size", block_size, MIN_BLOCK_SIZE, "blocks are at least 64 KiB")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable or None, got {transform!r}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if world_size is not None:
            _check_int("world_size", world_size, 1, "the number of distributed processes")
        if rank is not None:
            _check_int("rank", rank, 0, "this process's index among world_size processes")
            if world_size is not None and rank >= world_size:
                raise ValueError(
                    f"rank must be < world_size={world_size}, got {rank}; ranks count from 0"
                )
        if even_ranks not in EVEN_RANKS:
            raise ValueError(
                f"even_ranks must be one of {EVEN_RANKS}, got {even_ranks!r}; 'drop' trims "
                "every rank to the smallest, 'pad' repeats records up to the largest"
            )
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ValueError(f"storage_options must be a dict, got {storage_options!r}")
        self.shuffle = shuffle
        self.seed = seed
        self.buffer_size = buffer_size
        self.on_error = on_error
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.even_ranks = even_ranks
        self.retry = RetryPolicy()
        self.epoch = 0
        self._steps: tuple[Step, ...] = (("map", transform),) if transform is not None else ()
        self._shards: list[Shard] = resolve_shards(source, storage_options, on_error=on_error)
        self._fingerprint = self._make_fingerprint()
        # -> Block(shard, start, end) list: the corpus cut into line-aligned units, once
        self._block_list = make_blocks(self._shards, self.block_size)
        self._num_blocks = len(self._block_list)
        self._resume_from = self._check_merged(resume_from)
        # records per block, counted once here so every worker shares them (even ranks only)
        self._block_counts: list[int] | None = None
        if even_ranks is not None:
            self._block_counts = count_block_records(self._shards, self._block_list)
        self._pending_state: dict[str, Any] | None = None
        self._worker_states: dict[int, dict[str, Any]] = {}  # from resume_after_batches
        self._active: RecordStream | ShuffleBuffer | None = None
        self._active_world: World | None = None

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
        state["_active_world"] = None
        return state

    def _make_fingerprint(self) -> str:
        described = [
            [s.url, s.size, s.format, s.codec, len(s.frames or ())] for s in self._shards
        ]
        layout = [described, self.block_size, self.shuffle, self.seed, self.buffer_size]
        return hashlib.blake2b(orjson.dumps(layout), digest_size=12).hexdigest()

    def _with_step(self, step: Step) -> StreamingJsonl:
        clone = copy.copy(self)
        clone._steps = (*self._steps, step)
        clone._active = None
        return clone

    def map(self, fn: Callable[[Any], Any]) -> StreamingJsonl:
        """A new dataset whose records are `fn(record)`; None drops the record."""
        if not callable(fn):
            raise ValueError(f"map needs a callable, got {fn!r}")
        return self._with_step(("map", fn))

    def filter(self, predicate: Callable[[Any], bool]) -> StreamingJsonl:
        """A new dataset keeping the records for which `predicate(record)` is true."""
        if not callable(predicate):
            raise ValueError(f"filter needs a callable, got {predicate!r}")
        return self._with_step(("filter", predicate))

    def resume_after_batches(
        self, consumed: int, *, batch_size: int, num_workers: int, drop_last: bool = False
    ) -> StreamingJsonl:
        """A copy that continues this epoch after a plain DataLoader yielded `consumed` batches.

        Pass the `batch_size`, `num_workers` and `drop_last` of that DataLoader and use the same
        again. Computed from record counts per block (one counting pass over the data, kept
        for later calls), never by reading and discarding records; the resumed loader yields
        exactly what the interrupted one would have, in the same order. Exact only when
        every line yields a record (no dropping filter, no skipped bad lines); otherwise use
        torchdata's StatefulDataLoader with `state_dict()`.

        Example::

            loader = DataLoader(ds.resume_after_batches(step, batch_size=32, num_workers=4),
                                batch_size=32, num_workers=4)
        """
        _check_int("consumed", consumed, 0, "pass the number of batches the loader yielded")
        _check_int("batch_size", batch_size, 1, "pass the DataLoader's batch_size")
        _check_int("num_workers", num_workers, 0, "pass the DataLoader's num_workers")
        if self.even_ranks is not None or self._resume_from is not None:
            raise ValueError(
                "resume_after_batches does not combine with even_ranks or resume_from; use "
                "torchdata's StatefulDataLoader and state_dict() for those"
            )
        if self._block_counts is None:
            self._block_counts = count_block_records(self._shards, self._block_list)
        counts, blocks = self._block_counts, self._block_list
        here = detect_world(self.rank, self.world_size)
        readers = max(1, num_workers)
        works = [
            reader_work(self._plan(None), self.epoch,
                        World(here.rank, here.world_size, worker, readers))
            for worker in range(readers)
        ]
        records = [sum(counts[block] for block, _ in work) for work in works]
        taken, next_worker = batches_per_reader(
            records, consumed, batch_size=batch_size, drop_last=drop_last
        )
        clone = copy.copy(self)
        clone._worker_states = {}
        for worker in range(readers):
            old = (worker + next_worker) % readers  # the next worker in line becomes worker 0
            stream = reader_state_after(
                min(taken[old] * batch_size, records[old]),
                work=works[old], counts=[counts[block] for block, _ in works[old]],
                shards=self._shards, blocks=blocks, shuffle=self.shuffle,
                buffer_size=self.buffer_size,
                rng_seed_parts=("buffer", self.seed, self.epoch, here.rank, old),
            )
            clone._worker_states[worker] = {
                "format": STATE_FORMAT, "fingerprint": self._fingerprint, "epoch": self.epoch,
                "world": [here.rank, here.world_size, worker, readers],
                "plan": self._plan(works[old]), "stream": stream,
            }
        return clone

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch: it seeds the block order and the shuffle buffer."""
        _check_int("epoch", epoch, 0, "epochs count from 0")
        self.epoch = epoch

    # -- iteration -----------------------------------------------------------------------

    def _plan(
        self, explicit_work: list[WorkItem] | None, quota: int | None = None
    ) -> dict[str, Any]:
        """What a reader's work derives from (explicit after an elastic resume), and its
        record quota under even_ranks."""
        work = None if explicit_work is None else [list(item) for item in explicit_work]
        return {"blocks": self._num_blocks, "seed": self.seed, "shuffle": self.shuffle,
                "work": work, "quota": quota}

    def _reader_records(self, work: list[WorkItem], blocks: list) -> int:
        assert self._block_counts is not None
        return sum(
            self._block_counts[block_id] if start is None else
            count_from(self._shards[blocks[block_id].shard], blocks[block_id], block_id, start)
            for block_id, start in work
        )

    def _quota(
        self, world: World, epoch: int, explicit: list[WorkItem] | None, blocks: list,
        known: int | None,
    ) -> tuple[int | None, list[WorkItem]]:
        """(records this reader yields, work to repeat when short) under even_ranks; a quota
        `known` from a loaded state is kept, never recounted."""
        own = reader_work(self._plan(explicit), epoch, world)
        everything = reader_work(self._plan(None), epoch, World())
        if known is not None:
            return known, own or everything
        merged = self._resume_from if explicit is not None else None
        counts = []
        for rank in range(world.world_size):
            for worker in range(world.num_workers):
                other = World(rank, world.world_size, worker, world.num_workers)
                if merged is not None:
                    work, pending, _ = share_of(merged, other)
                    counts.append(self._reader_records(work, blocks) + len(pending))
                else:
                    work = reader_work(self._plan(explicit), epoch, other)
                    counts.append(self._reader_records(work, blocks))
        quota = quotas(counts, world.world_size, self.even_ranks)[world.reader]
        return quota, own or everything

    def _build(
        self, world: World, epoch: int, work: list[WorkItem], explicit: list[WorkItem] | None,
        prefilled: int, quota: int | None,
    ) -> RecordStream | ShuffleBuffer:
        blocks = self._block_list
        # -> how many records this reader yields when ranks must be even, and what it repeats
        pad_work: list[WorkItem] = []
        if self.even_ranks is not None:
            computed, pad_work = self._quota(world, epoch, explicit, blocks, known=quota)
            quota = computed if quota is None else quota
        limit = None if quota is None else max(0, quota - prefilled)
        # -> parsed, transformed records of this reader's blocks, each with its position
        records = RecordStream(
            self._shards, blocks, work, on_error=self.on_error, apply=compose(self._steps),
            retry=self.retry, limit=limit, pad_work=pad_work,
        )
        if not self.shuffle:
            return records
        # -> the same records through a seeded shuffle buffer
        rng_seed = derive_seed("buffer", self.seed, epoch, world.rank, world.worker)
        return ShuffleBuffer(records, size=self.buffer_size, rng_seed=rng_seed)

    def _start(
        self, world: World
    ) -> tuple[int, dict | None, list[WorkItem] | None, list[Position], dict | None, int | None]:
        """(epoch, stream state, explicit work, records to prefill, counts carried over,
        quota kept in a loaded state)."""
        state = self._pending_state
        if state is None and world.worker in self._worker_states:
            state = self._worker_states[world.worker]
            state = state if state["epoch"] == self.epoch else None
        if state is not None:
            self._check_world(state, world)
            work = state["plan"]["work"]
            explicit = None if work is None else [(b, s) for b, s in work]
            return state["epoch"], state["stream"], explicit, [], None, state["plan"]["quota"]
        merged = self._resume_from
        if merged is not None and merged["epoch"] == self.epoch:
            work, pending, counts = share_of(merged, world)
            return self.epoch, None, work, pending, counts, None
        return self.epoch, None, None, [], None, None

    def _prepare(self, world: World) -> tuple[RecordStream | ShuffleBuffer, int, dict]:
        """This reader's pipeline, positioned where it starts: (pipeline, epoch, plan)."""
        epoch, stream_state, explicit, pending, carried, quota = self._start(world)
        # -> the (block id, start) items this reader (rank x worker) owns this epoch
        work = reader_work(self._plan(explicit), epoch, world)
        pipeline = self._build(world, epoch, work, explicit, len(pending), quota)
        plan = self._plan(explicit, pipeline.quota)
        pipeline.reset(stream_state)
        if carried:
            pipeline.add_counts(carried)
        if pending:  # records that sat in a shuffle buffer when the old world stopped
            assert isinstance(pipeline, ShuffleBuffer), "pending records need shuffle=True"
            pipeline.prefill(pending)
        return pipeline, epoch, plan

    def __iter__(self) -> Iterator[Any]:
        world = detect_world(self.rank, self.world_size)
        pipeline, epoch, plan = self._prepare(world)
        self._pending_state = None  # a loaded state is used once
        self._active, self._active_world, self._active_epoch = pipeline, world, epoch
        self._active_plan = plan
        return iter(pipeline)

    @property
    def counts(self) -> dict[str, int]:
        """This process's counts of lines without a record (bad, blank, dropped, ...)."""
        return {} if self._active is None else self._active.counts

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position of this process's iterator, for torchdata's StatefulDataLoader.

        Holds positions and generator state, never records: O(buffer_size) integers.
        """
        if self._active is None:
            if self._pending_state is not None:
                return copy.deepcopy(self._pending_state)
            world = detect_world(self.rank, self.world_size)
            pipeline, epoch, plan = self._prepare(world)  # where an iterator would start
            stream = pipeline.get_state()
        else:
            world, stream, epoch = self._active_world, self._active.get_state(), self._active_epoch
            plan = self._active_plan
        return {
            "format": STATE_FORMAT,
            "fingerprint": self._fingerprint,
            "epoch": epoch,
            "world": [world.rank, world.world_size, world.worker, world.num_workers],
            "plan": plan,
            "stream": stream,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` at the next `iter()`; refuses a state of another dataset."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateMismatchError(
                f"not a streamds state (format {STATE_FORMAT!r} expected); pass the dict that "
                "state_dict() returned"
            )
        if state["fingerprint"] != self._fingerprint:
            raise StateMismatchError(
                "the state was taken from a dataset with other files, seed, shuffle, "
                "buffer_size or block_size; build the dataset with the same arguments"
            )
        self._pending_state = copy.deepcopy(state)
        self.epoch = state["epoch"]

    def _check_merged(self, merged: dict[str, Any] | None) -> dict[str, Any] | None:
        if merged is None:
            return None
        if not isinstance(merged, dict) or merged.get("format") != MERGED_FORMAT:
            raise ValueError(
                "resume_from must be the dict streamds.merge_states() returns; to resume with "
                "the same world, use load_state_dict() instead"
            )
        if merged["fingerprint"] != self._fingerprint:
            raise StateMismatchError(
                "resume_from was merged from a dataset with other files, seed, shuffle, "
                "buffer_size or block_size; build the dataset with the same arguments"
            )
        self.epoch = merged["epoch"]
        return copy.deepcopy(merged)

    @staticmethod
    def _check_world(state: dict[str, Any], world: World) -> None:
        saved = state["world"]
        current = [world.rank, world.world_size, world.worker, world.num_workers]
        if saved is not None and state["stream"] is not None and saved != current:
            raise StateMismatchError(
                f"the state was taken by reader (rank, world_size, worker, num_workers)="
                f"{tuple(saved)} but is loaded by {tuple(current)}; resume with the same "
                "world, or merge the states of all readers with streamds.merge_states()"
            )
