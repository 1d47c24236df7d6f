"""The unit that flows between stages: a `Chunk` of consecutive items of one work item.

Stages pass chunks, not records, so per-record Python work happens once, in the stage that
hands records out. `ChunkCursor` is how that stage keeps an exact position at any record: the
source's state before the current chunk, plus the work item and offset of the next record.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Chunk", "ChunkCursor", "ChunkStage", "Position", "Stored", "WorkItem"]

# (block id, offset): where the record's line begins in the shard's decoded bytes; in a tar
# shard or a .json document (chunks with `labels`) the record's ordinal in the shard instead
Position = tuple[int, int]
WorkItem = tuple[int, int | None]  # (block id, offset to start at; None: the block's start)


@dataclass(slots=True)
class Chunk:
    """Items of one work item. `offsets[i]` is where item i's line begins (a record ordinal
    when `labels` is set: see `Position`); `offsets[-1]` is where the line after the chunk
    begins. `clean`: every item is a record (no markers)."""

    work_index: int  # which work item, counted in this reader's work
    block: int  # block id
    offsets: list[int]
    items: list[Any]
    clean: bool
    labels: list[str] | None = None  # tar member or JSON document, for errors; None: lines
    stored: bool = False  # `Stored` placeholders (and line markers) of a block ds.cache holds

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
    block, `streamds.stages.cache`): small, so a shuffle buffer holds these, not records."""

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


class ChunkCursor:
    """Pulls chunks from `source` and remembers the source's state before each one.

    Position: ``{"source": <source state before the chunk>, "item": k, "offset": o}``: the
    next record is the one at offset o of work item k. A position taken at any record resumes
    there exactly: the source restarts before that chunk and the chunk is cut at o.
    """

    SOURCE = "source"
    ITEM = "item"
    OFFSET = "offset"

    def __init__(self, source: ChunkStage) -> None:
        self.source = source
        self.before: dict[str, Any] | None = None
        self._cut: tuple[int, int] | None = None

    def reset(self, position: dict[str, Any] | None) -> None:
        if position is None:
            self.source.reset(None)
            self._cut = None
        else:
            self.source.reset(position[self.SOURCE])
            self._cut = (position[self.ITEM], position[self.OFFSET])
        self.before = None

    def chunks(self) -> Iterator[Chunk]:
        source = self.source
        stream = iter(source)
        while True:
            before = source.get_state()
            chunk = next(stream, None)
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
        if chunk is None or index >= len(chunk.items):
            state = self.source.get_state()  # the chunk is spent: after it, exactly
            return {self.SOURCE: state, self.ITEM: -1, self.OFFSET: 0}
        return {self.SOURCE: self.before, self.ITEM: chunk.work_index,
                self.OFFSET: chunk.offsets[index]}
