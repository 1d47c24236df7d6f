"""The unit that flows between stages: a `Chunk` of consecutive items of one work item.

Stages pass chunks, not records, so per-record Python work happens once, in the stage that
hands records out. `ChunkCursor` is how that stage keeps an exact position at any record: the
source's state before the current chunk, plus the work item and offset of the next record.

Every stage's state names its stage under `STAGE`, nests its source's under `SOURCE` and
keeps its counters under `COUNTS` (the protocol's keys); `nodes` walks such a state down,
`find` finds the node of a stage by its name, and `counts_in` sums the counters.
Every other key belongs to the stage that writes it, and only that stage reads it: callers
use its operations (`ChunkCursor.at`, `Lines.position_in`, `Shuffle.snapshot_of`, ...).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import StateMismatchError

__all__ = ["COUNTS", "SOURCE", "STAGE", "Below", "Chunk", "ChunkCursor", "ChunkStage",
           "HandedOut", "Position", "Rest", "Stored", "WorkItem", "checked", "counts_in", "find",
           "nodes"]

STAGE = "stage"  # the key by which every node of a state tree names its stage

SOURCE = "source"  # the key under which every stage's state nests its source's
COUNTS = "counts"  # the key under which a stage that counts keeps its counters

# (block id, offset): where the record's line begins in the shard's decoded bytes; in a tar
# shard or a .json document (chunks with `labels`) the record's ordinal in the shard instead
Position = tuple[int, int]
WorkItem = tuple[int, int | None]  # (block id, offset to start at; None: the block's start)


@dataclass(slots=True)
class Chunk:
    """Items of one work item. `offsets[i]` is where item i's line begins (a record ordinal
    when `labels` is set: see `Position`); `offsets[-1]` is where the line after the chunk
    begins. `clean`: every item is a record (no markers). `data`: raw lines only, the bytes
    they were cut from (`streamds.storage.read.LineChunk`), for parsing; None elsewhere."""

    work_index: int  # which work item, counted in this reader's work
    block: int  # block id
    offsets: list[int]
    items: list[Any]
    clean: bool
    labels: list[str] | None = None  # tar member or JSON document, for errors; None: lines
    stored: bool = False  # `Stored` placeholders (and line markers) of a block ds.cache holds
    data: bytes | None = None

    def starting_at(self, offset: int) -> Chunk:
        """The part of the chunk from the line at `offset` on."""
        first = 0
        while first < len(self.items) and self.offsets[first] < offset:
            first += 1
        labels = None if self.labels is None else self.labels[first:]
        return Chunk(self.work_index, self.block, self.offsets[first:], self.items[first:],
                     self.clean, labels)


class Stored:
    """A placeholder for the entry `ordinal` of a block `ds.cache` holds (`held`: the open
    block, `streamds.stages.record_cache`): small, so a shuffle buffer holds these, not records."""

    __slots__ = ("held", "ordinal")

    def __init__(self, held: Any, ordinal: int) -> None:
        self.held = held
        self.ordinal = ordinal

    def __repr__(self) -> str:
        return f"<stored {self.held.block}:{self.ordinal}>"


class ChunkStage(Protocol):
    """The stage contract (torchdata.nodes style): reset, iterate chunks, get_state."""

    def reset(self, state: dict[str, Any] | None = None) -> None: ...
    def get_state(self) -> dict[str, Any]: ...
    def __iter__(self) -> Iterator[Chunk]: ...
    @property
    def counts(self) -> dict[str, int]: ...


@dataclass
class Rest:
    """What a reader's pipeline state leaves of its epoch, as its stages tell it (the elastic
    merge: each node's stage answers `unfinished(node, below)`, `below` going on down to its
    source's node): where the record stream stands (a `ChunkCursor` position; under a
    shuffle, at the buffer's snapshot), the buffer's `snapshot` (`Shuffle.snapshot_of`), and
    the `pool` of batches being handed out (`PoolBatch.pool_of`; None: none begun)."""

    position: dict[str, Any]
    snapshot: dict[str, Any] | None = None
    pool: dict[str, Any] | None = None


Below = Callable[[Any], Rest]  # a source's node -> what it leaves (the walk on down)


@dataclass(frozen=True)
class HandedOut:
    """A start: a reader that has handed out `records` records of its epoch (a plain
    loader's resume), then, batching by a rule, `batches` batches of its pool number `pool`
    (which begins after those records). Each stage above the records stage answers for its
    own state at that point (`over(source_state, handed)`)."""

    records: int
    pool: int = 0
    batches: int = 0


def nodes(state: Any) -> Iterator[dict[str, Any]]:
    """The state of every stage down a nested stage state, the top first (each nests its
    source's under `SOURCE`; the walk ends at a stage without a source)."""
    node = state
    while isinstance(node, dict):
        yield node
        node = node.get(SOURCE)


def checked(state: Any, stage: str) -> dict[str, Any]:
    """`state` as the node of stage `stage`; strict: another stage's node, or no node, fails."""
    if isinstance(state, dict) and state.get(STAGE) == stage:
        return state
    found = state.get(STAGE) if isinstance(state, dict) else type(state).__name__
    raise StateMismatchError(
        f"damaged streamds state: the {stage!r} stage was given the state of {found!r}; pass "
        "the dict that state_dict() returned, unchanged, to a dataset built the same way"
    )


def find(state: Any, stage: str) -> dict[str, Any]:
    """The node of stage `stage` down a nested stage state (strict: it must be there)."""
    for node in nodes(state):
        if node.get(STAGE) == stage:
            return node
    raise StateMismatchError(
        f"damaged streamds state: no {stage!r} stage's state below this one; pass the dict "
        "that state_dict() returned, unchanged"
    )


def counts_in(state: Any) -> Counter[str]:
    """The counters of every stage down a nested stage state, summed (not every stage
    counts)."""
    counts: Counter[str] = Counter()
    for node in nodes(state):
        counts.update(node.get(COUNTS, {}))
    return counts


class ChunkCursor:
    """Pulls chunks from `source` and remembers the source's state before each one.

    Position: ``{"stage": "cursor", "source": <source state before the chunk>, "item": k,
    "offset": o}``: the
    next record is the one at offset o of work item k. A position taken at any record resumes
    there exactly: the source restarts before that chunk and the chunk is cut at o.
    """

    STAGE = "cursor"
    SOURCE = SOURCE
    ITEM = "item"
    OFFSET = "offset"
    BETWEEN = -1  # the item of a position between chunks: the source's state says the rest

    @classmethod
    def at(cls, source: Any, item: int, offset: int | None) -> dict[str, Any]:
        """The position of the record at `offset` of work item `item` (None: the item's
        first), the source standing at `source` (its state before that record's chunk)."""
        return {STAGE: cls.STAGE, cls.SOURCE: source, cls.ITEM: item,
                cls.OFFSET: -1 if offset is None else offset}

    @classmethod
    def between(cls, source: Any) -> dict[str, Any]:
        """The position between chunks where the source stands at `source`: its next chunk
        whole."""
        return {STAGE: cls.STAGE, cls.SOURCE: source, cls.ITEM: cls.BETWEEN, cls.OFFSET: 0}

    @classmethod
    def source_of(cls, position: dict[str, Any]) -> Any:
        """The source's state in a position (before the next record's chunk)."""
        return position[cls.SOURCE]

    @classmethod
    def next_record(cls, position: dict[str, Any]) -> tuple[int, int] | None:
        """(work item, offset) of the next record of a position; None between chunks, where
        the source's state says where it stands."""
        item = position[cls.ITEM]
        if item < 0:
            return None
        return item, position[cls.OFFSET]

    @classmethod
    def unfinished(cls, position: dict[str, Any], below: Below) -> Rest:
        """What a reader whose records stage stands at `position` leaves: the rest of its
        stream from there (the in-order records stage's state is its cursor's)."""
        return Rest(position)

    def __init__(self, source: ChunkStage) -> None:
        self.source = source
        self.before: dict[str, Any] | None = None
        self._cut: tuple[int, int] | None = None
        self.failed = False  # making the next chunk raised: a position stands before it

    def reset(self, position: dict[str, Any] | None) -> None:
        if position is None:
            self.source.reset(None)
            self._cut = None
        else:
            checked(position, self.STAGE)
            self.source.reset(position[self.SOURCE])
            self._cut = (position[self.ITEM], position[self.OFFSET])
        self.before = None
        self.failed = False

    def chunks(self) -> Iterator[Chunk]:
        source = self.source
        stream = iter(source)
        while True:
            before = source.get_state()
            try:
                chunk = next(stream, None)
            except BaseException:
                # a stage below raised while making the chunk (a step, a bad line): none of
                # its records was handed out, so a state taken now resumes at its start,
                # where the failing record is read again (guarantee 12)
                self.before, self.failed = before, True
                raise
            if chunk is None:
                self.before = before
                return
            if self._cut is not None:
                item, offset = self._cut
                self._cut = None
                if chunk.work_index == item:
                    chunk = chunk.starting_at(offset)
                    if not chunk.items:  # the record is in a later chunk of the item (the
                        self._cut = (item, offset)  # source cut its chunks elsewhere)
            self.before = before
            yield chunk

    def position(self, chunk: Chunk | None, index: int) -> dict[str, Any]:
        """Where the record `index` of `chunk` is (None: past the last chunk)."""
        if self.failed:  # before the chunk whose making raised
            return self.between(self.before)
        if chunk is None or index >= len(chunk.items):
            return self.between(self.source.get_state())  # the chunk is spent: after it
        return self.at(self.before, chunk.work_index, chunk.offsets[index])
