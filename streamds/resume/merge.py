"""Elastic resume: the states of every reader of one world -> one world-independent state.

`merge_states` is pure: for each reader it keeps what is unfinished: work items from where
the reader stood, and for a shuffling reader its last buffer snapshot and how many records it
handed out since (a "tail"). `resolve_tails` (run by the dataset, which can read the data)
replays each tail on record numbers and reads the few records after the snapshot to turn it
into buffered positions and work items. `share_of` deals the result to the readers of any new
world, so the epoch finishes with every remaining record exactly once.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import StateMismatchError
from ..seeds import shuffle_seed_parts
from ..stages.balance import pad_work
from ..stages.buckets import PoolBatch, pool_rng
from ..stages.chunks import Chunk, Position, WorkItem, counts_in
from ..stages.description import ReaderDescription
from ..stages.mixing import MixStage
from ..stages.packing import PackStage
from ..stages.parse import DROPPED, Marker
from ..stages.pipeline import (
    buffer_intake,
    preparer,
    read_up_to,
    reading_front,
    rest_of,
    steps_after_buffer,
    steps_before_buffer,
    work_after,
)
from ..stages.pools import PoolStage
from ..stages.rebatch import Rebatch
from ..stages.records import fetch_records
from ..stages.shuffle import Shuffle
from ..stages.state import (
    FORMAT,
    READER,
    STAGE,
    STATE_FORMAT,
    ReaderState,
    check_worlds,
    expanded_within,
    find_nodes,
    nested,
    sealed,
)
from ..stages.transform import Composed, Step
from ..storage.plan import Plan, deal_position, run_bounds
from ..world import World
from .identity import differences
from .replay import NEW, replay

__all__ = [
    "BATCHES",
    "MERGED_MIX",
    "MERGED_PACKED",
    "MERGED_READER",
    "MERGED_STATE",
    "MIX",
    "PACKED",
    "REBATCH",
    "START_KEYS",
    "merge_states",
    "merged_counts",
    "resolve_tails",
    "share_of",
]

# the stages of the state tree ("stage" key; the format version is `STATE_FORMAT` for all)
MERGED_STATE = "merged"  # the merged state of every reader of one epoch
MIX = MixStage.STAGE  # one reader of a `streamds.Mix`
MERGED_MIX = MixStage.MERGED
PACKED = PackStage.STAGE  # one reader of a `streamds.datasets.pack.Packed`
MERGED_PACKED = PackStage.MERGED
BATCHES = PoolStage.STAGE  # a pool batcher of `streamds.datasets.batching`
REBATCH = Rebatch.STAGE  # `streamds.Rebatch`
COUNTERS = ("bad", "blank", "dropped", "corrupt_blocks")
# what `state_dict()` returns before the first `iter()` of a dataset that finishes a merged
# state is that state plus these keys: the reader (rank, world_size, worker, num_workers) and
# its "finished" (False), as a reader's state has them
MERGED_READER = "reader"
START_KEYS = (MERGED_READER, "finished")
# a tail's key for the pool its reader had handed batches out of (`PoolBatch.pool_of`)
_POOL = "open_pool"
# a tail's key for the records its reader handed out after its state: the first records of a
# big batch a `Rebatch` had yielded when its state was taken (its loader's state stands before)
_THEN = "handed_after"


def _reader_states(found: Any) -> Iterator[dict[str, Any]]:
    """Every reader state nested anywhere in `found` (StatefulDataLoader states included;
    anything else, a batcher's state or a loader's, may hold reader states)."""
    return find_nodes(found, (READER,))


def _states_of(found: Any, stage: str) -> Iterator[dict[str, Any]]:
    """Every node of stage `stage` nested anywhere in `found` (not looking inside them)."""
    return find_nodes(found, (stage,))


def _check_complete(states: list[ReaderState]) -> None:
    _check_worlds([state.world for state in states])


_check_worlds = check_worlds  # the rule lives with the state tree (`stages.state`)


def merged_counts(merged: dict[str, Any]) -> dict[str, int]:
    """The counters a merged state carries over (every reader's, summed)."""
    return dict(merged["counts"])


def _unfinished(state: ReaderState, then: int = 0
                ) -> tuple[list[WorkItem], list[Position], dict | None]:
    """(work left, buffered positions, tail to resolve) of one reader, `then` records handed
    out after its state (a `Rebatch` state inside a big batch this reader made): its
    pipeline's stages say what it leaves (`rest_of`); under a shuffle, or with records handed
    out since, that is a tail, resolved by reading."""
    plan = Plan.of(state.plan)
    work = state.work
    if work is None:
        work = plan.work(state.epoch, state.share)
    if then and (state.finished or state.pipeline is None):
        had = "finished" if state.finished else "not started"
        raise StateMismatchError(
            f"the loader state says reader {_where(state)} handed out {then} records of a big "
            f"batch after a state in which it had {had}; "
            "pass the states that state_dict() returned, unchanged"
        )
    if state.finished:
        return [], [], None
    if state.pipeline is None:  # the reader had not started
        return list(work), list(state.prefill), None
    rest = rest_of(state.pipeline)
    if rest.snapshot is None:  # in order: the work after its position
        left = work_after(work, rest.position)
        if not then:
            return left, [], None
        # the `then` records after the position are read already
        return [], [], {"work": [list(item) for item in left], _THEN: then,
                        "even": state.quota is not None}
    tail = {
        "work": [list(item) for item in work_after(work, rest.position)],
        "even": None if state.quota is None else _even_stream(state, list(work), rest.position),
        "snapshot": rest.snapshot,  # with the records handed out since
        "seed": list(shuffle_seed_parts(plan.seed, state.epoch, state.share.rank,
                                        state.share.worker)),
    }
    if rest.pool is not None:
        if then:
            raise ValueError(
                "merge_states cannot carry over a Rebatch state inside a big batch of batches "
                "cut by a LengthBuckets or TokenBudget rule; give Rebatch ds.batch(n) batches"
            )
        tail[_POOL] = rest.pool
    if then:
        tail[_THEN] = then
    return [], [], tail


def _even_stream(state: ReaderState, work: list[WorkItem], position: dict[str, Any]
                 ) -> dict[str, Any]:
    """What replays an even-ranks reader's stream from its shuffle snapshot: its whole work,
    the pad work it cycles through once that is read, its quota (the carried-over records'
    share taken off, as the reader does) and the snapshot's position in that stream, which
    counts the records the reader had passed on. Replaying from the work left alone would
    miss where the quota ends the stream ("drop") or pad records extend it ("pad"), so the
    buffer's drain would be replayed wrongly."""
    plan = Plan.of(state.plan)
    assert state.quota is not None
    pad = pad_work(plan, state.epoch, work)
    return {"work": [list(item) for item in work], "pad": [list(item) for item in pad],
            "quota": max(0, state.quota - len(state.prefill)), "position": position,
            "upto": list(read_up_to(position))}


class _Reads:
    """How often an even-ranks reader's stream had read a record (a position) before a point:
    once in its own work, then once per pass over its pad work (which repeats it)."""

    def __init__(self, even: dict[str, Any]) -> None:
        self.work = [(block, start) for block, start in even["work"]]
        self.pad = [(block, start) for block, start in even["pad"]]
        self.own_at = {block: k for k, (block, _) in enumerate(self.work)}
        self.pad_at = {block: k for k, (block, _) in enumerate(self.pad)}
        self.upto = tuple(even["upto"])

    @staticmethod
    def _inside(item: WorkItem, offset: int) -> bool:
        return item[1] is None or offset >= item[1]

    def own(self, position: Position) -> bool:
        """Whether the record is one of the reader's own (not a carried-over one)."""
        k = self.own_at.get(position[0])
        return k is not None and self._inside(self.work[k], position[1])

    def before(self, position: Position) -> int:
        """Times the stream had read `position` before the point `upto`."""
        (k, o), (block, offset) = self.upto, position
        reads = 0
        mine = self.own_at.get(block)
        if mine is not None and self._inside(self.work[mine], offset):
            reads += mine < k or (mine == k and o is not None and offset < o)
        pad_k = self.pad_at.get(block)
        if pad_k is not None and self._inside(self.pad[pad_k], offset) and k >= len(self.work):
            passes, j = divmod(k - len(self.work), len(self.pad))
            reads += passes + (pad_k < j or (pad_k == j and o is not None and offset < o))
        return reads


def _still_to_read(even: dict[str, Any], buffered: list[Position],
                   read_since: list[Position]) -> list[Position]:
    """The buffered records of an even-ranks reader that belong to the rest of the epoch, once
    each: a record whose every copy read so far is still buffered (none handed out), and
    that is the reader's own or one carried over to it, not a pad repeat of another's. Pad
    copies share their original's position, so copies are counted, not told apart."""
    reads = _Reads(even)
    since = Counter(read_since)
    held = Counter(buffered)
    out: list[Position] = []
    for position in held:
        copies = reads.before(position) + since[position]
        if not reads.own(position):
            copies += 1  # carried over from another world's buffer (the only way in)
        if held[position] == copies:
            out.append(position)
    return out


def merge_states(states: Any) -> dict[str, Any]:
    """One world-independent state from the states of every reader of one epoch.

    `states`: the `state_dict()` of each rank's StatefulDataLoader (or of each dataset), in
    a list; reader states are found wherever they nest. Load the result with
    ``StreamingJsonl(source, ..., rank=r, world_size=n).with_resume(merged)``.

    States of a `streamds.Mix` merge source by source (load with ``mix.with_resume(merged)``);
    states of a packed dataset keep every reader's leftover tokens (load with
    ``packed.with_resume(merged)``).

    Under even_ranks the rest never holds a record read before the checkpoint, nor one twice
    unless the new world's own split pads. "drop": before and rest together hold every
    record the uninterrupted epoch would have read (records an unfinished reader would have
    dropped at its quota are left to read too). "pad": together they hold every record of the
    corpus; the only records read twice are the old world's pad repeats handed out before the
    checkpoint (its uninterrupted epoch repeats them as well).
    """
    # workers' compact states expanded once: the walks below find the same nodes (by id)
    states = expanded_within(states)
    _check_batchers(states)
    handed_after = _handed_after(states)  # id(reader node) -> records handed out since
    # stages that merge their own nodes (each merges what it nests through `_merge_sources`);
    # the top-most nodes found name the one stage the states are of
    found = list(find_nodes(states, tuple(_OWN_MERGE)))
    if found:
        stages = sorted({node[STAGE] for node in found})
        if len(stages) > 1:
            raise ValueError(
                f"merge_states takes the states of one dataset, and found states of {stages}; "
                "merge the states of each dataset on its own"
            )
        return sealed(_OWN_MERGE[stages[0]](found, _merge_sources))
    readers, then = [], {}
    for node in _reader_states(states):
        readers.append(ReaderState.from_dict(sealed(node)))
        then[id(readers[-1])] = handed_after.get(id(node), 0)
    unstarted = list(_states_of(states, MERGED_STATE))
    if unstarted:
        before, worlds = _unstarted(unstarted)
        _check_worlds([state.world for state in readers] + worlds)  # every reader's state
        if not readers:  # no reader had started: all of the merged state remains
            return before
        if before["fingerprint"] != readers[0].fingerprint or before["epoch"] != readers[0].epoch:
            raise StateMismatchError(
                "the states come from different datasets or epochs (a reader that had not "
                "started finishes another merged state than the others); merge the states "
                "taken at one checkpoint of one run"
            )
    if not readers:
        raise ValueError("merge_states found no streamds reader state in its argument")
    readers.sort(key=lambda s: (s.world.rank, s.world.worker))
    first = readers[0]
    for state in readers:
        said = differences(first.fingerprint, state.fingerprint,
                           labels=(f"in reader {_where(first)}", f"in reader {_where(state)}"))
        if state.epoch != first.epoch:
            said.append(f"epoch {first.epoch} in reader {_where(first)}, {state.epoch} in "
                        f"reader {_where(state)}")
        if said:
            raise StateMismatchError(
                f"the states come from different datasets or epochs ({'; '.join(said)}); "
                "merge the states taken at one checkpoint of one run"
            )
    if not unstarted:
        _check_complete(readers)
    remaining: list[WorkItem] = []
    prefill: list[Position] = []
    tails: list[dict[str, Any]] = []
    counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
    if unstarted:  # their shares of the earlier merged state, dealt when it is resolved
        tails.append({"merged": nested(before), "readers": [
            [world.rank, world.world_size, world.worker, world.num_workers] for world in worlds]})
        if any(world.reader == 0 for world in worlds):  # reader 0 carries the counts
            counts.update(before["counts"])
    for state in readers:
        work, buffered, tail = _unfinished(state, then[id(state)])
        remaining.extend(work)
        prefill.extend(buffered)
        if tail is not None:
            tails.append(tail)
        counts.update(state.carried)
        if state.pipeline is not None:
            counts.update(counts_in(state.pipeline))
    return {
        FORMAT: STATE_FORMAT,
        STAGE: MERGED_STATE,
        "fingerprint": first.fingerprint,
        "epoch": first.epoch,
        "remaining": [list(item) for item in remaining],
        # the readers' prefill; the key keeps its merged/2 name, so saved states still load
        "pending": [list(position) for position in prefill],
        "tails": tails,
        "counts": dict(counts),
    }


def _unstarted(starts: list[dict[str, Any]]) -> tuple[dict[str, Any], list[World]]:
    """The one merged state that readers which had not started describe, and their worlds."""
    worlds, before = [], None
    for start in starts:
        if MERGED_READER not in start:
            raise ValueError(
                "merge_states takes the states of the readers of one checkpoint, not a merged "
                "state; resume from a merged state with with_resume()"
            )
        state = {key: value for key, value in start.items() if key not in START_KEYS}
        if before is not None and state != before:
            raise StateMismatchError(
                "readers that had not started describe different merged states; merge the "
                "states taken at one checkpoint of one run"
            )
        before = state
        worlds.append(World(*start[MERGED_READER]))
    assert before is not None
    return copy.deepcopy(before), worlds


def _where(state: ReaderState) -> str:
    return f"(rank {state.world.rank}, worker {state.world.worker})"


def _check_batchers(states: Any) -> None:
    """Refuse what a pool batcher's own rule says cannot be merged (`PoolStage.check_merge`)."""
    for batcher in _states_of(states, BATCHES):
        PoolStage.check_merge(batcher)


def _handed_after(states: Any) -> dict[int, int]:
    """id(reader node) -> the records that reader handed out after it: of each `Rebatch`
    state inside a big batch (`Rebatch.handed_after`), the reader of the worker that made
    the batch, in the loader's state before it. The records of the big batches the `Rebatch`
    held are then left to read, but for those. Refuses what cannot be carried over exactly."""
    found: dict[int, int] = {}
    for rebatch in _states_of(states, REBATCH):
        worker, skip = Rebatch.handed_after(rebatch)
        if not skip:
            continue
        loader = Rebatch.loader_state_of(rebatch)
        others = sorted({node[STAGE] for node in find_nodes(loader, (*_OWN_MERGE, BATCHES))})
        if others:
            raise ValueError(
                f"merge_states cannot carry over a Rebatch state inside a big batch ({skip} of "
                f"its records already yielded) of a {' / '.join(others)} dataset: only a "
                "reader (StreamingJsonl) says where it stands after some records of a batch; "
                "resume in the same world with load_state_dict(), or save the states for an "
                "elastic resume at a step where every rank's state has skip == 0"
            )
        makers = [node for node in _reader_states(loader)
                  if ReaderState.from_dict(sealed(node)).world.worker == worker]
        if len(makers) != 1:
            raise ValueError(
                f"merge_states cannot carry over a Rebatch state inside a big batch ({skip} of "
                f"its records already yielded) whose worker {worker} had not started reading "
                "when the loader's state before that batch was taken (the first big batches "
                "after a resume from a merged state); save the states for an elastic resume "
                "after each worker has handed over a big batch, or resume in the same world "
                "with load_state_dict()"
            )
        found[id(makers[0])] = skip
    return found


# stage -> its merge of the nodes of every reader (the reader's own merge is below)
_OWN_MERGE: dict[str, Callable[[list[dict[str, Any]], Callable[[list[Any]], Any]],
                               dict[str, Any]]] = {
    PackStage.STAGE: PackStage.merge,
    MixStage.STAGE: MixStage.merge,
}


def _merge_sources(nodes: list[Any]) -> Any:
    """The nodes of one source of every reader (of a mix, of a packed dataset) merged: the
    merged node of that source, nested as its owner keeps it."""
    return nested(merge_states([sealed(node) for node in nodes]))


def _read_after(
    spec: ReaderDescription, work: list[WorkItem], limit: int
) -> tuple[list[tuple[int, Position]], list[WorkItem]]:
    """(work item, position) of the first `limit` records of `work` that a shuffling
    reader's buffer takes in (one not under even_ranks), and the work left after them."""
    found: list[tuple[int, Position]] = []
    if limit == 0:
        return found, list(work)
    for chunk in buffer_intake(spec, work):
        for index, item in enumerate(chunk.items):
            if item.__class__ is Marker:
                continue
            found.append((chunk.work_index, (chunk.block, chunk.offsets[index])))
            if len(found) == limit:
                rest = [(chunk.block, chunk.offsets[index + 1]), *work[chunk.work_index + 1 :]]
                return found, rest
    return found, []


def _read_even(
    spec: ReaderDescription, even: dict[str, Any], limit: int
) -> tuple[list[tuple[int, Position]], list[WorkItem]]:
    """As `_read_after`, for an even-ranks reader: its own stream from the snapshot's
    position (work, then pad work, ended by its quota), the work item of each record counted
    through work then pad. The work left is the reader's own work after the last record
    found: what the quota would have dropped is left to read, pad work never is."""
    work = [(block, start) for block, start in even["work"]]
    pad = [(block, start) for block, start in even["pad"]]
    found: list[tuple[int, Position]] = []
    last: tuple[Chunk, int] | None = None
    if limit:
        for chunk in buffer_intake(spec, work, pad=pad, quota=even["quota"],
                                   position=even["position"]):
            for index, item in enumerate(chunk.items):
                if item.__class__ is Marker:
                    continue
                found.append((chunk.work_index, (chunk.block, chunk.offsets[index])))
                last = chunk, index
                if len(found) == limit:
                    break
            if len(found) == limit:
                break
    if last is None or last[0].work_index >= len(work):
        return found, []
    chunk, index = last
    return found, [(chunk.block, chunk.offsets[index + 1]), *work[chunk.work_index + 1 :]]


def _resolve(
    tail: dict[str, Any], spec: ReaderDescription, *, then: int = 0
) -> tuple[list[WorkItem], list[Position], list[Position]]:
    """A shuffling reader's tail, `then` more records handed out -> (work left, buffered
    positions, positions of those `then` records in the order they came out)."""
    even = tail.get("even")
    work = [(block, start) for block, start in (even or tail)["work"]]
    since = Shuffle.since_of(tail["snapshot"])
    ahead = since + then + spec.buffer_size  # the most records the buffer can have read
    if even is None:
        found, after_all = _read_after(spec, work, ahead)
    else:
        found, after_all = _read_even(spec, even, ahead)
    total = None if len(found) == ahead else len(found)
    handed: list[Position] = []
    shuffle, numbers = replay(size=spec.buffer_size, seed_parts=tuple(tail["seed"]),
                              handed_out=since + then, total=total, snapshot=tail["snapshot"],
                              handed=handed)

    def position(block: int, offset: int) -> Position:
        return found[offset][1] if block == NEW else (block, offset)

    buffered = [position(*at) for at in shuffle.buffered()]
    out = [position(*at) for at in handed[since:]]
    read = numbers.next  # records the reader had taken from its stream since the snapshot
    if even is not None:  # pad repeats and records already handed out stay behind
        buffered = _still_to_read(even, buffered, [at for _, at in found[:read]])
    if read < len(found):
        item, (block, offset) = found[read]
        if item >= len(work):  # into the pad work: its own work is all read
            return [], buffered, out
        return [(block, offset), *work[item + 1 :]], buffered, out
    return (after_all if total is None or even is not None else []), buffered, out


def _draw_passing(tail: dict[str, Any], spec: ReaderDescription, wanted: int
                  ) -> tuple[list[WorkItem], list[Position], list[Position],
                             list[tuple[int, Any]]]:
    """A shuffling reader's tail, drawn from until `wanted` records out of the buffer pass the
    map and filter steps run after it (or the epoch ends) -> (work left, buffered positions,
    positions of the records drawn, (index among those, record) of the ones that passed).
    The records out of the buffer are the same first ones however many are drawn, so draw
    more (twice as many) until enough pass, then stop just after the last one wanted."""
    even = tail.get("even") is not None
    before = steps_before_buffer(spec, even)
    # run as records leave it
    after = spec.steps if steps_after_buffer(True, even, spec.steps) else ()
    then = wanted
    while True:
        work, buffered, handed = _resolve(tail, spec, then=then)
        records = fetch_records(handed, shards=spec.shards, blocks=spec.blocks,
                                prepare=preparer(spec, before), opener=spec.opener,
                                retry=spec.retry)
        kept = _passing(records, after)
        if len(kept) >= wanted or len(handed) < then:  # enough, or the epoch's end
            break
        then *= 2
    if len(kept) > wanted:
        drawn = kept[wanted - 1][0] + 1
        kept = kept[:wanted]
        work, buffered, _ = _resolve(tail, spec, then=drawn)
        handed = handed[:drawn]
    return work, buffered, handed, kept


def _resolve_pool(tail: dict[str, Any], spec: ReaderDescription
                  ) -> tuple[list[WorkItem], list[Position], int]:
    """A tail whose reader had handed out some batches of a pool -> (work left, buffered
    positions and the pool's records not yet handed out, records the map and filter steps
    after the buffer dropped while the pool filled)."""
    pool = tail[_POOL]
    rule = None if spec.batch is None else spec.batch.rule
    if rule is None or rule.config() != PoolBatch.rule_of(pool):
        raise StateMismatchError(
            f"the merged state stopped inside a pool of batches cut by {PoolBatch.rule_of(pool)}; "
            "resume it with a dataset batched by the same rule (.batch(LengthBuckets(...)) "
            "or .batch(TokenBudget(...)) with the same arguments)"
        )
    # the pool: the first pool_size records out of the buffer that pass the steps after it
    work, buffered, handed, kept = _draw_passing(tail, spec, rule.pool_size)
    dropped = len(handed) - len(kept)  # draws up to and including the pool's last record
    members = [handed[index] for index, _ in kept]
    batches = rule.cut([rule.length(record) for _, record in kept],
                       pool_rng(tail["seed"], PoolBatch.number_of(pool)))
    out = {index for batch in batches[: PoolBatch.emitted_of(pool)] for index in batch}
    return work, buffered + [p for i, p in enumerate(members) if i not in out], dropped


def _resolve_handed(tail: dict[str, Any], spec: ReaderDescription
                    ) -> tuple[list[WorkItem], list[Position], Counter[str]]:
    """A tail whose reader handed out `_THEN` records after its state -> (work left, buffered
    positions, counters of the lines passed on the way): those records are read, so the rest
    begins after the last of them."""
    then = tail[_THEN]
    if "snapshot" not in tail:  # in order: the records after the position, `then` skipped
        return _skip_in_order(tail, spec, then)
    even = tail.get("even") is not None
    if not steps_after_buffer(True, even, spec.steps):  # each draw was handed out
        work, buffered, handed = _resolve(tail, spec, then=then)
        kept_count, drawn = len(handed), len(handed)
    else:  # draws the steps after the buffer dropped were not handed out
        work, buffered, drawn_at, kept = _draw_passing(tail, spec, then)
        kept_count, drawn = len(kept), len(drawn_at)
    if kept_count < then:
        raise StateMismatchError(
            f"the state says a reader handed out {then} records after it, and only "
            f"{kept_count} are left to draw: the data or the steps changed since the state "
            "was taken; merge the states of the same data and steps"
        )
    return work, buffered, Counter({"dropped": drawn - kept_count})


def _skip_in_order(tail: dict[str, Any], spec: ReaderDescription, then: int
                   ) -> tuple[list[WorkItem], list[Position], Counter[str]]:
    """An in-order reader's work from its position, its first `then` records (after its
    map and filter steps, which run before it hands records out) read already -> (the work
    after them, no buffered records, counters of the lines passed among them)."""
    work = [(block, start) for block, start in tail["work"]]
    passed: Counter[str] = Counter()
    seen = 0
    *_, mapped = reading_front(spec, work, spec.steps)
    for chunk in mapped:
        for index, item in enumerate(chunk.items):
            if item.__class__ is Marker:
                passed[item.kind] += 1  # bad, blank, dropped: the counters' names
                continue
            seen += 1
            if seen == then:
                rest = [(chunk.block, chunk.offsets[index + 1]), *work[chunk.work_index + 1 :]]
                return rest, [], passed
    if not tail["even"]:  # under even_ranks="pad", the rest were repeats of pad work
        raise StateMismatchError(
            f"the state says a reader handed out {then} records after it, and only {seen} "
            "are left in its work: the data or the steps changed since the state was taken; "
            "merge the states of the same data and steps"
        )
    return [], [], passed


def _passing(records: list[Any], steps: tuple[Step, ...]) -> list[tuple[int, Any]]:
    """(index, record after `steps`) of the records `steps` keep, in order."""
    apply = Composed(steps)
    done = [apply(record) for record in records]
    return [(index, record) for index, record in enumerate(done) if record is not DROPPED]


def resolve_tails(merged: dict[str, Any], spec: ReaderDescription) -> dict[str, Any]:
    """`merged` with every tail turned into work items and buffered positions.

    Reads at most (records handed out since the snapshot + buffer size) records per tail.
    """
    resolved = copy.deepcopy(merged)
    for tail in resolved.pop("tails"):
        if "merged" in tail:  # readers that had not started: their shares of an earlier one
            earlier = resolve_tails(tail["merged"], spec)
            for reader in tail["readers"]:
                work, buffered, _ = share_of(earlier, World(*reader))
                resolved["remaining"].extend(list(item) for item in work)
                resolved["pending"].extend(list(position) for position in buffered)
            continue
        if _POOL in tail:
            work, buffered, dropped = _resolve_pool(tail, spec)
            resolved["counts"]["dropped"] += dropped
        elif _THEN in tail:
            work, buffered, passed = _resolve_handed(tail, spec)
            for name, count in passed.items():
                resolved["counts"][name] = resolved["counts"].get(name, 0) + count
        else:
            work, buffered, _ = _resolve(tail, spec)
        resolved["remaining"].extend(list(item) for item in work)
        resolved["pending"].extend(list(position) for position in buffered)
    return resolved


def share_of(merged: dict[str, Any], world: World, sizes: Sequence[int] | None = None
             ) -> tuple[list[WorkItem], list[Position], dict[str, int]]:
    """This reader's part of a resolved merged state: work items, prefill (records that were
    in a shuffle buffer, put back into this reader's), and (for reader 0 only) the counts
    carried over.

    Work items are dealt in contiguous runs (`streamds.storage.plan.run_bounds`), so that
    the rest of a Parquet row group stays with one reader; with
    `sizes` (the records of each remaining item, known under even_ranks) by record count
    instead, largest first to the reader holding the fewest, so that the readers' shares
    differ by as little as whole items allow: even ranks then pad (repeat) as few records
    as the remaining tails permit, instead of whatever a deal by item count leaves uneven.
    Buffered records are dealt in turn."""
    step, first = world.readers, world.reader
    remaining = merged["remaining"]
    prefill = [(b, o) for b, o in merged["pending"][first::step]]
    counts = merged["counts"] if first == 0 else {}
    if sizes is None:
        start, stop = run_bounds(len(remaining), step, deal_position(world))
        work = [(b, s) for b, s in remaining[start:stop]]
        return work, prefill, dict(counts)
    pending = len(merged["pending"])
    loads = [pending // step + (reader < pending % step) for reader in range(step)]
    owner = [0] * len(remaining)
    for index in sorted(range(len(remaining)), key=lambda i: (-sizes[i], i)):
        reader = min(range(step), key=lambda r: (loads[r], r))
        owner[index] = reader
        loads[reader] += sizes[index]
    work = [(b, s) for (b, s), mine in zip(remaining, owner, strict=True) if mine == first]
    return work, prefill, dict(counts)


