"""Arrow IPC files (``.arrow``): record batches -> a `Layout`; rows [start, end) -> records.

Both IPC formats are read: the file format (``ARROW1`` magic, a footer that locates each
record batch) and the stream format (what `datasets`' ``save_to_disk`` and its cache write:
batches one after another, no footer). Row counts live in each batch's message header.

The file format is counted from its footer and those headers, never its data
(`footer_layout`): the footer (a flatbuffer) lists each batch's Block (offset, metadata
length, body length), and the header at each offset (a flatbuffer `Message` whose
`RecordBatch` holds `length`, the row count) is read by ranged reads, neighbours closer than
HEADER_GAP bytes in one read. pyarrow has no metadata-only count, so the two flatbuffers are
read here (`_Table`), field by field, each offset checked against the bytes it points into;
the footer is also opened by pyarrow (schema, batch count) as a check. A stream has no
footer: a local one is counted by one pass over its messages (a disk read), a remote one is
not counted (that would download it) but settled from its first bytes (the schema message:
column names), and planned as one block that one reader reads and counts as it goes, as a
gzip file is; it has no len(). A block of the file format reads its batch alone: the stored
bytes the footer places it at (what the read-ahead fetches), decoded with the schema, the
footer read once per file and process; a block of the stream format reads the messages
before it too (the stream has no index).
Records are what `to_pylist()` gives, by the rule of `columnar.refusal`.
"""

from __future__ import annotations

import itertools
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
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

__all__ = ["BATCH_ROWS", "FILE_MAGIC", "FORMAT", "HEADER_GAP", "Arrow", "footer_layout",
           "layout", "read_from", "read_rows", "stream_head"]

FILE_MAGIC = b"ARROW1"  # the file format starts (and ends) with it; a stream does not
BATCH_ROWS = 1024  # rows of a record batch converted to records at a time (`read_from`)
TAIL_READ = 64 << 10  # the file's last bytes, read first: the footer of most files is in them
# Batch headers closer than this are read in one request, the bytes between included: a
# request costs a round trip, ~1 MiB of transfer at 20 ms and 50 MB/s, so counting costs at
# most about what reading the file would, and only the headers where batches are large.
HEADER_GAP = 1 << 20
HEADER_RUN = 8 << 20  # bytes one such request spans at most
_BLOCK = struct.Struct("<qi4xq")  # a footer's Block: offset, metaDataLength, (pad), bodyLength
_RECORD_BATCH = 3  # MessageHeader.RecordBatch, the union's type tag in a Message
_FIELD_NODE = struct.Struct("<qq")  # a RecordBatch's FieldNode: length, null count


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _damaged(url: str, where: str, err: Exception, offset: int = 0, *,
             skips: bool = True) -> CorruptShardError:
    """`skips`: the damage is in a block read (on_error='skip' leaves it), not in what the
    dataset is planned from."""
    fix = ", or pass on_error='skip' to skip the damaged block" if skips else ""
    return CorruptShardError(
        f"{url}: damaged Arrow IPC file ({where}): {_one_line(err)}; copy or write the file "
        f"again{fix}",
        url=url,
        offset=offset,
    )


def _open(file: BinaryIO, url: str, stream: bool | None = None) -> tuple[Any, bool]:
    """(reader, is a stream) for `file`, positioned at its start. `stream`: which format the
    file is in, where the plan knows (its first bytes are then not read: a remote reader of
    one batch would fetch a request's worth of the file's start for them)."""
    pa = require_pyarrow(url)
    file.seek(0)
    is_file = file.read(len(FILE_MAGIC)) == FILE_MAGIC if stream is None else not stream
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


def stream_head(first: bytes, read_exact: Callable[[int, int], bytes], url: str) -> Layout:
    """The uncounted layout of a stream whose first 8 bytes are `first`, from its schema
    message, read by `read_exact(start, end)` (no record batch)."""
    pa = require_pyarrow(url)
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


class _Table:
    """A flatbuffer table in `data` at `at`: its fields read by index, every offset checked
    against `data` (a damaged file raises ValueError, never reads past its bytes)."""

    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at = data, at
        vtable = at - _unpack("<i", data, at)
        self.vsize = _unpack("<H", data, vtable)
        if self.vsize < 4 or self.vsize % 2:
            raise ValueError(f"a table's field list at byte {vtable} is {self.vsize} bytes")
        self.vtable = vtable

    def field(self, index: int) -> int | None:
        """Where field `index` lies, or None when the table leaves it at its default."""
        slot = 4 + 2 * index
        if slot + 2 > self.vsize:
            return None
        offset = _unpack("<H", self.data, self.vtable + slot)
        return self.at + offset if offset else None

    def scalar(self, index: int, fmt: str, default: int = 0) -> int:
        at = self.field(index)
        return default if at is None else _unpack(fmt, self.data, at)

    def table(self, index: int) -> _Table | None:
        at = self.field(index)
        return None if at is None else _Table(self.data, at + _unpack("<I", self.data, at))

    def structs(self, index: int, layout: struct.Struct) -> list[tuple[Any, ...]]:
        """A vector of structs: empty when the table leaves it out."""
        at = self.field(index)
        if at is None:
            return []
        vector = at + _unpack("<I", self.data, at)
        count = _unpack("<I", self.data, vector)
        if vector + 4 + count * layout.size > len(self.data):
            raise ValueError(f"a vector of {count} entries runs past the footer's end")
        return [layout.unpack_from(self.data, vector + 4 + k * layout.size) for k in range(count)]


def _unpack(fmt: str, data: bytes, at: int) -> int:
    if not 0 <= at <= len(data) - struct.calcsize(fmt):
        raise ValueError(f"an offset points at byte {at}, outside the {len(data)} bytes read")
    return struct.unpack_from(fmt, data, at)[0]


def _root(data: bytes) -> _Table:
    return _Table(data, _unpack("<I", data, 0))


def _batch_rows(header: bytes, body: int, fields: int) -> int:
    """The row count in a record batch's encapsulated message (a continuation marker and the
    metadata's length, or the length alone in files before Arrow 0.15, then a `Message`), of
    a schema of `fields` top-level fields. The count must agree with the first column's: a
    damaged count (a length a writer left out reads as 0) would otherwise plan rows that are
    not there, or none of those that are, before pyarrow reads the batch and refuses it."""
    prefix = 8 if header[:4] == b"\xff" * 4 else 4
    size = _unpack("<i", header, prefix - 4)
    if not 0 < size <= len(header) - prefix:
        raise ValueError(f"the message's metadata is {size} bytes, its block {len(header)}")
    message = _root(header[prefix : prefix + size])
    kind = message.scalar(1, "<B")
    if kind != _RECORD_BATCH:
        raise ValueError(f"the message is of type {kind}, not a record batch")
    if message.scalar(3, "<q") != body:
        raise ValueError(f"the message's body is {message.scalar(3, '<q')} bytes, the footer "
                         f"says {body}")
    batch = message.table(2)
    if batch is None:
        raise ValueError("the record batch message has no header")
    rows = batch.scalar(0, "<q")
    if rows < 0:
        raise ValueError(f"the record batch has {rows} rows")
    if fields:
        nodes = batch.structs(1, _FIELD_NODE)  # one per column and nested child, in order
        if not nodes or nodes[0][0] != rows:
            first = nodes[0][0] if nodes else "no"
            raise ValueError(f"the record batch has {rows} rows and its first column "
                             f"{first} values")
    return rows


def _header_runs(blocks: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(start, end, headers held) of stored byte ranges that hold every block's header, in
    file order; neighbours closer than HEADER_GAP in one range of at most HEADER_RUN bytes."""
    runs: list[tuple[int, int, int]] = []
    for offset, meta, _ in sorted(blocks):
        end = offset + meta
        if runs and offset - runs[-1][1] < HEADER_GAP and end - runs[-1][0] <= HEADER_RUN:
            start, last, count = runs[-1]
            runs[-1] = (start, max(last, end), count + 1)
        else:
            runs.append((offset, end, 1))
    return runs


def footer_layout(read_exact: Callable[[int, int], bytes], size: int, url: str) -> Layout:
    """The record batches of an Arrow IPC file-format file of `size` stored bytes, from its
    footer and each batch's message header read by `read_exact(start, end)` (no batch's
    data, see the module's doc): the same row counts as reading every batch (`layout`), and
    each group's stored bytes are its batch's, so a reader's read-ahead fetches that batch.
    A damaged footer or header raises `CorruptShardError` naming the file."""
    pa = require_pyarrow(url)
    tail = read_exact(max(0, size - TAIL_READ), size)  # storage errors: the caller's to retry
    footer_end = size - 10  # the footer, its length (int32) and the magic end the file
    try:
        if len(tail) < 10 or tail[-len(FILE_MAGIC):] != FILE_MAGIC:
            raise ValueError(f"the file does not end with {FILE_MAGIC!r}")
        footer_size = _unpack("<i", tail, len(tail) - 10)
        if not 0 < footer_size <= footer_end - 8:
            raise ValueError(f"the footer's length is {footer_size}, the file {size} bytes")
    except ValueError as err:
        raise _damaged(url, "footer", err, offset=max(0, footer_end), skips=False) from err
    footer = (tail[len(tail) - 10 - footer_size : -10] if footer_size + 10 <= len(tail)
              else read_exact(footer_end - footer_size, footer_end))
    data_end = footer_end - footer_size
    try:
        # pyarrow checks the footer and gives the schema: a file of the footer alone (any
        # error of it is the footer's: there is no storage under an in-memory buffer)
        checked = pa.ipc.open_file(pa.BufferReader(FILE_MAGIC + b"\0\0" + footer + tail[-10:]))
        blocks = _root(footer).structs(3, _BLOCK)  # Footer.recordBatches
        if len(blocks) != checked.num_record_batches:
            raise ValueError(f"{len(blocks)} record batches read, pyarrow reads "
                             f"{checked.num_record_batches}")
        for index, (offset, meta, body) in enumerate(blocks):
            if offset < 8 or meta < 8 or body < 0 or offset + meta + body > data_end:
                raise ValueError(f"record batch {index} is placed at bytes {offset}-"
                                 f"{offset + meta + body}, outside the data")
    except Exception as err:
        raise _damaged(url, "footer", err, offset=data_end, skips=False) from err
    headers: dict[int, bytes] = {}  # block offset -> its message header
    placed = iter(sorted(blocks))
    for start, end, count in _header_runs(blocks):
        data = read_exact(start, end)
        for offset, meta, _ in itertools.islice(placed, count):
            headers[offset] = data[offset - start : offset - start + meta]
    groups = []
    for index, (offset, meta, body) in enumerate(blocks):
        try:
            rows = _batch_rows(headers[offset], body, len(checked.schema))
        except ValueError as err:
            raise _damaged(url, f"record batch {index}'s header", err, offset=offset,
                           skips=False) from err
        groups.append(Group(rows, offset, offset + meta + body))
    return Layout(tuple(groups), tuple(checked.schema.names))


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


_SCHEMAS: OrderedDict[Any, Any] = OrderedDict()  # file identity -> its schema, this process's
_SCHEMAS_HELD = 64
_SCHEMAS_LOCK = threading.Lock()


def _file_schema(file: Any, url: str, key: Any) -> Any:
    """The schema in a file-format file's footer, read once per `key` (the file's identity)
    in this process: a reader of many blocks of one file reads its footer once, not per
    block (its size grows with the batches: reading it per block is quadratic)."""
    with _SCHEMAS_LOCK:
        if key is not None and key in _SCHEMAS:
            _SCHEMAS.move_to_end(key)
            return _SCHEMAS[key]
    reader, _ = _open(file, url, stream=False)
    with _SCHEMAS_LOCK:
        if key is not None:
            _SCHEMAS[key] = reader.schema
            while len(_SCHEMAS) > _SCHEMAS_HELD:
                _SCHEMAS.popitem(last=False)
    return reader.schema


def _batch_at(file: Any, url: str, group: Group, index: int, schema: Any, pa: Any) -> Any:
    """Record batch `index` of a file-format file: its message and body, the group's stored
    bytes, read in one piece and decoded with `schema`. A file with dictionary-encoded
    columns (their dictionaries are other messages, located by the footer) is opened whole."""
    if group.start is None or group.end is None or "dictionary<" in str(schema):
        reader, _ = _open(file, url, stream=False)
        return reader.get_batch(index) if index < reader.num_record_batches else None
    file.seek(group.start)
    data = file.read(group.end - group.start)
    if len(data) < group.end - group.start:
        return None  # the file ends inside the batch: it changed since it was planned
    return pa.ipc.read_record_batch(pa.ipc.read_message(pa.py_buffer(data)), schema)


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
    row, index, found = 0, 0, None
    if planned is not None and not planned.stream:  # the file format: that batch alone
        index = group_of(planned, start)
        row = planned.first_rows()[index]
        schema = _file_schema(file, url, key)
        names = checked_schema(schema, columns, url, pa)
    else:
        reader, stream = _open(file, url, None if planned is None else planned.stream)
        names = checked_schema(reader.schema, columns, url, pa)
    try:
        if planned is None or planned.stream:
            for batch in _batches(reader, stream):
                if row + batch.num_rows > start:
                    found = batch
                    break
                row += batch.num_rows
                index += 1
        elif index < len(planned.groups):
            found = _batch_at(file, url, planned.groups[index], index, schema, pa)
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
        """A file read by ranges starts with its first bytes: the file format is counted
        from its footer and batch headers (`footer_layout`), a remote stream is not counted
        (`stream_head`); a local stream, or a file read as one stream, is counted by reading
        it (`layout`)."""
        self.refuse_codec(facts)
        if facts.read_exact is not None:
            first = facts.read_exact(0, 8)
            footed = first[: len(FILE_MAGIC)] == FILE_MAGIC
            if footed and facts.size is not None:
                return Settled(self, layout=footer_layout(facts.read_exact, facts.size,
                                                          facts.url))
            if not footed and not facts.local:
                return Settled(self, layout=stream_head(first, facts.read_exact, facts.url))
        return super().settle(facts)

    def layout_of(self, file: BinaryIO, url: str) -> Layout:
        return layout(file, url)

    def rows_of(self, file: BinaryIO, shard: Any, start: int, end: int
                ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        return read_rows(file, shard.url, start, end, columns=shard.columns,
                         key=(shard.path, shard.size, shard.version), planned=shard.layout)

    def rows_from(self, file: BinaryIO, shard: Any, first: int
                  ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        return read_from(file, shard.url, first, columns=shard.columns)


FORMAT = Arrow()
