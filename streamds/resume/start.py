"""Where a reader starts: a dataset's `Start` -> the one `ReaderState` its iterator runs from.

A dataset holds one `Start`: a fresh epoch, a merged state to finish (elastic resume), the
per-worker states after a plain loader's batches (`resume_after_batches`), or a state loaded
with `load_state_dict` on top of one of those (it starts one iterator, then the one below
applies again). The functions here are pure over what they are given; the only reads are the
seams passed in (`resolve`: a merged state's tails), so `describe` -- the state that
`state_dict()` returns before the first `iter()` -- never reads data and never raises.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from ..errors import StateMismatchError
from ..seeds import shuffle_seed_parts
from ..stages.balance import check_split, empty_rank, pad_work, quotas
from ..stages.buckets import LengthBuckets
from ..stages.chunks import HandedOut, Position, WorkItem
from ..stages.description import ReaderDescription
from ..stages.pipeline import state_after
from ..stages.state import ReaderState
from ..storage.plan import Block, Plan
from ..storage.shards import Shard, unsplit_note
from ..world import World
from .block_counts import count_from
from .merge import MERGED_READER, share_of
from .plain_loader import records_state_after

__all__ = ["AFTER_BATCHES", "FRESH", "LOADED", "MERGED", "Layout", "Merged", "Start",
           "after_batches", "after_records", "choose", "describe", "fresh", "pad_work_of",
           "records_of", "with_quota"]

log = logging.getLogger(__name__)

FRESH, LOADED, MERGED, AFTER_BATCHES = "fresh", "loaded", "merged", "after_batches"
# (corpus fingerprint, rank, world_size) of idle ranks already logged: said once per process
_EMPTY_RANKS_SAID: set[tuple[str, int, int]] = set()

Resolve = Callable[[dict[str, Any]], dict[str, Any]]  # merged state -> the same, tails read


class Merged:
    """A merged state to finish under this world, and the same with its tails read (once per
    process: the tails depend on the map and filter steps, so a new step drops them)."""

    __slots__ = ("resolved", "sizes", "state")

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.resolved: dict[str, Any] | None = None
        self.sizes: list[int] | None = None  # records of each remaining item (even ranks)

    def share(self, world: World, resolve: Resolve, layout: Layout | None = None
              ) -> tuple[list[WorkItem], list[Position], dict[str, int]]:
        """Reader `world`'s work, prefill and carried counts of the merged state; with a
        `layout` under even_ranks, work dealt by record count (`share_of`)."""
        if self.resolved is None:
            self.resolved = resolve(self.state)
        if layout is None or layout.even_ranks is None:
            return share_of(self.resolved, world)
        if self.sizes is None:
            self.sizes = [records_of(layout, [(block, start)])
                          for block, start in self.resolved["remaining"]]
        return share_of(self.resolved, world, self.sizes)


@dataclass(frozen=True)
class Start:
    """Where the next iterator of a dataset starts (`kind`), with what it needs (`payload`):
    FRESH nothing; LOADED a `ReaderState`, over `then` (where iterators start after it);
    MERGED a `Merged`; AFTER_BATCHES {worker: ReaderState}. Each applies to its own epoch
    only; any other epoch starts fresh."""

    kind: str = FRESH
    payload: Any = None
    then: Start | None = None

    @property
    def base(self) -> Start:
        """The lasting start under a loaded state (itself when nothing is loaded)."""
        return self.then if self.kind == LOADED and self.then is not None else self

    @property
    def loaded(self) -> ReaderState | None:
        return self.payload if self.kind == LOADED else None

    @property
    def merged(self) -> dict[str, Any] | None:
        """The merged state this dataset finishes, if any."""
        base = self.base
        return base.payload.state if base.kind == MERGED else None

    def load(self, state: ReaderState) -> Start:
        return Start(LOADED, state, self.base)

    def under(self, base: Start) -> Start:
        """`base` as the lasting start, keeping a loaded state on top."""
        return Start(LOADED, self.payload, base) if self.kind == LOADED else base

    def for_new_steps(self) -> Start:
        """The same start for a dataset with other map/filter steps (read tails dropped)."""
        base = self.base
        if base.kind != MERGED:
            return self
        return self.under(Start(MERGED, Merged(base.payload.state)))


@dataclass(frozen=True)
class Layout:
    """What choosing a start needs to know of a dataset: its corpus cut into blocks, its plan,
    settings and, where taken, records per block."""

    fingerprint: dict[str, Any]  # the identity's state
    shards: Sequence[Shard]
    blocks: Sequence[Block]
    plan: Plan
    seed: int
    shuffle: bool
    buffer_size: int
    even_ranks: str | None
    world_given: bool  # rank= or world_size= passed (a split by hand)
    block_counts: Sequence[int] | None
    in_mix: bool = False  # a source of a streamds.Mix: its rank may read the other sources


def fresh(layout: Layout, epoch: int, world: World) -> ReaderState:
    return ReaderState(layout.fingerprint, epoch, world, layout.plan.described())


def describe(start: Start, layout: Layout, epoch: int, world: World) -> dict[str, Any]:
    """The state of a reader that has not started: the loaded state, the merged state (as
    merged: its tails unread), the plain-loader start, or a fresh epoch (its even_ranks quota
    counted when it starts). Reads nothing, refuses nothing; loads back to the same start."""
    loaded = start.loaded
    if loaded is not None and loaded.epoch == epoch:
        return copy.deepcopy(loaded.to_dict())
    base = start.base
    if base.kind == AFTER_BATCHES:
        state = base.payload.get(world.worker)
        if state is not None and state.epoch == epoch:
            return copy.deepcopy(state.to_dict())
    merged = start.merged
    if merged is not None and merged["epoch"] == epoch:  # its tails unread: merged as it is
        return {**copy.deepcopy(merged), "finished": False, MERGED_READER: [
            world.rank, world.world_size, world.worker, world.num_workers]}
    return fresh(layout, epoch, world).to_dict()


def choose(start: Start, layout: Layout, epoch: int, world: World, resolve: Resolve, *,
           report: bool = False) -> ReaderState:
    """The one `ReaderState` reader `world` starts from in `epoch` (`report`: see
    `with_quota`). May read: a merged state's tails, and records counted for a quota."""
    loaded = start.loaded
    if loaded is not None and loaded.epoch == epoch:
        if not loaded.started and loaded.work is None:  # nothing read yet: any world
            state = loaded if loaded.world == world else fresh(layout, epoch, world)
            return with_quota(state, layout, resolve, report=report)
        if loaded.world != world:
            raise StateMismatchError(
                f"the state was taken by reader (rank, world_size, worker, num_workers)="
                f"{_tuple(loaded.world)} but is loaded by {_tuple(world)}; resume with "
                "the same world, or merge the states of all readers with "
                "streamds.merge_states()"
            )
        return loaded
    base = start.base
    if base.kind == AFTER_BATCHES:
        state = base.payload.get(world.worker)
        planned = next(iter(base.payload.values())).world.num_workers
        if planned != world.num_workers and any(s.epoch == epoch for s in
                                                base.payload.values()):
            # another worker count would leave some workers' shares unread or read twice
            raise ValueError(
                f"resume_after_batches was computed for a loader with {planned} reader(s) per "
                f"rank, but the loader that iterates it has {world.num_workers} (a loader has "
                "one reader per worker, or one with num_workers=0); pass the num_workers of "
                "the loader you resume with"
            )
        if state is not None and state.epoch == epoch:
            return state
    if base.kind == MERGED and base.payload.state["epoch"] == epoch:
        state = fresh(layout, epoch, world)
        state.work, state.prefill, state.carried = base.payload.share(world, resolve, layout)
        return with_quota(state, layout, resolve, merged=base.payload, report=report)
    return with_quota(fresh(layout, epoch, world), layout, resolve, report=report)


def with_quota(state: ReaderState, layout: Layout, resolve: Resolve, *,
               merged: Merged | None = None, report: bool = False) -> ReaderState:
    """`state` with its record quota under even_ranks, counted once for every reader
    (`merged`: the merged state `state` is a share of).

    Refuses a split that leaves every rank nothing; with `report`, reader 0 logs how many
    records the split drops or repeats when that is more than 1%. Without even_ranks, a
    rank that owns no block of a fresh epoch is refused when the world was detected (a
    DDP job would wait for it forever) and logged once when rank= / world_size= were
    passed (a split by hand, e.g. inference on slices, may leave a rank idle on purpose).
    """
    if layout.even_ranks is None:
        if merged is None and not layout.in_mix:
            _check_rank_has_work(layout, state.world)
        return state
    if state.quota is not None:
        return state
    world = state.world
    if merged is not None:
        counts = []
        for reader in range(world.readers):
            other = World(reader // world.num_workers, world.world_size,
                          reader % world.num_workers, world.num_workers)
            work, prefill, _ = merged.share(other, resolve, layout)
            counts.append(records_of(layout, work) + len(prefill))
    else:
        assert layout.block_counts is not None
        counts = layout.plan.reader_records(state.epoch, world, layout.block_counts)
    shares = quotas(counts, world.world_size, layout.even_ranks)
    try:
        said = check_split(counts, shares, world.world_size, layout.even_ranks,
                           blocks=layout.plan.num_blocks, resumed=merged is not None)
    except ValueError as err:  # a split the blocks cannot give: say when Range is why
        raise ValueError(f"{err}{unsplit_note(layout.shards)}") from None
    if said is not None and report and world.reader == 0:
        log.warning("epoch %d: %s", state.epoch, said)
    return replace(state, quota=shares[world.reader])


def _check_rank_has_work(layout: Layout, world: World) -> None:
    sizes = [shard.size for shard in layout.shards]
    said = empty_rank(layout.plan.num_blocks, world,
                      corpus_bytes=None if None in sizes else sum(sizes))
    if said is None:
        return
    said += unsplit_note(layout.shards)
    if not layout.world_given:
        raise ValueError(said)
    key = (layout.fingerprint["corpus"], world.rank, world.world_size)
    if key not in _EMPTY_RANKS_SAID:
        _EMPTY_RANKS_SAID.add(key)
        log.warning("%s", said)


def records_of(layout: Layout, work: Sequence[WorkItem]) -> int:
    """Records of `work`: a whole block's from the counts, a block's rest counted."""
    assert layout.block_counts is not None
    return sum(
        layout.block_counts[block] if start is None else
        count_from(layout.shards[layout.blocks[block].shard], layout.blocks[block], block, start)
        for block, start in work
    )


def pad_work_of(plan: Plan, state: ReaderState) -> list[WorkItem]:
    """What a reader short of its quota repeats: its own work, else the epoch's."""
    own = state.work if state.work is not None else plan.work(state.epoch, state.share)
    return pad_work(plan, state.epoch, own)


def after_batches(
    layout: Layout, spec: ReaderDescription, epoch: int, here: World, *, taken: Sequence[int],
    next_worker: int, batch_size: int, rule: LengthBuckets | None,
) -> dict[int, ReaderState]:
    """{worker: state} of every worker of rank `here` for a plain loader that resumes after
    its workers handed out `taken` batches each and worker `next_worker` is next in line
    (it becomes worker 0). `rule`: the dataset cuts batches from pools (a pool's batches
    already handed out are re-read, cut and skipped)."""
    assert layout.block_counts is not None
    counts = layout.block_counts
    readers = len(taken)
    seats = [World(here.rank, here.world_size, worker, readers) for worker in range(readers)]
    works = [layout.plan.work(epoch, seat) for seat in seats]
    records = [sum(counts[block] for block, _ in work) for work in works]
    starts = {}
    for worker in range(readers):
        old = (worker + next_worker) % readers  # the next worker in line becomes worker 0
        state = fresh(layout, epoch, seats[worker])
        state.seat = (here.rank, old)
        # records handed out before the resume point: whole batches, or whole pools
        pool, emitted = divmod(taken[old] * batch_size, rule.pool_size) if rule else (0, 0)
        before = pool * rule.pool_size if rule else taken[old] * batch_size
        # (a pool's batches handed out: re-read, cut, skipped)
        handed = HandedOut(min(before, records[old]), pool, emitted // batch_size)
        state.pipeline = state_after(spec, state, handed, partial(
            records_state_after, work=works[old],
            counts=[counts[block] for block, _ in works[old]],
            shuffle=layout.shuffle, buffer_size=layout.buffer_size,
            seed_parts=shuffle_seed_parts(layout.seed, epoch, here.rank, old)))
        starts[worker] = state
    return starts


def after_records(layout: Layout, spec: ReaderDescription, epoch: int, seat: World, world: World,
                  yielded: int) -> ReaderState:
    """The state of reader `world`, reading the share (and shuffle seed) of `seat`, once it
    has yielded `yielded` records of `epoch` (0: not started): exact when every line is a
    record. For the plain-loader resume of a `streamds.Mix`, whose readers may rotate."""
    assert layout.block_counts is not None
    work = layout.plan.work(epoch, seat)
    counts = [layout.block_counts[block] for block, _ in work]
    state = fresh(layout, epoch, world)
    state.seat = (seat.rank, seat.worker)
    if yielded == 0:
        return state
    state.pipeline = state_after(spec, state, HandedOut(min(yielded, sum(counts))), partial(
        records_state_after, work=work, counts=counts, shuffle=layout.shuffle,
        buffer_size=layout.buffer_size,
        seed_parts=shuffle_seed_parts(layout.seed, epoch, seat.rank, seat.worker)))
    return state


def _tuple(world: World) -> tuple[int, int, int, int]:
    return (world.rank, world.world_size, world.worker, world.num_workers)
