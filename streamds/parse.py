"""Parse: raw lines -> JSON values with orjson, under an `on_error` policy.

A chunk parses in one list comprehension; only a chunk that holds a bad or blank line takes
the slow path, where blank lines become `BLANK` (not records) and malformed ones either raise
`CorruptRecordError` (naming the file, the 1-based line and the offset) or become `BAD`, so
the next stage can count them exactly where the stream passes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from .errors import CorruptRecordError
from .read import LineChunk

__all__ = ["BAD", "BLANK", "DROPPED", "ON_ERROR", "Marker", "parse_chunk"]

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


def _bad_line_error(chunk: LineChunk, index: int, url: str, locate: Locate, err: Exception):
    snippet = chunk.lines[index][:_SNIPPET]
    line, where = locate(index)
    return CorruptRecordError(
        f"{url}: {where}: invalid JSON ({err}): {snippet!r}; fix or remove the line, "
        "or pass on_error='skip' to skip and count malformed lines",
        url=url,
        line=line,
        offset=chunk.offsets[index],
    )


def parse_chunk(
    chunk: LineChunk, *, on_error: str, url: str, locate: Locate
) -> tuple[list[Any], bool]:
    """One parsed value (or marker) per line of `chunk`, aligned with `chunk.offsets`, and
    whether the list is free of markers (every line a record)."""
    loads = orjson.loads
    try:
        return [loads(line) for line in chunk.lines], True
    except orjson.JSONDecodeError:
        pass  # some line is blank or malformed: redo the chunk line by line
    items: list[Any] = []
    for index, line in enumerate(chunk.lines):
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
