"""Columnar files (Parquet, Arrow IPC): what both share.

A columnar file is a run of *groups* (Parquet row groups, Arrow record batches), each holding
a known number of rows; the footer (or, for an Arrow stream, one scan of the message headers)
says how many. Rows are numbered through the file, so a position is (block, row number in the
file), as a tar shard's is (block, record number).

- `Layout`: the groups of one file (rows, and the stored bytes each one's data lies in).
- `row_blocks`: a file's row ranges, one per group, a group split by rows where it is larger
  than `piece` rows (so one file of one group still feeds every reader).
- `checked_schema` / `records_of`: records as pyarrow's `to_pylist()` gives them (lists stay
  lists, nulls are None, int64 exact); a column whose values have no plain Python form
  without a choice is refused, naming the column (see `refusal`).

pyarrow is optional (the ``parquet`` extra): `require_pyarrow` names the extra when it is
missing.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, BinaryIO

from ..errors import CorruptShardError, MissingCodecError
from .protocol import Block, Cursor, FileFacts, Format, LineChunk, Opener, Piece, Settled

__all__ = [
    "EXTRA",
    "FILE_PARTS",
    "MAX_GROUP_PARTS",
    "Columnar",
    "Group",
    "Layout",
    "UnsupportedColumnError",
    "Watched",
    "checked_schema",
    "group_of",
    "records_of",
    "refusal",
    "require_pyarrow",
    "row_blocks",
    "storage_error",
    "watched",
]

EXTRA = "pip install 'streamds[parquet]'"


class UnsupportedColumnError(TypeError):
    """A column whose values have no plain Python form without a choice streamds will not
    make silently (decimal, timestamp with a time zone, nanoseconds)."""


def require_pyarrow(url: str) -> Any:
    """The `pyarrow` module, or MissingCodecError naming the file and the extra to install."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as err:
        raise MissingCodecError(
            f"{url}: reading Parquet and Arrow files needs pyarrow; install it with "
            "pip install 'streamds[parquet]'"
        ) from err
    return pyarrow


@dataclass(frozen=True)
class Group:
    """One row group (Parquet) or record batch (Arrow): its rows, and the stored bytes
    [start, end) its data lies in (None when the file does not say: read it whole), and
    where each column's part of them lies, as (column, start, end), where the file says
    (a Parquet column chunk; a nested column has one per leaf)."""

    rows: int
    start: int | None = None
    end: int | None = None
    chunks: tuple[tuple[str, int, int], ...] = ()

    def span_of(self, columns: Sequence[str] | None) -> tuple[int | None, int | None]:
        """The stored bytes the data of `columns` (None: all) lies in: from the first of
        their chunks to the end of the last (the chunks of columns between are fetched
        with them: one request, not one per column)."""
        if columns is None or not self.chunks:
            return self.start, self.end
        picked = [(start, end) for name, start, end in self.chunks if name in columns]
        if not picked:
            return self.start, self.end
        return min(start for start, _ in picked), max(end for _, end in picked)


@dataclass(frozen=True)
class Layout:
    """The groups of one columnar file, in file order, and its column names."""

    groups: tuple[Group, ...]
    columns: tuple[str, ...]
    stream: bool = False  # an Arrow stream: no footer, groups are read in order
    counted: bool = True  # False: rows unknown until read (a remote Arrow stream: no footer
    # to say them, and counting would download it), so the file is one block, as a gzip
    # file is, and `groups` is empty

    @property
    def rows(self) -> int:
        return sum(group.rows for group in self.groups)

    def first_rows(self) -> list[int]:
        """The file row number each group starts at, and the file's row count last."""
        firsts = [0]
        for group in self.groups:
            firsts.append(firsts[-1] + group.rows)
        return firsts


def group_of(layout: Layout, row: int) -> int:
    """The group holding file row `row` (the last group for the row count itself)."""
    first = 0
    for index, group in enumerate(layout.groups):
        if row < first + group.rows:
            return index
        first += group.rows
    return max(0, len(layout.groups) - 1)


def row_blocks(layout: Layout, piece: int) -> list[tuple[int, int]]:
    """The file's blocks as row ranges [start, end), in file order.

    A group is one block, or, when it holds more than `piece` rows, ceil(rows / piece) equal
    row ranges; a block never spans two groups (each reads its group's column chunks only).
    A file without rows is one empty block, so every file has a block.
    """
    if piece < 1:
        raise ValueError(f"piece must be >= 1 row, got {piece}")
    blocks: list[tuple[int, int]] = []
    first = 0
    for group in layout.groups:
        parts = max(1, math.ceil(group.rows / piece))
        cuts = [first + group.rows * k // parts for k in range(parts + 1)]
        blocks.extend((a, b) for a, b in pairwise(cuts) if b > a)
        first += group.rows
    return blocks or [(0, 0)]


def refusal(field: Any, pa: Any) -> str | None:
    """Why a column's values cannot become plain Python values without a choice, or None.

    The rule (the reading docs' table): integers, floats (NaN stays NaN), booleans, strings,
    dates, times and timestamps in up to microseconds without a zone, lists, structs and maps
    become what `to_pylist()` gives; binary becomes `bytes`. Refused: decimal (Decimal or
    float would be a choice), a timestamp with a time zone (which zone to give it back in is a
    choice), nanosecond times and durations (Python's datetime holds microseconds).
    """
    types = pa.types
    kind = field.type if hasattr(field, "type") else field
    if types.is_decimal(kind):
        return (f"decimal ({kind}): a Decimal or a float would be a choice; cast the column "
                "to string or float64 where the file is written")
    if types.is_timestamp(kind) and kind.tz is not None:
        return (f"a timestamp with time zone {kind.tz!r}: store it as UTC without a zone "
                "(or as a string) where the file is written")
    if (types.is_timestamp(kind) or types.is_time(kind) or types.is_duration(kind)) and (
        kind.unit == "ns"
    ):
        return (f"{kind} in nanoseconds: Python's datetime holds microseconds; cast it to "
                "microseconds (or int64) where the file is written")
    if types.is_dictionary(kind):
        return refusal(kind.value_type, pa)
    if types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind):
        return refusal(kind.value_type, pa)
    if types.is_map(kind):
        return refusal(kind.key_type, pa) or refusal(kind.item_type, pa)
    if types.is_struct(kind):
        for index in range(kind.num_fields):
            why = refusal(kind.field(index), pa)
            if why is not None:
                return f"field {kind.field(index).name!r}: {why}"
    return None


def checked_schema(schema: Any, columns: Sequence[str] | None, url: str, pa: Any) -> list[str]:
    """The names of the columns to read (all, or `columns` in file order), refused by name
    when one is missing or has no plain Python form (`refusal`)."""
    names = list(schema.names)
    if columns is not None:
        missing = [name for name in columns if name not in names]
        if missing:
            raise KeyError(
                f"{url}: no column {missing[0]!r}; its columns are {names}; fix columns=[...]"
            )
        names = [name for name in names if name in set(columns)]
    for name in names:
        why = refusal(schema.field(name), pa)
        if why is not None:
            raise UnsupportedColumnError(
                f"{url}: column {name!r} is {why}; or leave it out with columns=[...]"
            )
    return names


def records_of(batch: Any) -> list[dict[str, Any]]:
    """The rows of a record batch as dicts, by `to_pylist()`."""
    return batch.to_pylist()


class Watched(io.RawIOBase):
    """A file object handed to pyarrow that remembers the storage's own errors.

    pyarrow raises a plain OSError both for damaged data and for an OSError of the file
    object under it, so the reader cannot tell a dropped connection (retried) from a bad page
    (damage) by the type alone; `failed` holds the last error the storage raised.
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.failed: BaseException | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._watch(self._raw.seek, offset, whence)

    def read(self, size: int = -1) -> bytes:  # type: ignore[override]
        """`size` bytes, fewer only at the end: a stored file may answer a read short (a
        stream read over HTTP), and pyarrow takes a short read for the file's end."""
        data = self._watch(self._raw.read, size)
        if size is None or size < 0 or len(data) >= size or not data:
            return data
        parts = [data]
        while (got := sum(map(len, parts))) < size:
            more = self._watch(self._raw.read, size - got)
            if not more:
                break
            parts.append(more)
        return b"".join(parts)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _watch(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as err:
            self.failed = err
            raise


def watched(file: Any) -> Any:
    """`file` as `Watched`, unless it is pyarrow's own (a memory map: no Python in between)."""
    return file if hasattr(file, "get_stream") or isinstance(file, Watched) else Watched(file)


def storage_error(err: BaseException, file: Any) -> bool:
    """Whether `err`, raised by pyarrow reading `file`, is the storage's (re-raise it: the
    reader retries what is transient) rather than damage in the file."""
    failed = getattr(file, "failed", None) is not None
    return failed and isinstance(err, OSError) and not isinstance(err, CorruptShardError)


FILE_PARTS = 64  # a file is cut into this many row ranges at least, as a text file is (the
# plan's SPLITS_PER_FILE), so one file feeds many readers ...
MAX_GROUP_PARTS = 8  # ... but one row group into this many at most: a range decodes the
# rows of its row group before it too (Parquet has no row seek), so each reader owning a part
# of a row group decodes it from its first row to the end of its part: 8 feeds 8 readers from
# a file of one row group, with fewer readers sharing each row group than 16 would


class Columnar(Format):
    """What Parquet and Arrow share as shard formats (`streamds.formats.registry`): files
    settle to a `Layout` read from the footer, blocks are row ranges inside one group,
    positions are file row numbers, records are Python values (nothing to parse), and a
    block's record count is its row count."""

    parses = False
    splits = True

    def layout_of(self, file: BinaryIO, url: str) -> Layout:
        raise NotImplementedError

    def rows_of(self, file: BinaryIO, shard: Any, start: int, end: int
                ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        raise NotImplementedError

    def rows_from(self, file: BinaryIO, shard: Any, first: int
                  ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """(file row number of the first, records) for every row from `first` to the file's
        end, in file order, group by group (`streamds convert` reads whole files so)."""
        firsts = shard.layout.first_rows()
        for group in range(group_of(shard.layout, first), len(shard.layout.groups)):
            start, end = max(first, firsts[group]), firsts[group + 1]
            if start < end:
                yield from self.rows_of(file, shard, start, end)

    def settle(self, facts: FileFacts) -> Settled:
        self.refuse_codec(facts)
        layout = facts.read(lambda file: self.layout_of(file, facts.url), "footer")
        return Settled(self, layout=layout)

    def refuse_codec(self, facts: FileFacts) -> None:
        """Refuse a file compressed as a whole (after checking pyarrow is there)."""
        require_pyarrow(facts.url)
        if facts.codec is not None:
            raise ValueError(
                f"{facts.url}: a {self.name} file compressed as a whole ({facts.codec}) cannot "
                f"be read by row group; decompress it (its pages are compressed already)")

    def split_size(self, shard: Any) -> int:
        return (shard.size or 0) if shard.layout.counted else 0

    def blocks(self, index: int, shard: Any, piece: Piece) -> list[Block]:
        """Row ranges of `piece(size)` stored bytes' worth of rows, or of a FILE_PARTS-th of
        the file where that is fewer rows; a row group is cut into MAX_GROUP_PARTS ranges at
        most."""
        layout: Layout = shard.layout
        if not layout.counted:
            return [Block(index)]
        size = shard.size or 0
        by_bytes = math.ceil(layout.rows * piece(size) / size) if size else 1
        rows_piece = max(1, min(by_bytes, math.ceil(layout.rows / FILE_PARTS)))
        widest = max((group.rows for group in layout.groups), default=1)
        rows_piece = max(rows_piece, math.ceil(widest / MAX_GROUP_PARTS))
        ranges = row_blocks(layout, rows_piece)
        # the last runs to the end of the file (the protocol's tiling)
        return [Block(index, start, end if k < len(ranges) - 1 else None)
                for k, (start, end) in enumerate(ranges)]

    def listed_records(self, shard: Any, block: Block) -> int | None:
        if not shard.layout.counted:
            return None
        return (shard.layout.rows if block.end is None else block.end) - block.start

    def read_range(self, shard: Any, start: int, end: int | None, *, at_line: bool
                   ) -> tuple[int, int | None]:
        """The stored bytes of the row group holding row `start`, of the columns read only
        (`Group.span_of`; the footer is read apart, once per process); the whole file where
        the layout does not say."""
        layout: Layout = shard.layout
        if not layout.groups:
            return 0, None
        first, last = layout.groups[group_of(layout, start)].span_of(shard.columns)
        return (0, None) if first is None else (first, last)

    def read_block(self, opener: Opener, shard: Any, block: Block, block_id: int,
                   cursor: Cursor, read_size: int) -> Iterator[LineChunk]:
        """Records of rows [start, end) of the file, a chunk per batch; offsets are file row
        numbers, labels name the row group (record batch). A file whose rows are not counted
        is read from `first` to its end in one pass."""
        first = block.start if cursor.next_line is None else cursor.next_line
        counted = shard.layout.counted
        end = shard.layout.rows if block.end is None and counted else block.end
        cursor.next_line = first
        label = (f"{self.group_word} {group_of(shard.layout, first)}" if counted
                 else f"a {self.group_word} from row {first}")
        for row, records in self.block_rows(opener, shard, first, end):
            cursor.next_line = row + len(records)
            yield LineChunk(block_id, list(range(row, row + len(records) + 1)), records,
                            [label] * len(records))

    def block_rows(self, opener: Opener, shard: Any, first: int, end: int | None
                   ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """(file row number of the first, records) for rows [first, end) (None: to the
        file's end), read through `opener` on a file opened for this block alone."""
        with closing(opener(shard, 0, None)) as stored:
            yield from (self.rows_of(stored, shard, first, end) if end is not None
                        else self.rows_from(stored, shard, first))

    group_word = "row group"

    def place(self, url: str, position: int) -> str | None:
        return f"{url}: row {position} of the file"
