"""The reader: one `ReaderState` -> the stages that yield its records.

`ReaderDescription` (`streamds.stages.description`) is what every reader of a dataset shares;
`Reader` builds one reader's pipeline from a `ReaderState` and gives its state back. When its
epoch ends, a reader logs what it counted (skipped, blank and dropped lines, damaged blocks):
a warning when lines were lost to errors, else an info line.

Where the map and filter steps run (`steps_after_buffer`): a shuffling reader runs them on
records as they leave the shuffle buffer, so the buffer holds parsed records (memory follows
the records as read, not as mapped) and the first record, also after a resume, comes after
reading and parsing the buffer, not mapping it. Under even_ranks they run before the buffer,
as every reader does without a shuffle: a reader's quota counts records after the steps, and
a record dropped after the buffer would leave its rank short; and where a step is a batched
map (`ds.map(fn, batch_size=n)`), which runs on a chunk's records at once. A step that drops records
changes which records the buffer draws from, so the shuffled order for a seed differs from
that of streamds versions that mapped before the buffer (the records do not).

With `ds.cache` (`ReaderDescription.records_cache`), one `BlockCache` per reader is shared by
the lines stage (stored blocks are not read: placeholders of their records' positions flow
instead) and the stage that runs the steps (placeholders become stored records; computed
records are stored); every stage's state is what it is without the cache
(`streamds.stages.record_cache`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

from torch.utils.data import get_worker_info

from ..errors import StateMismatchError
from ..handover.shm_tensors import leave_as_tensor_batches
from ..seeds import shuffle_seed_parts
from .ahead import AHEAD, MadeAhead
from .balance import EvenRanks
from .batch import Batch, records_from_user_steps
from .buckets import PoolBatch
from .chunks import Chunk, ChunkCursor, HandedOut, Position, Rest, Stored, WorkItem
from .cpus import TUNE, on_planned_cpus, worker_plan
from .description import ReaderDescription
from .lines import Lines
from .numbers import Numbers
from .parse import DROPPED, WARN_BAD_LINES, LineNumbers, Parse
from .parse_later import LineBatch, ParseLater, parses_later
from .record_cache import BlockCache
from .records import Records, fetch_records
from .shuffle import Shuffle
from .state import ReaderState, stage_of
from .timing import StageTimer, Timed
from .transform import AfterBuffer, Step, Transform, compose, has_batched

__all__ = ["Reader", "buffer_intake", "describe_counts", "numbers_shuffle", "preparer",
           "read_up_to", "reading_front", "rest_of", "state_after", "steps_after_buffer",
           "steps_before_buffer", "work_after"]

log = logging.getLogger(__name__)

# counter -> how a summary says it
_COUNTED = {
    "bad": "malformed lines skipped (on_error='skip')",
    "corrupt_blocks": "damaged blocks skipped (on_error='skip')",
    "blank": "blank lines",
    "dropped": "records dropped by map (None) or filter",
}
_LOST = ("bad", "corrupt_blocks")  # counters of data lost to errors: a warning


def steps_after_buffer(shuffle: bool, even_ranks: bool, steps: Sequence[Step] = ()) -> bool:
    """Whether a reader runs its map and filter steps after the shuffle buffer (else before
    it): with a buffer, unless its ranks are evened (their quotas count mapped records) or a
    step is a batched map (it runs on a chunk's records at once: records leave the buffer one
    at a time, and a look-ahead batch would hold records no state names)."""
    return shuffle and not even_ranks and not has_batched(steps)


# what the slow-fill log adds where the steps run before the buffer
_MAPPED_FIRST = ("; under even_ranks the map and filter steps run before the buffer (each "
                 "reader's quota counts the records they keep), so every buffered record was "
                 "mapped first")


def _untimed(stage: Any, name: str) -> Any:
    return stage


def reading_front(
    spec: ReaderDescription, work: Sequence[WorkItem], steps: Sequence[Step], *,
    pad_work: Sequence[WorkItem] = (), where: LineNumbers | None = None,
    stored: BlockCache | None = None, later: bool = False,
    timed: Callable[[Any, str], Any] = _untimed, reading: bool = False,
) -> tuple[Lines, Parse, Transform]:
    """The front of every reader chain: Lines -> Parse -> Transform over `work` (then
    `pad_work`) with `steps`. A reader's (`reading`) reads ahead and through the shard cache,
    with `stored` (`ds.cache`) and its stages timed; without, as the resumes read a share of
    the records again to find their positions (`streamds.resume.merge`)."""
    where = where or LineNumbers(spec.shards, spec.blocks, spec.opener)  # for messages
    # -> chunks of raw lines of the blocks of `work` (then of `pad_work`, under even ranks);
    #    a block `stored` holds: chunks of placeholders of its stored records instead
    lines = Lines(spec.shards, spec.blocks, work, on_error=spec.on_error, opener=spec.opener,
                  retry=spec.retry, pad_work=pad_work,
                  readahead=spec.readahead if reading else 0,
                  cache=spec.cache if reading else None, stored=stored)
    # -> chunks of JSON values; BAD and BLANK markers where a line holds no record
    #    (or of the lines themselves, when the main process parses the batches: `later`)
    parse: Parse = (
        ParseLater(timed(lines, "lines")) if later else
        Parse(timed(lines, "lines"), spec.shards, spec.blocks, on_error=spec.on_error,
              opener=spec.opener, where=where))
    # -> chunks of the user's records after `steps`; DROPPED where removed
    cached_steps = 0 if stored is None or spec.records_cache is None else spec.records_cache.steps
    transform = Transform(timed(parse, "parse"), tuple(steps), where=where, cache=stored,
                          cached_steps=cached_steps)
    return lines, parse, transform


def steps_before_buffer(spec: ReaderDescription, even: bool) -> tuple[Step, ...]:
    """The steps a shuffling reader runs before its buffer (`steps_after_buffer`)."""
    return () if steps_after_buffer(True, even, spec.steps) else tuple(spec.steps)


def buffer_intake(
    spec: ReaderDescription, work: Sequence[WorkItem], *, pad: Sequence[WorkItem] = (),
    quota: int | None = None, position: dict[str, Any] | None = None,
) -> Iterator[Chunk]:
    """Chunks of the records a shuffling reader's buffer takes in from `work` (as its
    pipeline reads them, no cache): parsed, and mapped where the steps run before the buffer.
    Under even ranks (`quota` given), its whole stream: `work`, then `pad` cycled, ended by
    the quota, from `position` (a `ChunkCursor` position of that stream; None: its start).
    For the elastic resume that reads the records after a buffer's snapshot."""
    even = quota is not None
    *_, mapped = reading_front(spec, work, steps_before_buffer(spec, even),
                               pad_work=pad if even else ())
    if not even:
        return iter(mapped)
    cursor = ChunkCursor(EvenRanks(mapped, quota, work_items=len(work), pad_items=len(pad)))
    cursor.reset(position)
    return cursor.chunks()


def preparer(spec: ReaderDescription, steps: Sequence[Step]) -> Callable[[Chunk], Chunk]:
    """Raw lines -> the records a reader's pipeline makes of them (parsed, then `steps`)."""
    _, parse, transform = reading_front(spec, [], steps)
    return lambda chunk: transform.transform(parse.parse(chunk))


def state_after(spec: ReaderDescription, state: ReaderState, handed: HandedOut,
                records_state: Callable[[Reader, int], dict[str, Any]]) -> dict[str, Any]:
    """The pipeline state of reader `state` once it has handed out `handed` (a plain
    loader's resume): `records_state(reader, n)` places the built reader's records stage
    after its first n records (from record counts; `streamds.resume.plain_loader`), and each
    stage above it answers for its own node (`Reader.state_over`)."""
    reader = Reader(spec, state)
    return reader.state_over(records_state(reader, handed.records), handed)


# the stages whose nodes a reader's pipeline state holds, from the top down to its records
# stage's cursor, by the name each node gives (`unfinished`: what the reader leaves)
_UNWINDING = {stage.STAGE: stage for stage in (PoolBatch, Batch, AfterBuffer, Shuffle,
                                               ChunkCursor)}


def rest_of(pipeline: dict[str, Any]) -> Rest:
    """What a reader whose pipeline stands at `pipeline` leaves of its epoch (an elastic
    merge): each node's stage answers for its node, asking on down its source's."""
    stage = _UNWINDING.get(stage_of(pipeline) or "")
    if stage is None:
        raise StateMismatchError(
            f"damaged streamds state: a reader's pipeline holds a node of stage "
            f"{stage_of(pipeline)!r} where one of {sorted(_UNWINDING)} belongs; pass the dict "
            "that state_dict() returned, unchanged")
    return stage.unfinished(pipeline, rest_of)


def _next_record(position: dict[str, Any]) -> tuple[int, int | None]:
    """(work item, offset) of the next record of a `ChunkCursor` position; between chunks,
    where the line reader below stands."""
    found = ChunkCursor.next_record(position)
    if found is not None:
        return found
    return Lines.position_in(ChunkCursor.source_of(position))


def work_after(work: Sequence[WorkItem], position: dict[str, Any]) -> list[WorkItem]:
    """The items of `work` left after a records stage's `ChunkCursor` position."""
    item, offset = _next_record(position)
    if item >= len(work):
        return []
    block, start = work[item]
    return [(block, start if offset is None else offset), *work[item + 1 :]]


def read_up_to(position: dict[str, Any]) -> tuple[int, int | None]:
    """(k, o): the records an even-ranks reader had passed on before a `ChunkCursor` position
    are those of its stream's items before k, and of item k those before offset o (None:
    none). Between chunks that is where the quota cut the stream, else where the line reader
    stands."""
    found = ChunkCursor.next_record(position)
    if found is not None:
        return found
    cut = EvenRanks.cut_of(ChunkCursor.source_of(position))
    if cut is not None:
        return cut
    return Lines.position_in(ChunkCursor.source_of(position))


def _numbered(positions: Sequence[Position]) -> list[Any]:
    return list(positions)  # a number's record is its position


def numbers_shuffle(total: int | None, *, size: int, seed_parts: tuple[int | str, ...]
                    ) -> tuple[Shuffle, Numbers]:
    """A shuffle over the record numbers 0, 1, ... `total` (None: no end), and its source:
    the replay of a reader's buffer without reading its records (`streamds.resume.replay`)."""
    numbers = Numbers(total)
    return Shuffle(numbers, size=size, seed_parts=seed_parts, fetch=_numbered), numbers


class Reader:
    """One reader's pipeline, positioned where `state` says; iterate for its records."""

    # the timed stages, source first where the steps run before the buffer (after it,
    # "transform" comes last: `StageTimer` tells the order from the times themselves)
    STAGES = ("lines", "parse", "transform", "even_ranks", "emit")

    def __init__(
        self, spec: ReaderDescription, state: ReaderState, *, pad_work: Sequence[WorkItem] = (),
        timer: StageTimer | None = None,
    ) -> None:
        self.spec = spec
        self.state = state
        self.timer = timer

        def timed(stage: Any, name: str) -> Any:
            return stage if timer is None else Timed(stage, name, timer)

        world = state.share
        work = state.work if state.work is not None else spec.plan.work(state.epoch, world)
        pad = list(pad_work) if state.quota is not None else []
        where = LineNumbers(spec.shards, spec.blocks, spec.opener)  # for messages
        if spec.steps:  # what a user's step makes is checked before it is marshalled
            records_from_user_steps()
        self.late = steps_after_buffer(spec.plan.shuffle, state.quota is not None, spec.steps)
        # `ds.cache`: the store of the records the first steps make, per block
        cached = spec.records_cache
        self.cache = None if cached is None else BlockCache(
            cached, late=self.late, where=where, compute=self._compute)
        collate = None if spec.batch is None else spec.batch.collate
        later = self.later = parses_later(spec, collate)
        # -> chunks of the user's records after map and filter (none where the steps run
        #    after the shuffle buffer, `late`), from this reader's blocks (`reading_front`)
        self.lines, self.parse, self.transform = reading_front(
            spec, work, () if self.late else spec.steps, pad_work=pad, where=where,
            stored=self.cache, later=later, timed=timed, reading=True)
        cached_steps = 0 if cached is None else cached.steps
        # -> chunks holding exactly `quota` records in all (even ranks), else all of them
        quota = None if state.quota is None else max(0, state.quota - len(state.prefill))
        mapped = self.transform if self.late else timed(self.transform, "transform")
        self.even = EvenRanks(mapped, quota, work_items=len(work), pad_items=len(pad),
                              mode=spec.even_ranks)
        # -> records one at a time: in order, or through the seeded shuffle buffer
        self.records: Records | Shuffle
        end = None if self.late else self._end  # called by the stage that ends last
        if spec.plan.shuffle:
            parts = shuffle_seed_parts(spec.plan.seed, state.epoch, world.rank, world.worker)
            self.records = Shuffle(
                timed(self.even, "even_ranks"), size=spec.buffer_size, seed_parts=parts,
                fetch=self.fetch, prefill=state.prefill, on_end=end,
                tell=self.late and (bool(spec.steps) or cached is not None),
                fill_note="" if self.late or not spec.steps else _MAPPED_FIRST)
        elif state.prefill:
            raise ValueError("buffered records to carry over need shuffle=True")
        else:
            self.records = Records(timed(self.even, "even_ranks"), on_end=end)
        # -> the same records after the user's map and filter, where those run after the buffer
        self.top: Records | Shuffle | AfterBuffer = self.records
        # the stages above the records stage, the records stage's first: each says its state
        # over the one below for a plain loader's resume (`state_after`)
        self.above: list[AfterBuffer | Batch | PoolBatch] = []
        if self.late:
            self.top = AfterBuffer(timed(self.records, "emit"), spec.steps, where=where,
                                   on_end=self._end, cache=self.cache,
                                   cached_steps=cached_steps)
            self.above.append(self.top)
        # -> whole batches, when the dataset was made with .batch(n) or .batch(rule)
        emit = timed(self.top, "transform" if self.late else "emit")
        self.out: Any = emit
        if spec.batch is not None:
            if later:  # lines cross to the main process, which parses them
                collate = partial(LineBatch, where=where)
            elif get_worker_info() is not None:  # dicts of tensors cross in shared memory
                collate = leave_as_tensor_batches(collate)
            if spec.batch.rule is None:
                self.out = Batch(emit, spec.batch, collate, positions=later)
            else:
                parts = shuffle_seed_parts(spec.plan.seed, state.epoch, world.rank, world.worker)
                self.out = PoolBatch(emit, spec.batch.rule, collate=collate, seed_parts=parts)
            self.above.append(self.out)
        self.out.reset(state.pipeline)
        self.finished = state.finished
        self.ahead: MadeAhead | None = None  # batches made ahead in a worker's thread

    def prepare(self, chunk: Chunk) -> Chunk:
        """Raw lines -> records as the shuffle buffer holds them (for re-reads): parsed, and
        mapped only where the steps run before the buffer."""
        return self.transform.transform(self.parse.parse(chunk))

    def state_over(self, records: dict[str, Any], handed: HandedOut) -> dict[str, Any]:
        """The pipeline state once the reader has handed out `handed`, its records stage --
        the shuffle, or the in-order records -- standing at `records`: each stage above it
        answers for its own node (for resumes computed from record counts, where every line
        yields a record)."""
        node = records
        for stage in self.above:
            node = stage.over(node, handed)
        return node

    def fetch(self, positions: Sequence[Position]) -> list[Any]:
        """The records at `positions` as the shuffle buffer holds them (for resumes)."""
        if self.cache is None:
            return self._fetch(positions)
        items = self.cache.fetch(positions, self._fetch)
        if self.late:  # placeholders of stored blocks: resolved as they leave the buffer
            return items
        after = self.transform.after_cache
        out = []
        for (block, offset), item in zip(positions, items, strict=True):
            if item.__class__ is Stored:
                item = self.cache.resolve(item)
                if item is not DROPPED and after is not None:
                    item = after(item)
                if item is DROPPED:
                    raise StateMismatchError(
                        f"block {block}, offset {offset}: a buffered record of the state is a "
                        "drop in the cache; the data or the steps changed since the state was "
                        "taken")
            out.append(item)
        return out

    def _fetch(self, positions: Sequence[Position]) -> list[Any]:
        return fetch_records(positions, shards=self.spec.shards, blocks=self.spec.blocks,
                             prepare=self.prepare, opener=self.spec.opener,
                             retry=self.spec.retry)

    def _compute(self, positions: Sequence[Position]) -> list[Any]:
        """The records at `positions` after the steps before the cache (DROPPED where those
        drop one), from the source: where a stored block turns out damaged."""
        cached = self.spec.records_cache
        steps = () if cached is None else self.spec.steps[:cached.steps]
        spec = self.spec
        records = fetch_records(positions, shards=spec.shards, blocks=spec.blocks,
                                prepare=self.parse.parse, opener=spec.opener, retry=spec.retry)
        apply = compose(steps)
        return records if apply is None else [apply(record) for record in records]

    def _end(self) -> None:
        """The epoch is over: log what was counted, give up the blocks not filled."""
        self.log_summary()
        if self.cache is not None:
            self.cache.close()

    def __iter__(self) -> Iterator[Any]:
        if self.finished:
            return iter(())
        info = get_worker_info()
        if info is None:
            return iter(self.out)
        items, batch = self.out, self.spec.batch
        plan = worker_plan(info.num_workers)
        # (a per-record reader is not tuned: timing every record would cost)
        if self.spec.worker_cpus == "auto" and (plan.how != TUNE or batch is not None):
            # workers that only copy lines for a loader that parses them on its own CPU
            main_heavy = self.later and batch is not None and batch.main_cpu
            items = on_planned_cpus(self.out, plan, main_heavy=main_heavy)
        depth = 0 if batch is None else batch.ahead
        if depth == "auto":  # where workers and main processes outnumber whole CPUs (TUNE;
            depth = AHEAD if plan.how == TUNE else 0  # not one CPU, not under a CPU quota)
        if depth:  # a thread makes the batches ahead of the loader's requests, with states
            self.ahead = MadeAhead(items, depth, self._reader_state, self._reader_state())
            return iter(self.ahead)
        return iter(items)

    @property
    def done(self) -> bool:
        """Whether the reader has handed out its last record (its epoch is over)."""
        return self.finished or self.out.done

    def reader_state(self) -> ReaderState:
        """The state to resume exactly here: O(1) to take."""
        if self.ahead is not None:  # after the last batch handed out, not the last made
            return self.ahead.state
        if self.timer is not None:
            start = time.perf_counter()
            state = self._reader_state()
            self.timer.add("state", time.perf_counter() - start)
            return state
        return self._reader_state()

    def _reader_state(self) -> ReaderState:
        old = self.state
        # once started, carried-over records live in the shuffle state: drop the list (and
        # its share of the quota) so that taking the state stays O(1)
        quota = None if old.quota is None else old.quota - len(old.prefill)
        return ReaderState(
            fingerprint=old.fingerprint, epoch=old.epoch, world=old.world, plan=old.plan,
            seat=old.seat, work=old.work, prefill=[], carried=old.carried, quota=quota,
            finished=self.done, pipeline=self.out.get_state(),
        )

    @property
    def counts(self) -> dict[str, int]:
        counts = dict(self.top.counts)
        for name, value in self.state.carried.items():
            counts[name] = counts.get(name, 0) + value
        return counts

    def log_summary(self) -> None:
        """Log what this reader counted in its epoch (called once, when the epoch ends)."""
        counts = self.counts
        w = self.state.world
        reader = (f"streamds reader (rank {w.rank} of {w.world_size}, worker {w.worker} of "
                  f"{w.num_workers}), epoch {self.state.epoch} done")
        if not any(counts.values()):
            log.debug("%s: every line was a record", reader)
            return
        said = describe_counts(counts)
        files = self.parse.skipped
        if files:
            listed = ", ".join(f"{url}: {n}" for url, n in files.most_common(5))
            more = f" and {len(files) - 5} more files" if len(files) > 5 else ""
            said += (f"; malformed lines per file in this process (the first {WARN_BAD_LINES} "
                     f"of each logged): {listed}{more}")
        lost = any(counts.get(name) for name in _LOST)
        log.log(logging.WARNING if lost else logging.INFO, "%s: %s", reader, said)

    def position_at(self, item: int, offset: int | None) -> dict[str, Any]:
        """A `ChunkCursor` position at work item `item`, offset `offset`, with counters at 0
        (for resumes computed from record counts)."""
        self.even.reset(None)  # every stage below the records stage at its start
        self.lines.seek(item, offset)
        return ChunkCursor.at(self.even.get_state(), item, offset)


def describe_counts(counts: dict[str, int]) -> str:
    """``"3 malformed lines skipped (on_error='skip'), 12 blank lines"``: the non-zero ones."""
    parts = [f"{counts[name]} {words}" for name, words in _COUNTED.items() if counts.get(name)]
    parts += [f"{name}={n}" for name, n in sorted(counts.items())
              if name not in _COUNTED and n]
    return ", ".join(parts) or "nothing skipped or dropped"
