"""Parse later: a worker hands batches of plain records over as their JSON lines, and the main
process parses them.

The main process has to build every record it receives, whether from a worker's message
(`marshal.loads`) or from the JSON line (`orjson.loads`, about the same cost), so a worker
that parses, marshals and sends a record does most of that work for nothing, and on few CPUs
that work is taken from the main process (`benchmarks/throughput.py`'s "parsed in the workers"
row measures the other path). When nothing in the worker needs the values (a
`.batch(n)` of plain records: no map, filter, collate or length rule, malformed lines raise),
`ParseLater` takes the place of `Parse`: lines pass the shuffle or the batch stage as they
are, gathered into lists with their positions (`batches_with_positions` of `Records` and
`Shuffle`: no step or tuple per line), and a `LineBatch` crosses to the main process as the
lines themselves, marshalled into the worker's shared-memory ring (`streamds.handover.shm_ring`).
The main process unmarshals them from the shared pages and parses them into a `RecordBatch`.

Same records, same order, same state (the shape of `Parse`'s, so states move between
worker counts); blank lines and byte-order marks are handled in the worker as `Parse` does.
A malformed line is found in the main process: its batch arrives as a `MalformedLine`, which
the DataLoader raises from ``next()`` as `CorruptRecordError` (file, line of a local file,
byte offset, fix) before its state counts the batch, as it raises an error from a worker.
The worker has moved on: an iterator used after the error would miss the rest of that batch,
so the fix is to resume from the state taken at the error with on_error='skip' (the line is
then skipped and counted).
Only JSONL shards take this path (tar members and .json documents are parsed in the worker).
"""

from __future__ import annotations

import marshal
from array import array
from collections import Counter
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from struct import Struct
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from torch._utils import ExceptionWrapper
from torch.utils.data import get_worker_info

from ..errors import CorruptRecordError
from ..formats import values
from ..formats.jsonl import CutLines
from ..handover import shm_ring
from ..storage.read import count_newlines
from ..storage.shards import listed_shard, resolve_shards
from .batch import RecordBatch, reduce_records_in_worker
from .chunks import Chunk
from .line_runs import LineRuns
from .parse import BLANK, BOM, LineNumbers, Parse, cut_bom, describe_bad, starts_file

if TYPE_CHECKING:
    from .description import ReaderDescription

__all__ = ["LineBatch", "MalformedLine", "ParseLater", "lines_for_main", "parse_payload",
           "parses_later", "payload_pieces"]


def parses_later(spec: ReaderDescription, collate: Any) -> bool:
    """Whether a reader with `spec` leaves its lines for the main process to parse: in a
    DataLoader worker (`lines_for_main`)."""
    return get_worker_info() is not None and lines_for_main(spec, collate)


def lines_for_main(spec: ReaderDescription, collate: Any) -> bool:
    """Whether a reader with `spec` in a DataLoader worker leaves its lines for the main
    process to parse: it makes batches of plain records (`RecordBatch`) of JSON lines shards,
    with nothing that needs a record's value in the worker (map, filter, a length rule,
    counting malformed lines under on_error='skip'): shards whose records are lines at byte
    offsets."""
    batch = spec.batch
    return (
        batch is not None and batch.rule is None and collate is RecordBatch
        and not spec.steps and spec.on_error == "raise" and spec.records_cache is None
        and all(shard.format.line_positions for shard in spec.shards)
    )


class ParseLater(Parse):
    """Stage: chunks of raw lines -> chunks of the lines, BLANK markers for blank lines; a
    byte-order mark at the start of a file is cut off. The batch stage gets each line's
    position from the stage that hands records out (`batches_with_positions`).

    State and counters are `Parse`'s, so states move between worker counts; malformed lines
    raise in the main process, so "bad" stays 0 here.
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        self.skipped: Counter[str] = Counter()  # none: malformed lines are not skipped
        self.reset()

    def parse(self, chunk: Chunk) -> Chunk:
        """`chunk` with its blank lines marked (also used to re-read records). A chunk whose
        lines are all records as read keeps its read buffer (`Chunk.data`), from which the
        batch stage takes them (`streamds.stages.line_runs`)."""
        lines = chunk.items
        if isinstance(lines, CutLines) and not lines.cut and _as_read(lines, chunk):
            return Chunk(chunk.work_index, chunk.block, chunk.offsets, lines, True, chunk.labels,
                         data=chunk.data)
        lines = cut_bom(lines, chunk.offsets, chunk.labels)
        if b"" not in lines and not any(map(bytes.isspace, lines)):  # C speed, no blanks
            data = chunk.data if lines is chunk.items else None  # (no BOM cut off)
            return Chunk(chunk.work_index, chunk.block, chunk.offsets, lines, True, chunk.labels,
                         data=data)
        items = [line if line and not line.isspace() else BLANK for line in lines]
        return Chunk(chunk.work_index, chunk.block, chunk.offsets, items, False, chunk.labels)


_SPACE = b" \t\n\r\x0b\x0c"  # what bytes.isspace counts as whitespace
_IS_SPACE = np.zeros(256, bool)
_IS_SPACE[list(_SPACE)] = True
_FEW = 32  # lines looked at one by one; more at once, by numpy


def _as_read(lines: CutLines, chunk: Chunk) -> bool:
    """Whether `lines`, still in their read buffer, are records as they stand: none blank or
    beginning with whitespace (those go the way that cuts them out), and no byte-order mark
    to cut off. Looked at in the buffer, a byte per line."""
    data, ends = lines.data, lines.ends
    if starts_file(chunk.offsets[0], chunk.labels) and data.startswith(BOM):
        return False
    if len(ends) <= _FEW:
        begin = 0
        for end in ends:
            if end == begin or data[begin] in _SPACE:
                return False
            begin = end + 1
        return True
    at = np.array(ends, np.int64)
    begins = np.empty_like(at)
    begins[0] = 0
    begins[1:] = at[:-1] + 1
    if (at == begins).any():  # an empty line
        return False
    return not _IS_SPACE[np.frombuffer(data, np.uint8)[begins]].any()


class LineBatch(RecordBatch):
    """A worker's batch of records that are still JSON lines, with the block id and offset
    of each line (for errors).

    From a DataLoader worker it crosses as the lines and arrives as a `RecordBatch` parsed in
    the main process. Anywhere else its records are parsed where they are first asked for
    (a collate_fn in the worker, pickle), with the line numbers of `where` in errors.
    """

    __slots__ = ("_records", "blocks", "lines", "offsets", "where")

    def __init__(self, lines: list[bytes], blocks: list[int], offsets: list[int],
                 where: LineNumbers) -> None:
        self.lines = lines
        self.blocks = blocks
        self.offsets = offsets
        self.where = where
        self._records: list[Any] | None = None

    @property  # type: ignore[override]
    def records(self) -> list[Any]:
        if self._records is None:
            self._records = self._parse()
        return self._records

    def __len__(self) -> int:
        return len(self.lines)

    def __reduce__(self) -> tuple[Any, ...]:  # pickle, torch.save: as its records
        return (RecordBatch, (self.records,))

    def __repr__(self) -> str:
        return f"LineBatch({len(self.lines)} lines)"

    def _parse(self) -> list[Any]:
        records, bad = _records(self.lines, self.offsets)
        if bad is None:
            return records
        index, what = bad
        block, offset = self.blocks[index], self.offsets[index]
        url, number = self.where.url(block), self.where.line(block, offset)
        where = f"byte offset {offset}"
        if number is not None:
            where = f"line {number} ({where})"
        raise _malformed(url, where, offset, what, line_number=number)


def _malformed(url: str, where: str, offset: int, what: str, *,
               line_number: int | None = None) -> CorruptRecordError:
    return CorruptRecordError(
        f"{url}: {where}: {what}; fix or remove the line, "
        "or pass on_error='skip' to skip and count malformed lines",
        url=url, line=line_number, offset=offset,
    )


class MalformedLine(ExceptionWrapper):
    """What a worker's batch with a malformed line becomes in the main process: the
    DataLoader raises it from ``next()`` where it would raise an error from the worker, before
    its state counts the batch (so a state taken then resumes before the batch, and meets the
    line again), and a pin-memory thread passes it on untouched. Raises the
    `CorruptRecordError` itself, not torch's copy of its message."""

    def __init__(self, error: CorruptRecordError) -> None:
        self.error = error  # never raised itself: see reraise
        self.exc_type = type(error)
        self.exc_msg = str(error)
        self.where = "in the main process, parsing a batch from a DataLoader worker"

    def reraise(self) -> None:
        # a new error each time, as torch's does: one raised from here holds this frame,
        # and so this wrapper, in its traceback; raising self.error would make a cycle
        error = self.error
        raise CorruptRecordError(str(error), url=error.url, line=error.line,
                                 offset=error.offset)


# -- across the worker's queue: the lines, and where they came from, for errors -------------

# a payload: the header's length, the header (marshalled: where each line ends, the lines
# holding big integers, blocks, offsets, urls), then the lines with a "\n" between
_LENGTH = Struct("<Q")

def _reduce_for_queue(batch: LineBatch) -> tuple[Any, ...]:
    if get_worker_info() is None:  # not on the way from a DataLoader worker
        return (RecordBatch, (batch.records,))
    if batch._records is not None:  # parsed here already (a collate_fn asked)
        return reduce_records_in_worker(batch.records)
    blocks = batch.blocks
    urls = {block: batch.where.url(block) for block in set(blocks)}
    pieces = payload_pieces(batch.lines, blocks, batch.offsets, urls)
    entry = shm_ring.put(*pieces)
    if entry is None:
        return (_parsed_from_bytes, (b"".join(pieces),))
    return (_parsed_from_ring, (entry,))


ForkingPickler.register(LineBatch, _reduce_for_queue)


def payload_pieces(lines: Sequence[bytes], blocks: Sequence[int], offsets: Sequence[int],
                   urls: dict[int, str]) -> list[bytes | memoryview]:
    """A batch's payload, in pieces that go into the ring one after another: the header
    (where each line ends, the lines that hold an integer orjson may read as a float, blocks,
    offsets, urls), then the lines with a "\n" between: slices of the read buffers where the
    lines are still there (`LineRuns`), else joined. The lines are searched for big integers
    here, where a CPU is spare (the search reads every byte: a share of parsing them), and
    not marshalled, so the main process (the bottleneck with workers) only parses them, in
    place: orjson reads the shared pages directly, and no line is copied out of them."""
    pieces, ends = LineRuns.of(lines).pieces(offsets)
    big_lines = values.big_int_lines_of(pieces, ends)
    header = marshal.dumps((ends.tobytes(), big_lines, array("q", blocks).tobytes(),
                            array("q", offsets).tobytes(), urls))
    return [_LENGTH.pack(len(header)), header, *pieces]


def _parsed_from_ring(entry: shm_ring.Entry) -> RecordBatch | MalformedLine:
    return shm_ring.take(entry, parse_payload)


def _parsed_from_bytes(payload: bytes) -> RecordBatch | MalformedLine:
    return parse_payload(payload)


def parse_payload(payload: bytes | memoryview) -> RecordBatch | MalformedLine:
    """A `LineBatch`'s payload -> its records; a `MalformedLine` if a line is malformed (an
    error raised here, while the DataLoader unpickles, would stop a pin-memory thread)."""
    (length,) = _LENGTH.unpack_from(payload)
    header = _LENGTH.size + length
    ends, big_lines, blocks, offsets, urls = marshal.loads(payload[_LENGTH.size : header])
    with memoryview(payload)[header:] as data:  # (a view of the ring's pages: released here)
        records, bad = _joined_records(data, _unpack(ends), big_lines, offsets)
    if bad is None:
        return RecordBatch(records)
    index, what = bad
    offsets = _unpack(offsets)
    block, offset = _unpack(blocks)[index], offsets[index]
    url = urls[block]
    number = _line_of(url, offset)
    where = (f"line {number} (byte offset {offset}; parsed in the main process)" if number
             else f"byte offset {offset} (parsed in the main process; num_workers=0 gives the "
             "line number)")
    return MalformedLine(_malformed(url, where, offset, what, line_number=number))


def _line_of(url: str, offset: int) -> int | None:
    """The 1-based line that begins at decoded `offset` of the file `url`, counted from its
    start (the error path only), through the shard this process listed (a remote file's
    storage options are not in the worker's message) or, for a local file, listed again;
    None where neither is there or the file cannot be read."""
    shard = listed_shard(url)
    try:
        if shard is None:
            if "://" in url and not url.startswith("file://"):
                return None
            (shard,) = resolve_shards(url)
        newlines, missing = count_newlines(shard, 0, offset)
    except (OSError, ValueError):
        return None
    return None if missing else newlines + 1


def _joined_records(data: bytes | memoryview, ends: Sequence[int], big_lines: list[int],
                    offsets: bytes) -> tuple[list[Any], tuple[int, str] | None]:
    """`_records` of the lines joined into `data` (each ends where `ends` says; the ring's
    shared pages; `big_lines`: `values.big_int_lines` of them), read in place; the lines are
    copied out only to find a bad one."""
    try:
        records, whole = values.loads_many((), data, ends, big_lines=big_lines)
        if whole:
            return records, None
    except orjson.JSONDecodeError:
        pass
    begins = [0, *(end + 1 for end in ends)]
    return _records([bytes(data[begin:end]) for begin, end in zip(begins, ends, strict=False)],
                    offsets)


def _records(lines: Sequence[bytes], offsets: Sequence[int] | bytes
             ) -> tuple[list[Any], tuple[int, str] | None]:
    """The records of `lines` (exact: `streamds.formats.values`), or the first line that
    holds none and why (invalid JSON, or a value that is not an object). `offsets`: each
    line's decoded offset (packed as an array's bytes from a worker), for messages only."""
    try:
        records, whole = values.loads_many(lines)
        if whole:
            return records, None
    except orjson.JSONDecodeError:
        pass  # some line orjson refuses (or reads as no record): line by line
    records = []
    for index, line in enumerate(lines):
        value, err = values.try_loads(line)
        if err is not None or type(value) is not dict:
            offset = (_unpack(offsets) if isinstance(offsets, bytes) else offsets)[index]
            return [], (index, describe_bad(line, value, err, offset=offset,
                                            file_start=offset == 0))
        records.append(value)
    return records, None


def _unpack(packed: bytes) -> Sequence[int]:
    values = array("q")
    values.frombytes(packed)
    return values
