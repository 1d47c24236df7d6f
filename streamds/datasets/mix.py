"""`Mix`: several datasets -> one stream, each record drawn from source i with weight w_i.

Each source is a `StreamingJsonl` with its own files, transforms and shuffle, and splits itself
across DataLoader workers and ranks as it always does, so every source keeps its own
exactly-once split. Each reader draws its records from them through a
`streamds.stages.mixing.MixStage`: the same (seed, epoch, rank, worker) give the same
sequence on any machine, and a resume regenerates the draws from their count alone.
`stop` says when a reader's stream ends: "first" (with the first source that runs out), "all"
(every record of every source exactly once) or "cycle" (sources that run out start a new pass
until each has run out once); see `streamds.stages.mixing`.

State (``state_dict()``, one per reader): the node of its `streamds.stages.mixing.MixStage`
(the draws made, the pass and records taken of each source, each source's own state nested),
with the format version at the top.

`streamds.merge_states` merges the states of every reader source by source (elastic resume);
`resume_after_batches` resumes a plain DataLoader from its batch count by replaying the draws
over record counts; `streamds.source_counts` sums "taken" over the readers of a state.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

from ..checks import check_choice, check_int
from ..errors import StateMismatchError
from ..resume.plain_loader import batches_after, require_line_per_record
from ..stages.mixing import MergedMix, MixStage
from ..stages.state import (
    FORMAT,
    STATE_FORMAT,
    check_state,
    nested,
    refuse_other_version,
    sealed,
    stage_of,
    unnested,
)
from ..stages.transform import Step
from ..world import World, detect_world
from .base import StreamdsDataset
from .epoch import SharedEpoch

__all__ = ["STOPS", "Mix"]

STOPS = ("first", "all", "cycle")


class Mix(StreamdsDataset):
    """Records drawn from several datasets in chosen proportions; exact and elastic resume.

    Example::

        pubmed = StreamingJsonl("pubmed/train-*.jsonl.zst", shuffle=True, seed=0)
        arxiv = StreamingJsonl("arxiv/train-*.jsonl.zst", shuffle=True, seed=0)
        mix = Mix([pubmed.map(featurize), arxiv.map(featurize)], [0.7, 0.3], seed=0,
                  stop="all")
        loader = StatefulDataLoader(mix, batch_size=32, num_workers=4)

    `weights` are relative (they need not sum to 1). `stop`: see the module docstring. The
    sources must share the rank and world_size they were given (or all detect them). Use
    `.taken` (this process) or `streamds.source_counts(loader.state_dict())` (every worker)
    for the records each source gave.

    `.map` and `.filter` run on the mixed records, in the reader; a map of the sources runs
    per chunk and names the file and line of a record it fails on, so prefer that where the
    function does not depend on the mixing (records a filter drops still count in `.taken`).
    `.batch` batches the mixed records (Mix refuses batched sources); `.pack` packs them;
    `.cache` stores each source's records (see `Mix.cache`). Call `mix.set_epoch` rather than
    the sources' own set_epoch, which the mix's copies do not follow (a source moved to
    another epoch than the mix's is refused when the mix starts).
    """

    KIND = "mix"

    def __init__(
        self,
        datasets: Sequence[StreamdsDataset],
        weights: Sequence[float],
        *,
        seed: int,
        stop: str = "all",
    ) -> None:
        super().__init__()
        datasets = list(datasets)
        if not datasets:
            raise ValueError("Mix needs at least one dataset, got none")
        for index, ds in enumerate(datasets):
            if not isinstance(ds, self.of_kind("reader")):
                raise ValueError(
                    f"datasets[{index}] must be a streamds.StreamingJsonl (with its own map, "
                    f"filter and shuffle), got {type(ds).__name__}; pack after mixing: "
                    "Mix(...).pack(PackTokens(...))"
                )
        batched = [index for index, ds in enumerate(datasets) if ds._batch is not None]
        if batched and len(batched) < len(datasets):  # batches and records would mix
            plain = [index for index in range(len(datasets)) if index not in batched]
            raise ValueError(
                f"datasets {batched} are batched (.batch()) and datasets {plain} are not: Mix "
                "would mix whole batches with single records; pass the unbatched datasets and "
                "batch after mixing: Mix([...], weights, seed=...).batch(n)"
            )
        weights = list(weights)
        if len(weights) != len(datasets):
            raise ValueError(
                f"weights has {len(weights)} entries for {len(datasets)} datasets; give one "
                "weight per dataset"
            )
        for index, weight in enumerate(weights):
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not (
                    math.isfinite(weight) and weight > 0):
                raise ValueError(
                    f"weights[{index}] must be a finite number > 0, got {weight!r}; leave a "
                    "dataset out rather than give it weight 0"
                )
        check_int("seed", seed, 0, "pass a non-negative integer seed")
        check_choice("stop", stop, STOPS,
                     "'first' ends with the first source that runs out, 'all' with the last, "
                     "'cycle' restarts sources until each has run out once")
        worlds = {(ds.rank, ds.world_size) for ds in datasets}
        if len(worlds) > 1:
            raise ValueError(
                f"the datasets were given different rank/world_size {sorted(worlds, key=str)}; "
                "give them all the same (or none, to detect it)"
            )
        total = sum(weights)
        # copies with epochs of their own: the mix sets them (a source's pass may be in
        # another epoch), and the user's set_epoch must not reach them ...
        self.datasets = [ds._detached() for ds in datasets]
        # ... so it is refused when it would be ignored: each source's own epoch, as given
        self._given = [(ds._epoch, ds.epoch) for ds in datasets]
        self.weights = [float(w) / total for w in weights]
        self.seed = seed
        self.stop = stop
        self.rank, self.world_size = worlds.pop()
        self._epoch = SharedEpoch(0)  # each copy's own (`_with_step`, `with_resume`)
        self._pending: MixStage | None = None  # a loaded state, for the next iterator
        self._merged: MergedMix | None = None  # a merged state (elastic resume)
        self._batch_starts: dict[int, MixStage] = {}  # worker -> start (plain loader)
        self._active: MixStage | None = None
        self._iterators: list[Iterator[Any]] = []  # the sources' iterators, while iterating
        self._held: list[Any] | None = None  # sources' states of a reader that began finished
        self._steps: tuple[Step, ...] = ()  # map and filter of the mixed records (.map/.filter)

    def __repr__(self) -> str:
        return (f"Mix({len(self.datasets)} datasets, weights={[round(w, 4) for w in self.weights]}"
                f", seed={self.seed}, stop={self.stop!r}, epoch={self.epoch})")

    _ITEMS = "this Mix"

    def _live(self) -> dict[str, Any]:
        return {"_active": None, "_iterators": [], "_held": None}

    def _config(self) -> list[Any]:
        return [list(self.weights), self.seed, self.stop, len(self.datasets)]

    def _copy(self) -> Mix:
        clone = super()._copy()
        # sources of its own: iterating the clone must not move this mix's sources
        clone.datasets = [ds._detached() for ds in self.datasets]
        clone._epoch = SharedEpoch(self.epoch)
        return clone

    def _with_cache(self, directory: str, key: str, limit: int | None) -> Mix:
        """Each source stores its records in `directory` (`StreamingJsonl.cache`), and the
        mix draws from the stored records as from the source: the same draws, records and
        states. The mixed stream itself is not stored (which records a reader draws depends
        on its world), nor what the mix's own `.map`/`.filter` make (refused after them)."""
        self._cache_refused_after_steps(self._steps, "a Mix")
        clone = self._copy()
        clone.datasets = [ds._with_cache(directory, key, limit)._detached()
                          for ds in self.datasets]
        return clone

    def _worker_items(self, num_workers: int) -> list[int]:
        """With stop="all" each reader yields every record of its sources' shares once: the
        sum of the sources' counts (each known as `StreamingJsonl.worker_records` says);
        with "first" or "cycle" the count follows each epoch's draws, and is not known."""
        if any(step.kind == "filter" for step in self._steps):
            raise TypeError("len() is unknown for a Mix with a .filter(): it may drop any "
                            "number of records")
        if self.stop != "all":
            raise TypeError(
                f"len() of a Mix with stop={self.stop!r} is unknown: where its stream ends "
                "depends on each epoch's draws; use stop='all' (every record of every source "
                "once) or pass max_steps to the trainer")
        per_source = [ds._worker_items(num_workers) for ds in self.datasets]
        return [sum(counts) for counts in zip(*per_source, strict=True)]

    def _loaded_position(self) -> MixStage | None:
        return self._pending

    @property
    def taken(self) -> list[int]:
        """Records each source gave this process's current iterator (in the main process of a
        loader with workers: nothing; use `streamds.source_counts(loader.state_dict())`)."""
        return [0] * len(self.datasets) if self._active is None else list(self._active.taken)

    # -- where a reader starts -----------------------------------------------------------

    def _start(self, world: World) -> MixStage:
        """The stage of reader `world` for this epoch; its `sources` are the sources' states
        to load (None: each source starts its own epoch, or its share of a merged state)."""
        pending = self._pending
        if pending is not None and pending.finished and pending.epoch != self.epoch:
            pending = None  # that epoch is over and another was chosen: start it afresh
        start = self._batch_starts.get(world.worker)  # after a plain loader's batches
        if pending is None and start is not None and start.epoch == self.epoch:
            pending = start
        if pending is not None:
            if pending.world != world:
                raise StateMismatchError(
                    f"the mix state was taken by reader (rank, world_size, worker, num_workers)"
                    f"={_tuple(pending.world)} but is loaded by {_tuple(world)}; resume with "
                    "the same world, or merge the states of all readers with "
                    "streamds.merge_states() and pass the result to mix.with_resume()"
                )
            stage = copy.deepcopy(pending)
            return stage
        stage = MixStage.fresh(self._config(), self.epoch, world)
        if self._merged is not None and self._merged.epoch == self.epoch:
            stage.start_merged(self._merged)
        return stage

    def _position_sources(self, stage: MixStage) -> None:
        for index, ds in enumerate(self.datasets):
            ds.set_epoch(stage.epoch + stage.passes[index])
            if stage.sources is not None:
                ds.load_state_dict(unnested(stage.sources[index]))

    # -- iteration -----------------------------------------------------------------------

    def _check_source_epochs(self) -> None:
        """Refuse to start while a source was moved to another epoch than the mix's by its
        own set_epoch() (or a dataset's derived from it) after Mix() copied it: the mix
        would ignore it and silently repeat an order."""
        for index, (holder, given) in enumerate(self._given):
            if holder.value not in (given, self.epoch):
                raise ValueError(
                    f"set_epoch({holder.value}) was called on datasets[{index}] of this Mix "
                    f"(or on a dataset derived from it) after Mix() copied it, but the mix is "
                    f"at epoch {self.epoch} and sets its sources' epochs itself; call "
                    f"mix.set_epoch({holder.value}) each epoch instead"
                )

    def _open(self) -> Iterator[Any]:
        self._check_source_epochs()
        world = detect_world(self.rank, self.world_size)
        stage = self._start(world)
        self._pending = None
        self._active = stage
        # a reader resumed finished keeps its sources' states as loaded: shown fresh, a merge
        # of its next state_dict() would read them again
        self._held = stage.sources if stage.finished else None
        if stage.finished:
            self._iterators = []
            return iter(())
        self._position_sources(stage)
        # -> each source's records, split over this reader's world by the source itself
        self._iterators = [iter(ds) for ds in self.datasets]
        # -> the records drawn from them (`streamds.stages.mixing`); the mix's own map and
        # filter run on them (`StreamdsDataset.__iter__`)
        return iter(stage.open(self._iterators, functools.partial(self._reopen, stage)))

    def _reopen(self, stage: MixStage, index: int, epoch: int) -> Iterator[Any]:
        """Source `index` from the start of `epoch` (a new pass)."""
        ds = self.datasets[index]
        ds.set_epoch(epoch)
        if stage.seat != stage.world:  # a rotated reader keeps reading its seat's shares
            ds.load_state_dict(ds._state_after_records(epoch, stage.seat, stage.world, 0))
        return iter(ds)

    # -- resuming a plain DataLoader -----------------------------------------------------

    def resume_after_batches(
        self, consumed: int, *, batch_size: int, num_workers: int, drop_last: bool = False,
        every_line_yields: bool = False,
    ) -> Mix:
        """A copy that continues this epoch after a plain DataLoader yielded `consumed` batches.

        As `StreamingJsonl.resume_after_batches`: pass the `batch_size`, `num_workers` and
        `drop_last` of that DataLoader and use the same again. Worked out from record counts
        (one counting pass per source, kept) by replaying the draws on counts alone, never by
        reading and discarding records. Exact when every line of every source yields a
        record (no dropping filter, no skipped bad lines), and refused where a source may
        drop one (a map, a filter, on_error="skip") unless `every_line_yields=True`; otherwise
        use torchdata's StatefulDataLoader with `state_dict()`.
        """
        check_int("consumed", consumed, 0, "pass the number of batches the loader yielded")
        check_int("batch_size", batch_size, 1, "pass the DataLoader's batch_size")
        check_int("num_workers", num_workers, 0, "pass the DataLoader's num_workers")
        for source in self.datasets:
            source._require_line_per_record(every_line_yields)
        require_line_per_record(self._steps, "raise", every_line_yields)
        if self._merged is not None:
            raise ValueError("resume_after_batches does not combine with with_resume; use "
                             "torchdata's StatefulDataLoader and state_dict() for that")
        here = detect_world(self.rank, self.world_size)
        readers = max(1, num_workers)
        seats = [World(here.rank, here.world_size, worker, readers) for worker in range(readers)]
        records = [sum(self._replay(seat, None).taken) for seat in seats]
        taken, next_worker = batches_after(
            records, consumed, epoch=self.epoch, batch_size=batch_size, num_workers=num_workers,
            drop_last=drop_last,
        )
        clone = copy.copy(self)
        clone._epoch = SharedEpoch(self.epoch)
        clone._pending, clone._active, clone._batch_starts = None, None, {}
        for worker in range(readers):
            old = (worker + next_worker) % readers  # the next worker in line becomes worker 0
            seat, world = seats[old], seats[worker]
            stage = self._replay(seat, min(taken[old] * batch_size, records[old]))
            stage.world = world
            stage.sources = [nested(ds._state_after_records(self.epoch + stage.passes[index],
                                                            seat, world, stage.in_pass[index]))
                             for index, ds in enumerate(self.datasets)]
            clone._batch_starts[worker] = stage
        return clone

    def _replay(self, seat: World, records: int | None) -> MixStage:
        """The stage of reader `seat` after `records` records of this epoch (None: all of
        them): the draws replayed over stand-in sources that only count."""
        def share(index: int, epoch: int) -> Iterator[int]:
            return iter(range(self.datasets[index]._share_records(epoch, seat)))

        stage = MixStage.fresh(self._config(), self.epoch, seat)
        iterators = [share(index, self.epoch) for index in range(len(self.datasets))]
        for _ in islice(stage.open(iterators, share), records):
            pass
        return stage

    # -- state ---------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """This reader's position: a few integers per source plus each source's own state."""
        if self._active is not None:
            sources = (copy.deepcopy(self._held) if self._held is not None
                       else [nested(ds.state_dict()) for ds in self.datasets])
            return sealed(self._active.get_state(sources))
        if self._pending is not None:
            return sealed(self._pending.get_state(copy.deepcopy(self._pending.sources)))
        stage = self._start(detect_world(self.rank, self.world_size))
        self._position_sources(stage)
        return sealed(stage.get_state([nested(ds.state_dict()) for ds in self.datasets]))

    def _load(self, state: dict[str, Any]) -> None:
        """A mix's state (its sources' states are loaded at the next `iter()`)."""
        check_state(state, MixStage.STAGE, MixStage.KEYS, "mix dataset")
        stage = MixStage.load(state, self._config())
        for source in stage.sources or ():  # loaded at the next iter(); refuse old ones now
            refuse_other_version(source)
        self._active = None
        self._pending = stage
        if not stage.finished:  # a finished state leaves the epoch to set_epoch
            self.epoch = stage.epoch

    def _epoch_of_state(self, state: dict[str, Any]) -> tuple[int, bool]:
        """(epoch, finished) of a state this mix's `state_dict()` returned."""
        stage = MixStage.load(state, self._config())
        return stage.epoch, stage.finished

    def _resumed(self, merged: dict[str, Any]) -> Mix:
        """A copy whose sources finish their part of `merged` (`streamds.merge_states` of
        the states of every reader of this mix), drawing as the merged draws say."""
        clone = copy.copy(self)
        clone._pending = None
        clone._active = None
        clone._resume(merged)
        return clone

    def _resume(self, merged: dict[str, Any]) -> None:
        if stage_of(merged) != MixStage.MERGED or merged.get(FORMAT) != STATE_FORMAT:
            raise ValueError(
                "with_resume needs the dict streamds.merge_states() returns for the states "
                "of a Mix; to resume with the same world, use load_state_dict() instead"
            )
        found = MergedMix.from_node(merged)
        MixStage.check_config(found.config, self._config())
        self.datasets = [ds.with_resume(unnested(state)) for ds, state in
                         zip(self.datasets, found.sources, strict=True)]
        self._epoch = SharedEpoch(found.epoch)  # the copy's own, as with_resume makes it
        self._merged = dataclasses.replace(found, sources=[])  # the datasets hold them now


def _tuple(world: World) -> tuple[int, int, int, int]:
    return (world.rank, world.world_size, world.worker, world.num_workers)
