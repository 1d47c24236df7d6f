"""Parse: raw lines -> JSON values with orjson, under an `on_error` policy.

A chunk parses in one list comprehension; only a chunk that holds a bad or blank line takes
the slow path, where blank lines become `BLANK` (not records) and malformed ones either raise
`CorruptRecordError` (naming the file, the 1-based line and the offset) or become `BAD`, so
the next stage can count them exactly where the stream passes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from .chunks import Chunk
from .errors import CorruptRecordError
from .read import Opener, count_lines_before, open_decoded_at

if TYPE_CHECKING:
    from .plan import Block
    from .shards import Shard

__all__ = ["BAD", "BLANK", "DROPPED", "ON_ERROR", "Marker", "Parse", "parse_chunk"]

ON_ERROR = ("raise", "skip")
_SNIPPET = 80  # bytes of a bad line quoted in the error


class Marker:
    """A stand-in for a line that yields no record; `kind` says why."""

    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"<{self.kind}>"


BLANK = Marker("blank")  # an empty or whitespace-only line: not a record, not an error
BAD = Marker("bad")  # a malformed line skipped under on_error="skip"
DROPPED = Marker("dropped")  # a record a transform or filter removed

# Locates a bad line: chunk index -> (1-based line number or None, "line 12 (byte offset 345)")
Locate = Callable[[int], tuple[int | None, str]]
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark some editors put at the start of a file


def _bad_line_error(chunk: Chunk, index: int, url: str, locate: Locate, err: Exception):
    snippet = chunk.items[index][:_SNIPPET]
    line, where = locate(index)
    return CorruptRecordError(
        f"{url}: {where}: invalid JSON ({err}): {snippet!r}; fix or remove the line, "
        "or pass on_error='skip' to skip and count malformed lines",
        url=url,
        line=line,
        offset=chunk.offsets[index],
    )


def parse_chunk(
    chunk: Chunk, *, on_error: str, url: str, locate: Locate
) -> tuple[list[Any], bool]:
    """One parsed value (or marker) per line of `chunk`, aligned with `chunk.offsets`, and
    whether the list is free of markers (every line a record)."""
    loads = orjson.loads
    try:
        return [loads(line) for line in chunk.items], True
    except orjson.JSONDecodeError:
        pass  # some line is blank or malformed: redo the chunk line by line
    items: list[Any] = []
    for index, line in enumerate(chunk.items):
        if chunk.offsets[index] == 0 and line.startswith(_BOM) and chunk.labels is None:
            line = line[len(_BOM) :]
        try:
            items.append(loads(line))
        except orjson.JSONDecodeError as err:
            if not line.strip():
                items.append(BLANK)
            elif on_error == "skip":
                items.append(BAD)
            else:
                raise _bad_line_error(chunk, index, url, locate, err) from err
    return items, False


class Parse:
    """Stage: chunks of raw lines -> chunks of JSON values, BAD and BLANK markers.

    State: ``{"source": ..., "counts": {"bad": n, "blank": m}}``, counted as chunks pass.
    """

    SOURCE = "source"
    COUNTS = "counts"

    def __init__(
        self, source: Any, shards: Sequence[Shard], blocks: Sequence[Block], *,
        on_error: str = "raise", opener: Opener = open_decoded_at,
    ) -> None:
        self.source = source
        self.shards = shards
        self.blocks = blocks
        self.on_error = on_error
        self.opener = opener
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        self.source.reset(None if state is None else state[self.SOURCE])
        counts = {"bad": 0, "blank": 0} if state is None else state[self.COUNTS]
        self._bad, self._blank = counts["bad"], counts["blank"]

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE: self.source.get_state(),
                self.COUNTS: {"bad": self._bad, "blank": self._blank}}

    @property
    def counts(self) -> dict[str, int]:
        return {**self.source.counts, "bad": self._bad, "blank": self._blank}

    def parse(self, chunk: Chunk) -> Chunk:
        """`chunk` with its lines parsed (also used to re-read buffered records)."""
        shard = self.shards[self.blocks[chunk.block].shard]
        items, clean = parse_chunk(chunk, on_error=self.on_error, url=shard.url,
                                   locate=self._locate(chunk, shard))
        return Chunk(chunk.item, chunk.block, chunk.offsets, items, clean, chunk.labels)

    def _locate(self, chunk: Chunk, shard: Shard) -> Locate:
        def locate(index: int) -> tuple[int | None, str]:
            if chunk.labels is not None:
                return None, f"{chunk.labels[index]} (record {chunk.offsets[index] + 1})"
            offset = chunk.offsets[index]
            line = count_lines_before(shard, offset, self.opener) + 1
            return line, f"line {line} (byte offset {offset})"

        return locate

    def __iter__(self) -> Iterator[Chunk]:
        for raw in self.source:
            chunk = self.parse(raw)
            if not chunk.clean:
                self._bad += chunk.items.count(BAD)
                self._blank += chunk.items.count(BLANK)
            yield chunk
