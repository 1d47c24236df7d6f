"""Arrow IPC files (``.arrow``): record batches -> a `Layout`; rows [start, end) -> records.

Both IPC formats are read: the file format (``ARROW1`` magic, a footer that locates each
record batch) and the stream format (what `datasets`' ``save_to_disk`` and its cache write:
batches one after another, no footer). Row counts live in each batch's message. The file format's
footer lists its batches, so its layout costs a footer read. A stream has no footer: a local
one is counted by one pass over its messages (a disk read), a remote one is not counted (that
would download it) but settled from its first bytes (the schema message: column names), and
planned as one block that one reader reads and counts as it goes, as a gzip file is; it has
no len(). A block of the file format reads its batch alone; a block of the stream format
reads the messages before it too (the stream has no index).
Records are what `to_pylist()` gives, by the rule of `columnar.refusal`.
"""

from __future__ import annotations

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
from .protocol import FileFacts, Settled

__all__ = ["BATCH_ROWS", "FILE_MAGIC", "FORMAT", "Arrow", "layout", "read_from", "read_rows",
           "stream_head"]

FILE_MAGIC = b"ARROW1"  # the file format starts (and ends) with it; a stream does not
BATCH_ROWS = 1024  # rows of a record batch converted to records at a time (`read_from`)


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _damaged(url: str, where: str, err: Exception, offset: int = 0) -> CorruptShardError:
    return CorruptShardError(
        f"{url}: damaged Arrow IPC file ({where}): {_one_line(err)}; copy or write the file "
        "again, or pass on_error='skip' to skip the damaged block",
        url=url,
        offset=offset,
    )


def _open(file: BinaryIO, url: str) -> tuple[Any, bool]:
    """(reader, is a stream) for `file`, positioned at its start."""
    pa = require_pyarrow(url)
    file.seek(0)
    is_file = file.read(len(FILE_MAGIC)) == FILE_MAGIC
    file.seek(0)
    try:
        if is_file:
            return pa.ipc.open_file(file), False
        return pa.ipc.open_stream(file), True
    except (OSError, ValueError) as err:
        if storage_error(err, file):
            raise
        raise _damaged(url, "header" if not is_file else "footer", err) from err


def _batches(reader: Any, stream: bool) -> Iterator[Any]:
    if stream:
        yield from reader
    else:
        for index in range(reader.num_record_batches):
            yield reader.get_batch(index)


def stream_head(read_exact: Any, url: str) -> Layout | None:
    """The uncounted layout of a stream from its schema message, read by `read_exact(start,
    end)` (two small reads, no record batch), or None where the file is in the file format
    (its footer says more)."""
    pa = require_pyarrow(url)
    first = read_exact(0, 8)
    if first[: len(FILE_MAGIC)] == FILE_MAGIC:
        return None
    if len(first) < 8:
        raise _damaged(url, "header", ValueError(f"it holds {len(first)} bytes"))
    # a message: 0xFFFFFFFF, then its metadata's length (older streams: the length alone)
    size = int.from_bytes(first[4:8] if first[:4] == b"\xff" * 4 else first[:4], "little",
                          signed=True)
    start = 8 if first[:4] == b"\xff" * 4 else 4
    try:
        schema = pa.ipc.open_stream(pa.BufferReader(read_exact(0, start + size))).schema
    except (OSError, ValueError) as err:
        raise _damaged(url, "header", err) from err
    return Layout((), tuple(schema.names), stream=True, counted=False)


def layout(file: BinaryIO, url: str) -> Layout:
    """The record batches of an Arrow IPC file (one pass over its messages)."""
    file = watched(file)
    reader, stream = _open(file, url)
    groups = []
    try:
        for batch in _batches(reader, stream):
            groups.append(Group(batch.num_rows))
    except (OSError, ValueError) as err:
        if storage_error(err, file):
            raise
        raise _damaged(url, f"record batch {len(groups)}", err) from err
    return Layout(tuple(groups), tuple(reader.schema.names), stream=stream)


def read_rows(
    file: BinaryIO, url: str, start: int, end: int, *, columns: Sequence[str] | None = None,
    key: Any = None, planned: Layout | None = None,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(file row number of the first, records) for file rows [start, end), which lie in one
    record batch; only `columns` (None: all) become records. `planned`: the file's layout
    (the file format then reads that batch alone)."""
    if start >= end:
        return
    pa = require_pyarrow(url)
    file = watched(file)
    reader, stream = _open(file, url)
    names = checked_schema(reader.schema, columns, url, pa)
    row, index, found = 0, 0, None
    try:
        if stream or planned is None:
            for batch in _batches(reader, stream):
                if row + batch.num_rows > start:
                    found = batch
                    break
                row += batch.num_rows
                index += 1
        else:
            index = group_of(planned, start)
            row = planned.first_rows()[index]
            if index < reader.num_record_batches:
                found = reader.get_batch(index)
    except (OSError, ValueError) as err:
        if storage_error(err, file):
            raise
        raise _damaged(url, f"record batch {index}", err, offset=row) from err
    if found is None or row + found.num_rows < end:
        raise CorruptShardError(
            f"{url}: rows {start}-{end} were planned in record batch {index}, the file holds "
            "fewer; the file changed since the dataset was built: build it again",
            url=url, offset=start,
        )
    batch = found.select(names) if names != list(found.schema.names) else found
    yield start, records_of(batch.slice(start - row, end - start))


def read_from(
    file: BinaryIO, url: str, first: int, *, columns: Sequence[str] | None = None,
    batch_rows: int = BATCH_ROWS,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(file row number of the first, records) for every row from `first` to the file's
    end, in one pass over its record batches (a stream has no index: reading it batch by
    batch with `read_rows` would read the messages before each batch again)."""
    pa = require_pyarrow(url)
    file = watched(file)
    reader, stream = _open(file, url)
    names = checked_schema(reader.schema, columns, url, pa)
    row, index = 0, 0
    try:
        for batch in _batches(reader, stream):
            end = row + batch.num_rows
            if end > first:
                batch = batch.select(names) if names != list(batch.schema.names) else batch
                for at in range(max(first, row), end, batch_rows):
                    yield at, records_of(batch.slice(at - row, min(batch_rows, end - at)))
            row, index = end, index + 1
    except (OSError, ValueError) as err:
        if storage_error(err, file):
            raise
        raise _damaged(url, f"record batch {index}", err, offset=row) from err


class Arrow(Columnar):
    """Arrow IPC files (``.arrow``: the stream or the file format): blocks are row ranges of
    record batches."""

    name = "arrow"
    suffixes = (".arrow",)
    summary = "Arrow IPC (stream or file format): record batches, read by row ranges"
    group_word = "record batch"

    def settle(self, facts: FileFacts) -> Settled:
        """A local file, or one read as one stream, is counted (`layout`); a remote one,
        read by ranges, starts with its first bytes: a stream is not counted
        (`stream_head`), the file format reads its footer."""
        self.refuse_codec(facts)
        if not facts.local and facts.read_exact is not None:
            head = stream_head(facts.read_exact, facts.url)
            if head is not None:
                return Settled(self, layout=head)
        return super().settle(facts)

    def layout_of(self, file: BinaryIO, url: str) -> Layout:
        return layout(file, url)

    def rows_of(self, file: BinaryIO, shard: Any, start: int, end: int
                ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        return read_rows(file, shard.url, start, end, columns=shard.columns,
                         planned=shard.layout)

    def rows_from(self, file: BinaryIO, shard: Any, first: int
                  ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        return read_from(file, shard.url, first, columns=shard.columns)


FORMAT = Arrow()
