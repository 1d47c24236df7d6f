"""Parquet files: the footer -> a `Layout` of row groups; rows [start, end) -> records.

A block is a row range inside one row group (`columnar.row_blocks`). Reading one opens the
file through the storage layer's file object (ranged reads, read-ahead, the shard cache),
takes the footer (kept per process, keyed by the file's identity, so a reader of many blocks
of one file reads it once), and reads only that row group's chunks of the columns asked for,
in batches of BATCH_ROWS rows. A row range of a row group cut into several decodes the whole
row group (Parquet's reader has no row seek) and keeps it, the last one per process, so a
reader owning several ranges of it decodes it once; memory stays one row group.

A file pyarrow cannot read (no footer, a damaged page) raises `CorruptShardError` naming the
file and the row group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

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
from .protocol import Block

__all__ = ["BATCH_ROWS", "FORMAT", "MAGIC", "Parquet", "layout", "read_rows"]

MAGIC = b"PAR1"  # at the start and the end of every Parquet file
BATCH_ROWS = 1024  # rows converted to records at a time: memory stays one row group's
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


def _span(row_group: Any) -> tuple[int, int]:
    """The stored bytes [start, end) the row group's column chunks lie in."""
    starts, ends = [], []
    for index in range(row_group.num_columns):
        column = row_group.column(index)
        first = column.data_page_offset
        if column.has_dictionary_page and column.dictionary_page_offset:
            first = min(first, column.dictionary_page_offset)
        starts.append(first)
        ends.append(first + column.total_compressed_size)
    return min(starts), max(ends)


def layout(file: BinaryIO, url: str, key: Any = None) -> Layout:
    """The row groups of a Parquet file, from its footer (two reads at the file's end)."""
    file = watched(file)
    metadata = _metadata(file, url, key)
    groups = []
    for index in range(metadata.num_row_groups):
        row_group = metadata.row_group(index)
        start, end = _span(row_group) if row_group.num_columns else (None, None)
        groups.append(Group(row_group.num_rows, start, end))
    return Layout(tuple(groups), tuple(metadata.schema.to_arrow_schema().names))


def read_rows(
    file: BinaryIO, url: str, start: int, end: int, *, columns: Sequence[str] | None = None,
    key: Any = None, batch_rows: int = BATCH_ROWS,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(file row number of the first, records) for file rows [start, end), which lie in one
    row group, reading only that row group's chunks of `columns` (None: all)."""
    pa = require_pyarrow(url)
    file = watched(file)
    metadata = _metadata(file, url, key)
    names = checked_schema(metadata.schema.to_arrow_schema(), columns, url, pa)
    first = 0
    group = 0
    while group < metadata.num_row_groups and first + metadata.row_group(group).num_rows <= start:
        first += metadata.row_group(group).num_rows
        group += 1
    if start >= end:
        return
    if group >= metadata.num_row_groups:
        raise CorruptShardError(
            f"{url}: the file has {first} rows, row {start} was planned; the file changed "
            "since the dataset was built: build it again",
            url=url, offset=start,
        )
    rows = metadata.row_group(group).num_rows
    try:
        if (start, end) != (first, first + rows):  # a row range: slices of the decoded group
            decoded = _decoded_group(lambda: pa.parquet.ParquetFile(file, metadata=metadata),
                                     (key, group, tuple(names)), group, names)
            if decoded.num_rows < end - first:
                raise ValueError(f"it holds {decoded.num_rows} rows, its footer says {rows}")
            for at in range(start, end, batch_rows):
                part = decoded.slice(at - first, min(batch_rows, end - at))
                yield at, records_of(part)
            return
        reader = pa.parquet.ParquetFile(file, metadata=metadata)
        batches = reader.iter_batches(batch_size=batch_rows, row_groups=[group], columns=names,
                                      use_threads=False)
        row = first
        for batch in batches:
            batch_end = row + batch.num_rows
            if batch_end > start:
                lo, hi = max(start, row) - row, min(end, batch_end) - row
                yield row + lo, records_of(batch.slice(lo, hi - lo))
            row = batch_end
            if row >= end:
                return
    except (OSError, ValueError) as err:
        if storage_error(err, file):
            raise
        raise _damaged(url, f"row group {group}", err, offset=start) from err
    if row < end:
        raise _damaged(url, f"row group {group}",
                       ValueError(f"it ends at row {row}, its footer says {end}"), offset=row)


_GROUP: list[Any] = [None, None]  # (key, group, columns) and its table: the last row group cut
# into row ranges that this process decoded


def _decoded_group(open_reader: Any, which: Any, group: int, names: list[str]) -> Any:
    """Row group `group`'s `names` columns, decoded; the last one is kept, so a reader that
    owns several row ranges of it decodes it once (memory: one row group), and opens no
    `ParquetFile` for the others (`open_reader` is called on a miss only)."""
    if which[0] is None or _GROUP[0] != which:
        _GROUP[:] = [None, None]  # let the last go before decoding the next
        table = open_reader().read_row_group(group, columns=names, use_threads=False)
        _GROUP[:] = [which, table]
    return _GROUP[1]


class Parquet(Columnar):
    """Parquet files (``.parquet``, ``.pq``): blocks are row ranges of row groups."""

    name = "parquet"
    suffixes = (".parquet", ".pq")
    summary = "Parquet: row groups, read by row ranges"
    group_word = "row group"
    shared_decoding = True  # a row group decodes whole, whichever of its ranges is read

    def decode_unit(self, shard: Any, block: Block) -> int | None:
        layout: Layout | None = shard.layout
        return group_of(layout, block.start) if layout and layout.groups else None

    def layout_of(self, file: BinaryIO, url: str) -> Layout:
        return layout(file, url)

    def rows_of(self, file: BinaryIO, shard: Any, start: int, end: int
                ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        return read_rows(file, shard.url, start, end, columns=shard.columns,
                         key=(shard.path, shard.size, shard.version))


FORMAT = Parquet()
