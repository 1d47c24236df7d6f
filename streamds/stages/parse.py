"""Parse: raw lines -> records (JSON objects), exact (`streamds.formats.values`: orjson,
and Python's json for the few lines orjson would read differently), under an `on_error`
policy.

A chunk parses in one list comprehension; only a chunk that holds a bad or blank line takes
the slow path, where blank lines become `BLANK` (not records) and malformed ones (invalid
JSON, or a JSON value that is not an object) either raise
`CorruptRecordError` (naming the file, the 1-based line and the offset) or become `BAD`, so
the next stage can count them exactly where the stream passes them. Skipped lines are also
logged, per reader: the first `WARN_BAD_LINES` of each file with their line, then only counted
(the reader's end-of-epoch summary has the totals).

`LineNumbers` turns a (block, offset) into "line 12 (byte offset 345)" for messages; the
transform stage uses it too.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from ..errors import CorruptRecordError
from ..formats import values
from ..formats.jsonl import CutLines
from ..storage.read import Opener, count_newlines, open_decoded_at
from .chunks import COUNTS, SOURCE, STAGE, Chunk, checked

if TYPE_CHECKING:
    from ..storage.plan import Block
    from ..storage.shards import Shard

__all__ = [
    "BAD",
    "BLANK",
    "BOM",
    "DROPPED",
    "ON_ERROR",
    "SNIPPET",
    "WARN_BAD_LINES",
    "LineNumbers",
    "Marker",
    "Parse",
    "cut_bom",
    "describe_bad",
    "parse_chunk",
    "starts_file",
    "without_bom",
]

log = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")
WARN_BAD_LINES = 5  # skipped malformed lines logged one by one, per file and reader
SNIPPET = 80  # bytes of a bad line quoted in the error


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


class LineNumbers:
    """Where a record's line is, for messages: ``"line 12 (byte offset 345)"``, or a tar
    member's name.

    Line numbers cost a read of the shard's decoded bytes up to the line, so they are asked
    for on error and warning paths only. What was counted is kept (per shard, offset ->
    newlines before it) and the next count starts from the nearest known offset below, so
    messages about one shard read it about once. A read that fails leaves the line out of
    the message rather than hiding the error being reported.
    """

    def __init__(
        self, shards: Sequence[Shard], blocks: Sequence[Block],
        opener: Opener = open_decoded_at,
    ) -> None:
        self.shards = shards
        self.blocks = blocks
        self.opener = opener
        self._known: dict[int, tuple[list[int], list[int]]] = {}  # shard -> offsets, newlines

    def url(self, block: int) -> str:
        return self.shards[self.blocks[block].shard].url

    def line(self, block: int, offset: int) -> int | None:
        """The 1-based line that begins at decoded `offset` (None: the read failed)."""
        index = self.blocks[block].shard
        offsets, newlines = self._known.setdefault(index, ([0], [0]))
        nearest = bisect_right(offsets, offset) - 1
        start, count = offsets[nearest], newlines[nearest]
        try:
            more, remaining = count_newlines(self.shards[index], start, offset, self.opener)
            count += more
        except OSError as err:
            log.debug("could not count the lines of %s: %s", self.shards[index].url, err)
            return None
        if remaining > 0:  # the decoded data ends before `offset`: no line begins there
            return None
        if offsets[nearest] != offset:
            offsets.insert(nearest + 1, offset)
            newlines.insert(nearest + 1, count)
        return count + 1

    def place(self, block: int, offset: int) -> str:
        """``"file.jsonl: line 12 (byte offset 345)"``: where the record at a position is,
        known by its position alone (for a tar shard its ordinal in the file)."""
        url = self.url(block)
        said = self.shards[self.blocks[block].shard].format.place(url, offset)
        if said is not None:  # a position that is no line's byte offset: as its format says
            return said
        line = self.line(block, offset)
        if line is None:
            return f"{url}: byte offset {offset}"
        return f"{url}: line {line} (byte offset {offset})"

    def describe(self, chunk: Chunk, index: int) -> tuple[int | None, str]:
        """(1-based line or None, where item `index` of `chunk` is, in words)."""
        offset = chunk.offsets[index]
        if chunk.labels is not None:
            return None, f"{chunk.labels[index]} (record {offset + 1})"
        line = self.line(chunk.block, offset)
        if line is None:
            return None, f"byte offset {offset}"
        return line, f"line {line} (byte offset {offset})"


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark some editors put at the start of a file


def starts_file(offset: int, labels: Sequence[str] | None) -> bool:
    """Whether the item at `offset` is a file's first line: decoded offset 0 of a line-split
    shard (with `labels`, offsets number tar members or document parts, which have none)."""
    return offset == 0 and labels is None


def without_bom(line: bytes, offset: int, labels: Sequence[str] | None) -> bytes:
    """`line` as parsing reads it: a byte-order mark is cut from a file's first line (and
    only there: elsewhere it is part of the line). Every path that reads or counts lines uses
    this one rule, so a lone BOM is a blank line, not a record, on all of them."""
    if starts_file(offset, labels) and line.startswith(BOM):
        return line[len(BOM) :]
    return line


def cut_bom(lines: list[bytes], offsets: Sequence[int], labels: Sequence[str] | None
            ) -> list[bytes]:
    """`lines` (a chunk's) with `without_bom` applied: only the first can be a file's first
    line. The list itself when nothing is cut."""
    if not lines:
        return lines
    first = without_bom(lines[0], offsets[0], labels)
    return lines if len(first) == len(lines[0]) else [first, *lines[1:]]


def _bad_line_error(chunk: Chunk, index: int, url: str, locate: Locate, what: str):
    line, where = locate(index)
    return CorruptRecordError(
        f"{url}: {where}: {what}; fix or remove the line, "
        "or pass on_error='skip' to skip and count malformed lines",
        url=url,
        line=line,
        offset=chunk.offsets[index],
    )


def describe_bad(raw: bytes, value: Any, err: Exception | None, *, offset: int | None,
                 file_start: bool) -> str:
    """Why line `raw` holds no record: invalid JSON (`err`, with what the file looks like
    when that is recognised) or a JSON value that is not an object (`value`)."""
    if err is None:
        return f"{values.not_a_record(value)}: {values.snippet(raw)}"
    hint = values.explain(raw, err, offset=offset, file_start=file_start)
    return f"invalid JSON ({err}): {values.snippet(raw)}" + (f"; {hint}" if hint else "")


def parse_chunk(
    chunk: Chunk, *, on_error: str, url: str, locate: Locate
) -> tuple[list[Any], bool]:
    """One parsed value (or marker) per line of `chunk`, aligned with `chunk.offsets`, and
    whether the list is free of markers (every line a record).

    Values are exact (`streamds.formats.values`: no integer turned into a float); a line
    that is not a JSON object (a number, an array, null) is malformed too."""
    try:
        lines = chunk.items
        uncut = isinstance(lines, CutLines) and not lines.cut  # read them in place
        items, records = values.loads_many(lines, chunk.data,
                                           lines.ends if uncut else None)
        if records:
            return items, True
    except orjson.JSONDecodeError:
        pass  # some line is blank or malformed: redo the chunk line by line
    items = []
    byte_offsets = chunk.labels is None
    for index, line in enumerate(chunk.items):
        start = starts_file(chunk.offsets[index], chunk.labels)
        line = without_bom(line, chunk.offsets[index], chunk.labels)
        err: Exception | None = None
        try:
            value = values.loads(line)
        except orjson.JSONDecodeError as error:
            if not line.strip():
                items.append(BLANK)
                continue
            value, err = None, error
        if err is None and type(value) is dict:
            items.append(value)
        elif on_error == "skip":
            items.append(BAD)
        else:
            what = describe_bad(line, value, err, file_start=start,
                                offset=chunk.offsets[index] if byte_offsets else None)
            raise _bad_line_error(chunk, index, url, locate, what) from err
    return items, False


class Parse:
    """Stage: chunks of raw lines -> chunks of JSON values, BAD and BLANK markers.

    State: ``{"source": ..., "counts": {"bad": n, "blank": m}}``, counted as chunks pass.
    """

    STAGE = "parse"
    SOURCE = SOURCE
    COUNTS = COUNTS

    def __init__(
        self, source: Any, shards: Sequence[Shard], blocks: Sequence[Block], *,
        on_error: str = "raise", opener: Opener = open_decoded_at,
        where: LineNumbers | None = None,
    ) -> None:
        self.source = source
        self.shards = shards
        self.blocks = blocks
        self.on_error = on_error
        self.opener = opener
        self.where = LineNumbers(shards, blocks, opener) if where is None else where
        self.skipped: Counter[str] = Counter()  # malformed lines per file, in this process
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        if state is not None:
            checked(state, self.STAGE)
        self.source.reset(None if state is None else state[self.SOURCE])
        counts = {"bad": 0, "blank": 0} if state is None else state[self.COUNTS]
        self._bad, self._blank = counts["bad"], counts["blank"]

    def get_state(self) -> dict[str, Any]:
        return {STAGE: self.STAGE, self.SOURCE: self.source.get_state(),
                self.COUNTS: {"bad": self._bad, "blank": self._blank}}

    @property
    def counts(self) -> dict[str, int]:
        return {**self.source.counts, "bad": self._bad, "blank": self._blank}

    def parse(self, chunk: Chunk) -> Chunk:
        """`chunk` with its lines parsed (also used to re-read buffered records)."""
        if not self.shards[self.blocks[chunk.block].shard].format.parses:
            # the format read Python values (a columnar format): nothing to parse
            return Chunk(chunk.work_index, chunk.block, chunk.offsets, chunk.items, True,
                         chunk.labels)
        where = self.where

        def locate(index: int) -> tuple[int | None, str]:
            return where.describe(chunk, index)

        items, clean = parse_chunk(chunk, on_error=self.on_error,
                                   url=where.url(chunk.block), locate=locate)
        return Chunk(chunk.work_index, chunk.block, chunk.offsets, items, clean, chunk.labels)

    def __iter__(self) -> Iterator[Chunk]:
        for raw in self.source:
            if raw.stored:  # a stored block's placeholders (`ds.cache`): nothing to parse
                if not raw.clean:  # its lines without a record, counted as when read
                    bad = raw.items.count(BAD)
                    self._bad += bad
                    self._blank += raw.items.count(BLANK)
                    self.skipped[self.where.url(raw.block)] += bad
                yield raw
                continue
            chunk = self.parse(raw)
            if not chunk.clean:  # the slow path: count (and log) what holds no record
                bad = chunk.items.count(BAD)
                self._bad += bad
                self._blank += chunk.items.count(BLANK)
                if bad:
                    self._warn(raw, chunk)
            yield chunk

    def _warn(self, raw: Chunk, chunk: Chunk) -> None:
        """Log the skipped lines of `chunk`: the first `WARN_BAD_LINES` of each file one by
        one, with their line; the rest are counted in `skipped` for the epoch's summary."""
        url = self.where.url(chunk.block)
        for index, item in enumerate(chunk.items):
            if item is not BAD:
                continue
            self.skipped[url] += 1
            seen = self.skipped[url]
            if seen > WARN_BAD_LINES:
                continue
            offset = raw.offsets[index]
            line = without_bom(raw.items[index], offset, raw.labels)
            byte_offsets = raw.labels is None
            value, err = values.try_loads(line)
            reason = describe_bad(line, value, err,
                                  file_start=starts_file(offset, raw.labels),
                                  offset=offset if byte_offsets else None)
            _, where = self.where.describe(chunk, index)
            more = ""
            if seen == WARN_BAD_LINES:
                more = (f"; further malformed lines of {url} are counted, not logged (the "
                        "reader logs its totals at the end of the epoch; "
                        "streamds.counts_of(loader.state_dict()) sums every reader's)")
            log.warning("skipped a malformed line (on_error='skip'): %s: %s: %s%s",
                        url, where, reason, more)
