"""`ReaderState`: everything one reader needs to start, in one typed, versioned object.

Every way of starting a reader produces one: a fresh epoch, `load_state_dict` (the only way
in from a checkpoint), a share of a merged state (elastic resume), or a plain DataLoader's
batch count (`resume_after_batches`). The dataset has one code path from a `ReaderState` to
a running pipeline.

Dict form (``state_dict()``)::

    {"format": "streamds/5", "stage": "reader",
     "fingerprint": {...},                     # the corpus and settings (`resume.identity`)
     "epoch": int,
     "world": [rank, world_size, worker, num_workers],
     "plan": [num_blocks, seed, shuffle, units],  # to derive the reader's work
     "seat": [rank, worker],                   # whose share and shuffle seed it reads
     "work": [[block, start], ...] | None,     # explicit work (elastic resume); None: derived
     "prefill": [[block, offset], ...],        # buffered records carried from another world
     "carried": {counter: n},                  # counts carried from another world
     "quota": int | None,                      # records to yield under even_ranks
     "finished": bool,                         # the epoch's iterator ran out
     "pipeline": <nested stage state> | None}  # None: not started

The pipeline state nests like the pipeline, each node naming its stage ("stage" key):
[batch or pool_batch <-] [after_buffer <-] [shuffle <-] cursor <- even_ranks <- transform <-
parse <- lines (the in-order records stage's state is its cursor; a shuffling reader without
even_ranks runs its steps after the buffer: `streamds.stages.pipeline`). Each node is read by
its own stage only; others use its operations (`streamds.stages.chunks`). Loading is strict:
a missing or unknown key, another stage's node, or another format, fails.

One format version covers the whole state tree (`STATE_FORMAT`): readers, merged states,
mixes, packed data, batchers and `Rebatch`. It is carried once, at the top of a state a user
saves (`sealed`); every node of the tree says which stage it is (its "stage" key), and a node
nested in another's state (a mix's sources, a packed dataset's source) carries no format of
its own (`nested` strips it, `unnested` puts it back to load the node on its own). A state
that carries another streamds format is refused as one (`refuse_other_version`).

A state taken in a DataLoader worker travels *compact* (`compacted`): torchdata's
StatefulDataLoader takes it after every batch and walks every key of it, in the worker
(flatten, compare with the last one) and in the main process (rebuild, once per worker and
batch), which for a ~40-key tree cost twice what torchdata's own per-batch work does. The
compact form is plain values with four keys, so torchdata's walks are a few steps::

    {"format": "streamds/5", "stage": "compact",
     "tree": [<the state, values that ride apart set to None>],  # a list: a leaf to torchdata
     "apart": [[path, value], ...]}

Long values (a shuffle buffer's packed positions) and subtrees that are the same object as at
the last batch (a reader's fingerprint, a shuffle's snapshot) ride apart: torchdata sends only
what changed since the last batch, so they travel when they change and the tree, which does
change, is small. Every reader of states takes either form (`expanded`): `find_nodes`,
`nested`, `load_state_dict`, `counts_of`.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import StateMismatchError
from ..world import World
from .chunks import STAGE, Position, WorkItem, counts_in

__all__ = [
    "COMPACT",
    "FORMAT",
    "READER",
    "STAGE",
    "STATE_FORMAT",
    "Positioned",
    "ReaderState",
    "check_epoch_change",
    "check_node",
    "check_state",
    "check_worlds",
    "compacted",
    "expanded",
    "expanded_within",
    "find_nodes",
    "nested",
    "refuse_other_version",
    "sealed",
    "stage_of",
    "unnested",
]

# the one format version of every state streamds writes, carried at the top of the tree
STATE_FORMAT = "streamds/5"
FORMAT = "format"  # the key that carries it
READER = "reader"  # the stage of a reader's state (`ReaderState`)
COMPACT = "compact"  # the stage of a state in its compact form (`compacted`)
_TREE, _APART = "tree", "apart"  # the keys of a compact state
LONG_VALUE = 64  # items (bytes, list entries) from which a value rides apart
# kept in the tree without a look (a long string is part of a subtree that rides apart whole:
# a fingerprint's file listing)
_SCALARS = frozenset((int, bool, float, str, type(None)))
_KEYS = ("format", "stage", "fingerprint", "epoch", "world", "plan", "seat", "work", "prefill",
         "carried", "quota", "finished", "pipeline")


@dataclass
class ReaderState:
    fingerprint: dict[str, Any]  # the corpus and settings (`streamds.resume.identity`)
    epoch: int
    world: World
    plan: tuple[Any, ...]  # `storage.plan.Plan.described()`: (num_blocks, seed, shuffle, units)
    seat: tuple[int, int] | None = None  # (rank, worker) whose share it reads; None: own
    work: list[WorkItem] | None = None
    prefill: list[Position] = field(default_factory=list)
    carried: dict[str, int] = field(default_factory=dict)
    quota: int | None = None
    finished: bool = False
    pipeline: dict[str, Any] | None = None

    @property
    def started(self) -> bool:
        return self.pipeline is not None

    @property
    def share(self) -> World:
        """The world whose share of the plan (and shuffle seed) this reader reads: its own,
        or another worker's after a plain-loader resume rotated the workers."""
        if self.seat is None:
            return self.world
        rank, worker = self.seat
        return World(rank, self.world.world_size, worker, self.world.num_workers)

    def to_dict(self) -> dict[str, Any]:
        w = self.world
        return {
            FORMAT: STATE_FORMAT, STAGE: READER, "fingerprint": self.fingerprint,
            "epoch": self.epoch,
            "world": [w.rank, w.world_size, w.worker, w.num_workers], "plan": list(self.plan),
            "seat": [self.share.rank, self.share.worker],
            "work": None if self.work is None else [list(item) for item in self.work],
            "prefill": [list(p) for p in self.prefill], "carried": dict(self.carried),
            "quota": self.quota, "finished": self.finished, "pipeline": self.pipeline,
        }

    @classmethod
    def counts_of(cls, node: dict[str, Any]) -> Counter[str]:
        """The counters of a reader's node (of a state tree): those carried over from another
        world, plus every stage's down its pipeline."""
        counts: Counter[str] = Counter(node["carried"])
        if node["pipeline"] is not None:
            counts.update(counts_in(node["pipeline"]))
        return counts

    @classmethod
    def finished_of(cls, node: dict[str, Any]) -> bool:
        """Whether a reader's node (of a state tree) was taken after its epoch's iterator ran
        out (its counters then hold every line it read)."""
        return node["finished"] is True

    @classmethod
    def from_dict(cls, state: Any) -> ReaderState:
        """Strict: the dict `to_dict` made, of this format, with exactly its keys."""
        if not isinstance(state, dict) or FORMAT not in state:
            raise StateMismatchError(
                f"not a streamds state (format {STATE_FORMAT!r} expected); pass the dict that "
                "state_dict() returned"
            )
        _check_format(state, "reader")
        if state.get(STAGE) != READER:
            raise StateMismatchError(
                f"this is the state of a {state.get(STAGE)!r} stage, not of a reader "
                "(StreamingJsonl); load it into the object whose state_dict() returned it"
            )
        missing = [key for key in _KEYS if key not in state]
        unknown = sorted(set(state) - set(_KEYS))
        if missing or unknown:
            raise StateMismatchError(
                f"damaged streamds state: missing keys {missing}, unknown keys {unknown}; "
                "pass the dict that state_dict() returned, unchanged"
            )
        num_blocks, seed, shuffle, units = state["plan"]
        return cls(
            fingerprint=state["fingerprint"], epoch=state["epoch"], world=World(*state["world"]),
            plan=(num_blocks, seed, shuffle, units), seat=(state["seat"][0], state["seat"][1]),
            work=None if state["work"] is None else [(b, s) for b, s in state["work"]],
            prefill=[(b, o) for b, o in state["prefill"]], carried=dict(state["carried"]),
            quota=state["quota"], finished=state["finished"], pipeline=state["pipeline"],
        )


class Positioned(Protocol):
    """A loaded state that says its epoch and whether that epoch ran out (a `ReaderState`,
    a stage loaded from its node)."""

    epoch: int
    finished: bool


def check_epoch_change(pending: Positioned | None, epoch: int, *, or_else: str = "") -> None:
    """Refuse `set_epoch(epoch)` while a loaded state is in the middle of another epoch;
    `or_else`: another fix."""
    if pending is None:
        return
    loaded, finished = pending.epoch, pending.finished
    if not finished and loaded != epoch:
        raise ValueError(
            f"set_epoch({epoch}): the loaded state is in the middle of epoch {loaded}; "
            f"iterate to finish that epoch first{f' ({or_else})' if or_else else ''}"
        )


def refuse_other_version(state: dict[str, Any]) -> None:
    """Refuse a state that another streamds version wrote (a streamds format but not this
    one), saying what to do."""
    found = state.get(FORMAT)
    if isinstance(found, str) and found.startswith("streamds") and found != STATE_FORMAT:
        raise StateMismatchError(
            f"a state from another version of streamds (format {found!r}; this version reads "
            f"{STATE_FORMAT!r}): finish the epoch with the streamds version that took the "
            "state, or start the epoch afresh (its records are not lost, only read again)"
        )


def _check_format(state: dict[str, Any], what: str) -> None:
    refuse_other_version(state)
    if state[FORMAT] != STATE_FORMAT:
        raise StateMismatchError(
            f"unknown state format {state[FORMAT]!r} for a {what} state; this version reads "
            f"{STATE_FORMAT!r}; pass the dict that state_dict() returned"
        )


def check_state(state: Any, stage: str, keys: frozenset[str], what: str) -> None:
    """Strict loading of the state a user saved of stage `stage` (`what`, in words): this
    format version at the top, with exactly `keys` (which hold FORMAT and STAGE)."""
    if not isinstance(state, dict) or FORMAT not in state:
        raise StateMismatchError(
            f"not a streamds {what} state (format {STATE_FORMAT!r} expected); pass the dict "
            f"that state_dict() of the {what} returned"
        )
    _check_format(state, what)
    check_node(state, stage, keys, what)


def check_node(node: Any, stage: str, keys: frozenset[str], what: str) -> None:
    """Strict loading of one node of the tree: stage `stage` with exactly `keys` (a node
    nested in another's state lacks FORMAT, which `keys` may hold)."""
    if not isinstance(node, dict) or node.get(STAGE) != stage:
        found = node.get(STAGE) if isinstance(node, dict) else type(node).__name__
        raise StateMismatchError(
            f"not a streamds {what} state (stage {stage!r} expected, found {found!r}); pass "
            f"the dict that state_dict() of the {what} returned"
        )
    have = set(node) | ({FORMAT} if FORMAT in keys else set())
    if have != keys:
        raise StateMismatchError(
            f"damaged {what} state: missing keys {sorted(keys - have)}, unknown keys "
            f"{sorted(have - keys)}; pass the dict that state_dict() returned, unchanged"
        )


def sealed(node: dict[str, Any]) -> dict[str, Any]:
    """`node` as the top of a state a user saves: the format version first."""
    return {FORMAT: STATE_FORMAT, **{k: v for k, v in node.items() if k != FORMAT}}


def nested(state: Any) -> Any:
    """A state to nest inside another stage's: a streamds state loses its format (the top of
    the tree carries it); any other object's state (a user's source) stays as it is."""
    state = expanded(state)
    if isinstance(state, dict) and STAGE in state:
        refuse_other_version(state)
        return {k: v for k, v in state.items() if k != FORMAT}
    return state


def unnested(node: Any) -> Any:
    """A nested node back as a state its own object loads (the inverse of `nested`)."""
    if isinstance(node, dict) and STAGE in node:
        return sealed(node)
    return node


def stage_of(found: Any) -> str | None:
    """The stage a node of a state tree names, None for anything else (a loader's dict)."""
    if isinstance(found, dict):
        stage = found.get(STAGE)
        return stage if isinstance(stage, str) else None
    return None


def find_nodes(found: Any, stages: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """Every node of a stage in `stages` nested anywhere in `found` (a StatefulDataLoader's
    state, a list of them), not looking inside them. A state of another streamds version met
    on the way is refused."""
    if isinstance(found, dict):
        refuse_other_version(found)
        found = expanded(found)
        if stage_of(found) in stages:
            yield found
            return
        for value in found.values():
            yield from find_nodes(value, stages)
    elif isinstance(found, (list, tuple)):
        for value in found:
            yield from find_nodes(value, stages)


def check_worlds(worlds: list[World]) -> None:
    """Refuse the states of a merge unless they are exactly one per reader of one world."""
    world_size, num_workers = worlds[0].world_size, worlds[0].num_workers
    expected = {World(r, world_size, w, num_workers) for r in range(world_size)
                for w in range(num_workers)}
    missing = sorted((m.rank, m.worker) for m in expected - set(worlds))
    extra = sorted((e.rank, e.worker) for e in set(worlds) - expected)
    if missing or extra or len(worlds) != len(set(worlds)):
        raise ValueError(
            f"merge_states needs exactly one state per reader of the world "
            f"(world_size={world_size}, num_workers={num_workers}); missing (rank, worker): "
            f"{missing}, unexpected or repeated: {extra or 'duplicates'}; pass the loader "
            "states of every rank"
        )


def compacted(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a top-level state, with its format) in its compact form, sharing its values
    (no copy). A subtree that the last compaction met (the same object) and found with
    nothing apart is not walked again: it rides apart whole. The nodes stages return are
    never changed afterwards (torchdata keeps the last state and compares the next with it,
    so a node changed in place would go unseen anyway)."""
    global _last_walk
    apart: list[list[Any]] = []
    walk: dict[int, tuple[Any, bool]] = {}
    tree = _short(state, (), apart, walk)
    _last_walk = walk
    return {FORMAT: STATE_FORMAT, STAGE: COMPACT, _TREE: [tree], _APART: apart}


# id(subtree) -> (subtree, whether anything in it rode apart), of the last `compacted`
_last_walk: dict[int, tuple[Any, bool]] = {}


def _short(value: Any, path: tuple[Any, ...], apart: list[list[Any]],
           walk: dict[int, tuple[Any, bool]]) -> Any:
    """`value` with what rides apart moved into `apart` (as [path, value]) and set to None.
    Scalars are kept without a call: this runs after every batch in every worker."""
    if isinstance(value, dict):
        known = _last_walk.get(id(value))
        if known is not None and known[0] is value and not known[1] and path:
            walk[id(value)] = known  # unchanged since the last batch: it rides apart
            apart.append([list(path), value])
            return None
        before = len(apart)
        short = {key: item if type(item) in _SCALARS else _short(item, (*path, key), apart, walk)
                 for key, item in value.items()}
        walk[id(value)] = (value, len(apart) > before)
        return short if len(apart) > before else value
    if isinstance(value, (bytes, list, tuple)) and len(value) >= LONG_VALUE:
        apart.append([list(path), value])
        return None
    if isinstance(value, list):
        return [item if type(item) in _SCALARS else _short(item, (*path, index), apart, walk)
                for index, item in enumerate(value)]
    return value


def expanded(state: Any) -> Any:
    """`state` as `state_dict()` outside a worker returns it: a compact state expanded (a
    copy: the loader keeps the compact one), anything else as it is."""
    if not isinstance(state, dict) or state.get(STAGE) != COMPACT:
        return state
    refuse_other_version(state)
    check_node(state, COMPACT, frozenset((FORMAT, STAGE, _TREE, _APART)), "compact")
    tree = copy.deepcopy(state[_TREE][0])
    for path, value in state[_APART]:
        *parents, last = path
        node = tree
        for key in parents:
            node = node[key]
        node[last] = copy.deepcopy(value)
    return tree


def expanded_within(found: Any) -> Any:
    """`found` (a loader's state, a list of them) with every compact state in it expanded,
    once: containers holding one are copied, the rest is shared."""
    if isinstance(found, dict):
        if found.get(STAGE) == COMPACT:
            return expanded(found)
        inner = {key: expanded_within(value) for key, value in found.items()}
        return found if all(inner[key] is value for key, value in found.items()) else inner
    if isinstance(found, (list, tuple)):
        inner_items = [expanded_within(value) for value in found]
        if all(new is old for new, old in zip(inner_items, found, strict=True)):
            return found
        return inner_items if isinstance(found, list) else tuple(inner_items)
    return found
