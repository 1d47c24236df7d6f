"""`MixStage`: the records of several sources -> one stream, source i drawn with weight w_i.

Draw k of a reader picks a source from the uniform number ``u_k = f(seed, epoch, rank,
worker, k)`` (`Draws`): the same inputs give the same sequence on any machine, and a resume
regenerates the draws from k alone. The stage reads its sources through iterators it is given
and a `reopen(index, epoch)` that starts a source's next pass; it never looks inside them.

Stopping rules (`stop`): "first" ends with the first source that runs out; "all" drops a
source that runs out (the others' weights renormalised) and ends when all have; "cycle"
starts a source that runs out on a new pass in the order of its next epoch (pass p of mix
epoch e reads the source's epoch e + p) and ends once every source ran out at least once. A
source with no records for this reader drops out.

State node (``get_state(sources)``; the top of a saved state also carries the format)::

    {"stage": "mix", "config": [weights, seed, stop, sources], "epoch": e,
     "world": [rank, world_size, worker, num_workers],
     "seat": [rank, worker],   # whose draws and shares it continues (plain-loader resume)
     "draws": k, "passes": [p_i], "taken": [records from source i this epoch],
     "in_pass": [records from source i's current pass], "ran_out": [bool], "dropped": [bool],
     "finished": bool, "sources": [each source's state node]}

Merged node (`merge`): ``{"stage": "merged-mix", "config", "epoch", "passes", "taken",
"sources": [each source's merged node]}``.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import StateMismatchError
from ..seeds import rng_for
from ..world import World
from .state import FORMAT, check_node, check_worlds
from .state import STAGE as STAGE_KEY

__all__ = ["ROUND", "Draws", "MergedMix", "MixStage"]

ROUND = 1024  # draws per generator seed: a resume replays at most this many


class Draws:
    """The uniform numbers u_k of one reader, from draw index `start` on."""

    def __init__(self, parts: tuple[int | str, ...], start: int) -> None:
        self.parts = parts
        self.next = start
        self._round = -1
        self._rng = random.Random()

    def __next__(self) -> float:
        round_, index = divmod(self.next, ROUND)
        if round_ != self._round:  # a new round: reseed, and skip to `index` after a resume
            self._rng = rng_for(*self.parts, round_)
            for _ in range(index):
                self._rng.random()
            self._round = round_
        self.next += 1
        return self._rng.random()


class _EndMarker:
    def __repr__(self) -> str:
        return "<end of source>"


_END: Any = _EndMarker()


class MixStage:
    """Stage: one reader's draws over its sources' iterators (see the module doc).

    `config` is ``[weights (normalised), seed, stop, number of sources]``. Build it fresh
    (`fresh`) or from a node (`reset`); `open(iterators, reopen)` hands it the sources, and
    iterating yields the mixed records while its counters follow every draw.
    """

    STAGE = "mix"
    MERGED = "merged-mix"
    CONFIG = "config"
    EPOCH = "epoch"
    WORLD = "world"
    SEAT = "seat"
    DRAWS = "draws"
    PASSES = "passes"
    TAKEN = "taken"
    IN_PASS = "in_pass"
    RAN_OUT = "ran_out"
    DROPPED = "dropped"
    FINISHED = "finished"
    SOURCES = "sources"
    KEYS = frozenset((FORMAT, STAGE_KEY, CONFIG, EPOCH, WORLD, SEAT, DRAWS, PASSES, TAKEN, IN_PASS,
                      RAN_OUT, DROPPED, FINISHED, SOURCES))

    def __init__(self, config: list[Any], epoch: int, world: World) -> None:
        self.config = config
        self.weights: list[float] = list(config[0])
        self.seed: int = config[1]
        self.stop: str = config[2]
        self.epoch = epoch
        self.world = world
        self._start_over()
        self._iterators: list[Iterator[Any]] = []
        self._reopen: Callable[[int, int], Iterator[Any]] | None = None

    def _start_over(self) -> None:
        count = self.config[3]
        self.seat = self.world  # whose draws it makes: its own, or another worker's
        self.draws = 0
        self.passes = [0] * count
        self.taken = [0] * count
        self.in_pass = [0] * count  # records from the source's current pass
        self.ran_out = [False] * count  # ran out at least once
        self.dropped = [False] * count  # no more draws for it this epoch
        self.finished = False
        self.sources: list[Any] | None = None  # the sources' nodes, as loaded (None: fresh)

    @classmethod
    def fresh(cls, config: list[Any], epoch: int, world: World) -> MixStage:
        return cls(config, epoch, world)

    def reset(self, state: dict[str, Any] | None = None) -> None:
        """Start over at `state` (a node `get_state` made, strictly checked; None: the start
        of this stage's epoch)."""
        if state is None:
            self._start_over()
            return
        check_node(state, self.STAGE, self.KEYS, "mix dataset")
        self.check_config(state[self.CONFIG], self.config)
        world = World(*state[self.WORLD])
        rank, worker = state[self.SEAT]
        self.epoch, self.world = state[self.EPOCH], world
        self.seat = World(rank, world.world_size, worker, world.num_workers)
        self.draws = state[self.DRAWS]
        self.passes, self.taken = list(state[self.PASSES]), list(state[self.TAKEN])
        self.in_pass = list(state[self.IN_PASS])
        self.ran_out, self.dropped = list(state[self.RAN_OUT]), list(state[self.DROPPED])
        self.finished = state[self.FINISHED]
        self.sources = copy.deepcopy(list(state[self.SOURCES]))

    @classmethod
    def load(cls, state: dict[str, Any], config: list[Any]) -> MixStage:
        """The stage `state` describes, for a mix configured as `config` (else refused)."""
        check_node(state, cls.STAGE, cls.KEYS, "mix dataset")
        stage = cls(config, state[cls.EPOCH], World(*state[cls.WORLD]))
        stage.reset(state)
        return stage

    def get_state(self, sources: list[Any]) -> dict[str, Any]:
        """This reader's node, with `sources` (the sources' nodes) nested."""
        w = self.world
        return {STAGE_KEY: self.STAGE, self.CONFIG: self.config, self.EPOCH: self.epoch,
                self.WORLD: [w.rank, w.world_size, w.worker, w.num_workers],
                self.SEAT: [self.seat.rank, self.seat.worker], self.DRAWS: self.draws,
                self.PASSES: list(self.passes), self.TAKEN: list(self.taken),
                self.IN_PASS: list(self.in_pass), self.RAN_OUT: list(self.ran_out),
                self.DROPPED: list(self.dropped), self.FINISHED: self.finished,
                self.SOURCES: sources}

    @staticmethod
    def check_config(found: list[Any], config: list[Any]) -> None:
        if found != config:
            raise StateMismatchError(
                f"the state was taken from a mix configured as {found} but this one is "
                f"{config} (weights, seed, stop, number of datasets); build it with the same "
                "arguments"
            )

    def start_merged(self, merged: MergedMix) -> None:
        """Start this reader's share of `merged`: the passes the sources stand in, and (reader
        0 only) the records taken before, so that they count once."""
        self.passes = list(merged.passes)
        self.ran_out = [p > 0 for p in self.passes]
        if self.world.reader == 0:
            self.taken = list(merged.taken)

    # -- iteration -------------------------------------------------------------------------

    def open(self, iterators: list[Iterator[Any]],
             reopen: Callable[[int, int], Iterator[Any]]) -> MixStage:
        """Read from `iterators` (one per source); `reopen(index, epoch)` starts a source's
        new pass."""
        self._iterators = iterators
        self._reopen = reopen
        return self

    def __iter__(self) -> Iterator[Any]:
        assert self._reopen is not None, "open() the stage on its sources first"
        iterators, reopen = self._iterators, self._reopen
        parts = ("mix", self.seed, self.epoch, self.seat.rank, self.seat.worker)
        draws = Draws(parts, self.draws)
        pick = self._picker()
        while not self.finished:
            index = pick(next(draws))
            self.draws = draws.next
            record = next(iterators[index], _END)
            if record is not _END:
                self.taken[index] += 1
                self.in_pass[index] += 1
                yield record
            elif self._ran_out(index):  # a new pass in its next epoch's order
                iterators[index] = reopen(index, self.epoch + self.passes[index])
            else:  # it may have dropped out of the draws
                pick = self._picker()

    def _picker(self) -> Callable[[float], int]:
        """uniform u -> the source it picks among those still drawn from (weight shares)."""
        alive = [index for index, out in enumerate(self.dropped) if not out]
        if not alive:
            return lambda u: -1  # never called: the reader has finished
        bounds = list(itertools.accumulate(self.weights[index] for index in alive))
        top = len(alive) - 1

        def pick(u: float) -> int:
            return alive[min(bisect.bisect_right(bounds, u * bounds[-1]), top)]

        return pick

    def _ran_out(self, index: int) -> bool:
        """Source `index` ran out: apply the stopping rule; True when it starts a new pass."""
        empty_pass = self.in_pass[index] == 0
        self.ran_out[index] = True
        if self.stop == "first":
            self.finished = True
        elif self.stop == "all" or empty_pass:
            self.dropped[index] = True
        if all(self.dropped) or (self.stop == "cycle" and all(self.ran_out)):
            self.finished = True
        if self.stop == "cycle" and not self.finished and not self.dropped[index]:
            self.passes[index] += 1
            self.in_pass[index] = 0
            return True
        return False

    # -- operations on nodes, for merge and counts -----------------------------------------

    @classmethod
    def merge(cls, nodes: Sequence[dict[str, Any]],
              merge_sources: Callable[[list[Any]], Any]) -> dict[str, Any]:
        """The nodes of every reader of a mix -> one merged node: each source's nodes merged
        by `merge_sources`, plus the records taken per source and the pass of each source."""
        first = nodes[0]
        for node in nodes:
            check_node(node, cls.STAGE, cls.KEYS, "mix dataset")
            if node[cls.CONFIG] != first[cls.CONFIG] or node[cls.EPOCH] != first[cls.EPOCH]:
                raise StateMismatchError(
                    "the mix states come from different mixes or epochs; merge the states "
                    "taken at one checkpoint of one run"
                )
        check_worlds([World(*node[cls.WORLD]) for node in nodes])
        count = len(first[cls.SOURCES])
        passes = []
        for index in range(count):
            seen = {node[cls.PASSES][index] for node in nodes}
            if len(seen) > 1:
                raise ValueError(
                    f"the readers of this cycling mix stand in different passes {sorted(seen)} "
                    f"of source {index}, so what remains of it is not one epoch's records; "
                    "merge at a checkpoint where every reader is in the same pass (or use "
                    "stop='all')"
                )
            passes.append(seen.pop())
        return MergedMix(
            config=first[cls.CONFIG], epoch=first[cls.EPOCH], passes=passes,
            taken=[sum(node[cls.TAKEN][index] for node in nodes) for index in range(count)],
            sources=[merge_sources([node[cls.SOURCES][index] for node in nodes])
                     for index in range(count)],
        ).to_node()

    @classmethod
    def taken_of(cls, node: dict[str, Any]) -> list[int]:
        """Records each source gave, as a node (a reader's or a merged one) counts them."""
        return list(node[cls.TAKEN])

    @classmethod
    def ended_of(cls, node: dict[str, Any]) -> bool:
        """Whether a reader's node was taken after its stream ended (its sources then read
        nothing more this epoch)."""
        return node[cls.FINISHED] is True

    @classmethod
    def restarted_of(cls, node: dict[str, Any]) -> list[int]:
        """The sources that a node (a reader's or a merged one) has on a later pass than their
        first (stop="cycle"): their nodes hold the current pass only."""
        return [index for index, passes in enumerate(node[cls.PASSES]) if passes > 0]


@dataclass(frozen=True)
class MergedMix:
    """The merged state of every reader of a mix: what the readers of a new world start from."""

    config: list[Any]
    epoch: int
    passes: list[int]
    taken: list[int]
    sources: list[Any]  # each source's merged node

    KEYS = frozenset((FORMAT, STAGE_KEY, MixStage.CONFIG, MixStage.EPOCH, MixStage.PASSES,
                      MixStage.TAKEN, MixStage.SOURCES))

    def to_node(self) -> dict[str, Any]:
        return {STAGE_KEY: MixStage.MERGED, MixStage.CONFIG: self.config,
                MixStage.EPOCH: self.epoch, MixStage.PASSES: list(self.passes),
                MixStage.TAKEN: list(self.taken), MixStage.SOURCES: list(self.sources)}

    @classmethod
    def from_node(cls, node: dict[str, Any]) -> MergedMix:
        check_node(node, MixStage.MERGED, cls.KEYS, "merged mix")
        return cls(config=node[MixStage.CONFIG], epoch=node[MixStage.EPOCH],
                   passes=list(node[MixStage.PASSES]), taken=list(node[MixStage.TAKEN]),
                   sources=copy.deepcopy(list(node[MixStage.SOURCES])))
