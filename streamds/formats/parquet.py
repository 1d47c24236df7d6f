"""Parquet files: the footer -> a `Layout` of row groups; rows [start, end) -> records.

A block is a row range inside one row group (`columnar.row_blocks`). Reading one opens the
file through the storage layer's file object (ranged reads, read-ahead, the shard cache),
takes the footer (kept per process, keyed by the file's identity, so a reader of many blocks
of one file reads it once), and decodes only that row group's chunks of the columns asked
for, forward in batches of BATCH_ROWS rows (`GroupRows`), each column chunk read in pieces
of READ_PIECE bytes. Parquet's reader has no row seek: a range decodes the rows of its row
group before it too. So a reader keeps the row group open past its block
(`read_rows_through`), and its next range of that row group, which the plan deals it next
(`Format.shared_decoding`), continues where the last stopped: a row group is decoded once,
up to the last row the reader owns, and memory holds a batch, not the row group.

A file pyarrow cannot read (no footer, a damaged page) raises `CorruptShardError` naming the
file and the row group.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO, NamedTuple

from ..errors import CorruptShardError
from .columnar import (
    Columnar,
    Group,
    Layout,
    checked_schema,
    group_of,
    records_of,
    require_pyarrow,
    storage_error,
    watched,
)
from .protocol import Block, Opener

__all__ = ["BATCH_ROWS", "FORMAT", "MAGIC", "MAX_OPEN", "READ_PIECE", "GroupRows", "Parquet",
           "close_open_row_groups", "layout", "open_row_groups", "read_rows",
           "read_rows_through"]

MAGIC = b"PAR1"  # at the start and the end of every Parquet file
BATCH_ROWS = 1024  # rows decoded and converted to records at a time
READ_PIECE = 4 << 20  # bytes of a column chunk pyarrow reads at a time (pyarrow's default
# reads all of a row group's chunks at once, through Python's file object: a buffer of the
# row group's stored size, fresh memory each time, copied piece by piece; the storage asks
# for 4 MiB at a time too, `ranges.DIRECT_REQUEST`) ...
STREAMED_COLUMNS = 16  # ... for files of up to this many columns read: more columns read in
# pieces would each be a request of their own
_FOOTERS: OrderedDict[Any, Any] = OrderedDict()  # file identity -> FileMetaData
_FOOTERS_GROUP = 64


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _damaged(url: str, where: str, err: Exception, offset: int = 0) -> CorruptShardError:
    return CorruptShardError(
        f"{url}: damaged Parquet file ({where}): {_one_line(err)}; copy or write the file "
        "again, or pass on_error='skip' to skip the damaged block",
        url=url,
        offset=offset,
    )


def _metadata(file: BinaryIO, url: str, key: Any) -> Any:
    """The file's footer (FileMetaData), read once per `key` in this process."""
    if key is not None and key in _FOOTERS:
        _FOOTERS.move_to_end(key)
        return _FOOTERS[key]
    pq = require_pyarrow(url).parquet
    try:
        metadata = pq.read_metadata(file)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        if storage_error(err, file):
            raise
        raise _damaged(url, "footer", err) from err
    if key is not None:
        _FOOTERS[key] = metadata
        while len(_FOOTERS) > _FOOTERS_GROUP:
            _FOOTERS.popitem(last=False)
    return metadata


def _leaves(kind: Any, pa: Any) -> int:
    """Parquet leaf columns (column chunks) of a value of Arrow type `kind`."""
    types = pa.types
    if types.is_struct(kind):
        return sum(_leaves(kind.field(index).type, pa) for index in range(kind.num_fields))
    if types.is_map(kind):
        return _leaves(kind.key_type, pa) + _leaves(kind.item_type, pa)
    if types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind):
        return _leaves(kind.value_type, pa)
    return 1


def _owners(schema: Any, pa: Any) -> list[str]:
    """The top-level column each leaf column belongs to, in the file's leaf order (depth
    first, as Parquet lays them out); a dotted leaf path cannot say it where names hold
    dots."""
    return [field.name for field in schema for _ in range(_leaves(field.type, pa))]


def _chunks(row_group: Any, owners: list[str]) -> tuple[tuple[str, int, int], ...]:
    """(top-level column, start, end) of each of the row group's column chunks: the stored
    bytes each lies in; the column "" where the leaves do not match `owners` (no column is
    then fetched alone: the group's whole span is)."""
    if row_group.num_columns != len(owners):
        owners = [""] * row_group.num_columns
    chunks = []
    for index, owner in enumerate(owners):
        column = row_group.column(index)
        first = column.data_page_offset
        if column.has_dictionary_page and column.dictionary_page_offset:
            first = min(first, column.dictionary_page_offset)
        chunks.append((owner, first, first + column.total_compressed_size))
    return tuple(chunks)


def layout(file: BinaryIO, url: str, key: Any = None) -> Layout:
    """The row groups of a Parquet file, from its footer (two reads at the file's end)."""
    file = watched(file)
    metadata = _metadata(file, url, key)
    schema = metadata.schema.to_arrow_schema()
    owners = _owners(schema, require_pyarrow(url))
    groups = []
    for index in range(metadata.num_row_groups):
        row_group = metadata.row_group(index)
        chunks = _chunks(row_group, owners)
        if chunks:
            groups.append(Group(row_group.num_rows, min(start for _, start, _ in chunks),
                                max(end for _, _, end in chunks), chunks))
        else:
            groups.append(Group(row_group.num_rows))
    return Layout(tuple(groups), tuple(schema.names))


class GroupRows:
    """The rows of one row group, decoded forward in batches of `batch_rows`, from its first.

    `take(start, stop)` hands out rows from `start` (at or past the rows handed out so far:
    `row`) on, decoding only as far as asked; the rows of the last batch past `stop` are
    kept for the next call. A reader taking the row ranges of a row group in file order thus
    decodes it once, and only up to the last row it owns (Parquet has no row seek: a range
    further on decodes the rows before it). pyarrow reads each column chunk in pieces of
    `piece` bytes (none: the row group's chunks at once, pyarrow's default), so memory holds a
    batch and a piece per column, not the row group.
    """

    def __init__(self, file: Any, metadata: Any, group: int, first: int, names: list[str],
                 batch_rows: int, piece: int | None, pa: Any) -> None:
        self.file = file
        self.group = group
        self.row = first  # file row number of the first row not handed out
        self.end = first + metadata.row_group(group).num_rows
        reader = pa.parquet.ParquetFile(file, metadata=metadata, buffer_size=piece or 0,
                                        pre_buffer=piece is None)
        self._batches = reader.iter_batches(batch_size=batch_rows, row_groups=[group],
                                            columns=names, use_threads=False)
        self._held: Any = None  # decoded rows from `row` on, not handed out yet

    def take(self, start: int, stop: int) -> Any:
        """File rows [start, stop) as a record batch, or fewer (up to the end of a decoded
        batch; at least one): `row` <= `start` < `stop` <= `end`. ValueError where the row
        group holds fewer rows than its footer says."""
        while self._held is None or self.row + self._held.num_rows <= start:
            if self._held is not None:  # rows before `start`: decoded, not handed out
                self.row += self._held.num_rows
            self._held = next(self._batches, None)
            if self._held is None:
                raise ValueError(f"it ends at row {self.row}, its footer says {self.end}")
            if self._held.num_rows == 0:
                self._held = None
        held, self._held = self._held.slice(start - self.row), None
        count = min(stop - start, held.num_rows)
        if count < held.num_rows:
            self._held = held.slice(count)
        self.row = start + count
        return held.slice(0, count)


def stream_piece(columns: int) -> int | None:
    """Bytes pyarrow reads of a column chunk at a time (`GroupRows`): READ_PIECE, or None
    (the row group's chunks in one read, as pyarrow does by default) for a file of more than
    STREAMED_COLUMNS columns read, whose pieces would each be a read of its own."""
    return READ_PIECE if columns <= STREAMED_COLUMNS else None


def _group_at(metadata: Any, row: int, url: str) -> tuple[int, int]:
    """(row group holding file row `row`, the file row number it starts at)."""
    first = 0
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group).num_rows
        if row < first + rows:
            return group, first
        first += rows
    raise CorruptShardError(
        f"{url}: the file has {first} rows, row {row} was planned; the file changed "
        "since the dataset was built: build it again",
        url=url, offset=row,
    )


def read_rows(
    file: BinaryIO, url: str, start: int, end: int, *, columns: Sequence[str] | None = None,
    key: Any = None, batch_rows: int | None = None,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(file row number of the first, records) for file rows [start, end), reading only the
    chunks of `columns` (None: all) of the row groups they lie in, in one pass over `file`,
    `batch_rows` rows at a time (None: BATCH_ROWS)."""
    pa = require_pyarrow(url)
    batch_rows = batch_rows or BATCH_ROWS
    file = watched(file)
    metadata = _metadata(file, url, key)
    names = checked_schema(metadata.schema.to_arrow_schema(), columns, url, pa)
    rows: GroupRows | None = None
    at = start
    while at < end:
        try:
            if rows is None or at >= rows.end:
                group, first = _group_at(metadata, at, url)
                rows = GroupRows(file, metadata, group, first, names, batch_rows,
                                 stream_piece(len(names)), pa)
            part = rows.take(at, min(end, rows.end))
        except (OSError, ValueError) as err:
            where = "row group" if rows is None else f"row group {rows.group}"
            raise _failed(err, file, url, at, where) from err
        yield at, records_of(part)
        at += part.num_rows


def _failed(err: Exception, file: Any, url: str, row: int, where: str) -> BaseException:
    """What to raise for `err`, raised by pyarrow reading `file` at file row `row`: the
    storage's own error (the reader retries what is transient), else a damaged file."""
    if storage_error(err, file) or isinstance(err, CorruptShardError):
        return err
    return _damaged(url, where, err, offset=row)


class _Open(NamedTuple):
    """A row group a reader left open (`read_rows_through`)."""

    owner: Any  # the reader's opener: rows are continued only through the same one
    key: Any  # the file's identity
    columns: tuple[str, ...] | None
    rows: GroupRows


_LOCAL = threading.local()  # each thread's open row groups: a reader reads in one thread,
# and a thread letting its oldest go never closes one that another thread is reading
MAX_OPEN = 4  # row groups kept open per thread: a reader reads one at a time; a `Mix` of
# Parquet corpora reads one per corpus in turn


def open_row_groups() -> list[_Open]:
    """The row groups this thread keeps open for its readers to continue, newest last;
    emptied in a forked process (a DataLoader worker: the files, connections and read-ahead
    left open are its parent's)."""
    if getattr(_LOCAL, "pid", None) != os.getpid():
        _LOCAL.entries, _LOCAL.pid = [], os.getpid()
    return _LOCAL.entries


def close_open_row_groups() -> None:
    """Close the row groups this thread keeps open for readers to continue
    (`read_rows_through`)."""
    entries = open_row_groups()
    while entries:
        _let_go(entries[0])


def _let_go(entry: _Open) -> None:
    entries = open_row_groups()
    if entry in entries:
        entries.remove(entry)
    with contextlib.suppress(Exception):  # nothing is read from a file being let go
        entry.rows.file.close()


def read_rows_through(
    opener: Callable[[], BinaryIO], url: str, start: int, end: int, *, owner: Any,
    columns: tuple[str, ...] | None = None, key: Any = None, batch_rows: int | None = None,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """`read_rows` for a reader that reads its blocks (row ranges) one after another: a row
    group stays open (`GroupRows`) past the block, so the next block of it, starting where
    this one stopped, continues decoding instead of decoding the row group again from its
    first row. `owner` (the reader's opener) names the storage read through: a row group is
    continued only by the same owner, and only forward; anything else opens it afresh
    (`opener()`). A row group read to its end, or that raised, is closed at once; at most
    MAX_OPEN stay open.
    """
    pa = require_pyarrow(url)
    batch_rows = batch_rows or BATCH_ROWS
    at = start
    while at < end:
        entry = _open_at(opener, url, at, owner, columns, key, batch_rows, pa)
        rows = entry.rows
        try:
            part = rows.take(at, min(end, rows.end))
        except BaseException as err:  # its place in the row group is unknown now
            _let_go(entry)
            if isinstance(err, (OSError, ValueError)):
                raise _failed(err, rows.file, url, at, f"row group {rows.group}") from err
            raise
        if rows.row >= rows.end:  # read to its end: nothing will continue it
            _let_go(entry)
        yield at, records_of(part)
        at += part.num_rows


def _open_at(opener: Callable[[], BinaryIO], url: str, row: int, owner: Any,
             columns: tuple[str, ...] | None, key: Any, batch_rows: int, pa: Any) -> _Open:
    """The open row group of `owner` that file row `row` continues (made the newest), or the
    row group holding it, opened through `opener` (the oldest let go past MAX_OPEN)."""
    entries = open_row_groups()
    for entry in entries:
        if (entry.owner is owner and entry.key == key and entry.columns == columns
                and entry.rows.row <= row < entry.rows.end):
            entries.remove(entry)
            entries.append(entry)
            return entry
    file = watched(opener())
    try:
        metadata = _metadata(file, url, key)
        names = checked_schema(metadata.schema.to_arrow_schema(), columns, url, pa)
        group, first = _group_at(metadata, row, url)
        rows = GroupRows(file, metadata, group, first, names, batch_rows,
                         stream_piece(len(names)), pa)
    except BaseException as err:
        with contextlib.suppress(Exception):
            file.close()
        if isinstance(err, (OSError, ValueError)):
            raise _failed(err, file, url, row, "row group") from err
        raise
    for stale in [entry for entry in entries if entry.owner is owner and entry.key == key
                  and entry.columns == columns and entry.rows.group == group]:
        _let_go(stale)  # past `row` already: this one decodes it again from its first row
    entries.append(_Open(owner, key, columns, rows))
    while len(entries) > MAX_OPEN:
        _let_go(entries[0])
    return entries[-1]


class Parquet(Columnar):
    """Parquet files (``.parquet``, ``.pq``): blocks are row ranges of row groups."""

    name = "parquet"
    suffixes = (".parquet", ".pq")
    summary = "Parquet: row groups, read by row ranges"
    group_word = "row group"
    shared_decoding = True  # a range decodes its row group's rows before it too

    def decode_unit(self, shard: Any, block: Block) -> int | None:
        layout: Layout | None = shard.layout
        return group_of(layout, block.start) if layout and layout.groups else None

    def layout_of(self, file: BinaryIO, url: str) -> Layout:
        return layout(file, url)

    def rows_of(self, file: BinaryIO, shard: Any, start: int, end: int
                ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        return read_rows(file, shard.url, start, end, columns=shard.columns,
                         key=_identity(shard))

    def block_rows(self, opener: Opener, shard: Any, first: int, end: int | None
                   ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """Rows [first, end) through `read_rows_through`: the row group stays open for the
        reader's next block of it."""
        if end is None:  # a file whose rows are not counted (never a Parquet file: its
            return super().block_rows(opener, shard, first, end)  # footer counts them)
        return read_rows_through(lambda: opener(shard, 0, None), shard.url, first, end,
                                 owner=opener, columns=shard.columns, key=_identity(shard))


def _identity(shard: Any) -> tuple[Any, ...]:
    return (shard.path, shard.size, shard.version)


FORMAT = Parquet()
