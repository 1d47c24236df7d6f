"""Read: decode a block and split it into raw lines, each with the offset where it begins.

The seam is an `Opener`: "give me the decoded bytes of this shard from offset N". Everything
else here (line alignment at block edges, bulk splitting, retries that reopen at the first
unread line) is tested against it with fakes.

A block [start, end) owns the lines that begin inside it: reading starts at the first line
beginning at or after `start` and stops after the line that crosses `end`.
"""

from __future__ import annotations

import errno
import io
import logging
import tarfile
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from itertools import accumulate
from operator import add
from typing import Any, BinaryIO, NamedTuple

from ..errors import CorruptShardError
from ..formats.codecs import READ_SIZE, decode
from ..formats.documents import LINES, document_records, probe
from ..formats.filenames import TAR_LINES_MEMBERS, TAR_RECORD_MEMBERS
from ..formats.samples import SampleKeys
from ..retry import DEFAULT_RETRY, GaveUpError, RetryPolicy, is_transient
from .cache import CacheSpec
from .plan import Block
from .ranges import RangeFile, RangeReader, stored_span
from .readahead import ReadAhead
from .shards import Shard

__all__ = [
    "CutLines",
    "LineChunk",
    "Opener",
    "RetryPolicy",
    "TarRecords",
    "count_newlines",
    "open_decoded_at",
    "read_lines",
    "tar_records",
]

log = logging.getLogger(__name__)

# decoded bytes of a shard from an offset, meant to be read up to an end offset (None: all)
Opener = Callable[..., BinaryIO]

@dataclass(frozen=True)
class LineChunk:
    """Consecutive raw lines of one block.

    `offsets[i]` is where `lines[i]` begins in the shard's decoded bytes (for tar shards and
    JSON documents: the record's ordinal); `offsets[-1]` is where the line after the chunk
    begins. `labels` names tar members and document parts, for error messages. `data`: the
    decoded bytes the lines were cut from at each newline (the lines are its first pieces),
    so a search over every line (`streamds.formats.values.loads_many`) needs no copy; None
    where records are no lines of one buffer.
    """

    block: int
    offsets: list[int]
    lines: Sequence[bytes]  # a list, or `CutLines` (cut from `data` when first asked for)
    labels: list[str] | None = None
    data: bytes | None = None


class CutLines(Sequence[bytes]):
    """The lines of a read buffer, as a list that is cut out of it only when first asked for,
    so a parser that reads them in place (`ends`, through a memoryview) never copies them.
    Line i is ``data[ends[i - 1] + 1 : ends[i]]`` (the first from 0)."""

    __slots__ = ("_lines", "data", "ends")

    def __init__(self, data: bytes, ends: list[int]) -> None:
        self.data = data
        self.ends = ends  # where each line ends in `data` (its newline, or the data's end)
        self._lines: list[bytes] | None = None

    @property
    def cut(self) -> bool:
        """Whether the lines were cut out (asked for) already."""
        return self._lines is not None

    def _list(self) -> list[bytes]:
        if self._lines is None:
            self._lines = self.data.split(b"\n", len(self.ends))[: len(self.ends)]
        return self._lines

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index: Any) -> Any:
        return self._list()[index]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        return self._list() == (list(other) if isinstance(other, CutLines) else other)

    __hash__ = None  # type: ignore[assignment]  # like the list it stands for

    def __repr__(self) -> str:
        return f"CutLines({self._list()!r})"


_FEW_LINES = 64  # lines a read buffer may hold to be left uncut (long lines: the copy costs)


def _line_ends(buffer: bytes) -> list[int] | None:
    """Where each newline of `buffer` is, when it holds at most `_FEW_LINES` (None: more; a
    split is then cheaper than finding them one by one)."""
    ends: list[int] = []
    find = buffer.find
    at = find(b"\n")
    while at >= 0:
        if len(ends) == _FEW_LINES or (len(ends) == 8 and at * _FEW_LINES < 8 * len(buffer)):
            return None  # more lines, or the first 8 shorter than the buffer's 64th part
        ends.append(at)
        at = find(b"\n", at + 1)
    return ends


def _skip(stream: BinaryIO, count: int, url: str) -> None:
    while count > 0:
        data = stream.read(min(count, READ_SIZE))
        if not data:
            raise CorruptShardError(
                f"{url}: decoded data ends before offset {count}; the shard changed or is "
                "truncated",
                url=url,
                offset=count,
            )
        count -= len(data)


def open_decoded_at(
    shard: Shard, offset: int, end: int | None = None, *, retry: RetryPolicy = DEFAULT_RETRY,
    cache: CacheSpec | None = None, ahead: ReadAhead | None = None,
) -> BinaryIO:
    """The shard's decoded bytes from `offset` on; the caller means to read up to `end`
    (None: to the end), so storage is asked for no more than that (`ranges.stored_span`).

    Plain files start at `offset`; seekable zstd files at the frame holding `offset`,
    decoding from there; other compressed files decode from the start and discard `offset`
    bytes. Stored bytes come from `ahead`'s prefetched pieces when it holds them, else by
    ranged requests retried per `retry`, through `cache` when given.
    """
    stored_start, decoded_start, stored_end = stored_span(shard, offset, end)
    stop = None  # a seekable file's data ends at its last frame (its seek table follows)
    if shard.frames:
        stop = shard.frames[-1].compressed_offset + shard.frames[-1].compressed_size
    if ahead is not None:
        raw = RangeFile(ahead.reader, shard, stored_start, stored_end, stop=stop, ahead=ahead)
    else:
        raw = RangeFile(RangeReader(retry, cache), shard, stored_start, stored_end, stop=stop,
                        owns_reader=True)
    try:
        stream = decode(raw, shard.codec, shard.url, start=stored_start,
                        decoded_start=decoded_start)
        _skip(stream, offset - decoded_start, shard.url)
        return stream
    except BaseException:
        raw.close()
        raise


class _NextLine:
    """Where the next unread line of a block begins (None: not yet aligned to a line)."""

    def __init__(self, next_line: int | None) -> None:
        self.next_line = next_line


_PROBE = 64 << 10  # bytes read past a block's end (or before its start) to find a newline


def _align(stream: BinaryIO, start: int, end: int | None, read_size: int) -> tuple[int, bytes]:
    """Skip through the first newline at or after `start - 1` (the stream is there).

    Returns where the first owned line begins and the bytes already read past it; the
    position is at or beyond `end` when no line begins inside the block.
    """
    pos = start - 1
    while True:
        data = stream.read(min(read_size, _PROBE))
        if not data:
            return pos, b""
        newline = data.find(b"\n")
        if newline >= 0:
            return pos + newline + 1, data[newline + 1 :]
        pos += len(data)
        if end is not None and pos >= end:
            return pos, b""


def _line_chunks(
    opener: Opener, shard: Shard, block: Block, block_id: int, cursor: _NextLine, read_size: int
) -> Iterator[LineChunk]:
    end = block.end
    if cursor.next_line is None and block.start > 0 and shard.frames_end_lines:
        cursor.next_line = block.start  # a frame boundary of a converted shard: a line starts
    if cursor.next_line is None and block.start > 0:
        stream = opener(shard, block.start - 1, end)
        pos, tail = _align(stream, block.start, end, read_size)
    else:
        pos = block.start if cursor.next_line is None else cursor.next_line
        stream, tail = opener(shard, pos, end), b""
    cursor.next_line = pos
    with closing(stream):
        pending = [tail] if tail else []  # bytes from `pos` on that hold no full line yet
        read_to = pos + len(tail)  # decoded offset up to which the stream has been read
        while end is None or pos < end:
            # never read far past the block: up to its end, then small probes for the
            # newline that ends the line crossing it
            size = read_size if end is None else min(read_size, max(end - read_to, 0) + _PROBE)
            data = stream.read(size)
            read_to += len(data)
            at_eof = not data
            if not at_eof and data.find(b"\n") < 0:
                pending.append(data)
                continue
            pending.append(data)
            buffer = b"".join(pending)
            lines: Sequence[bytes]
            ends = _line_ends(buffer)
            if ends is None:  # many lines: one split, at C speed
                lines = buffer.split(b"\n")
                tail = lines.pop()
                if at_eof and tail:  # a final line without a newline is a record
                    lines.append(tail)
                offsets = list(accumulate(map((1).__add__, map(len, lines)), add, initial=pos))
            else:  # a few long lines: found in place, cut out only if asked for
                last = ends[-1] + 1 if ends else 0
                tail = buffer[last:]
                if at_eof and tail:  # a final line without a newline is a record
                    ends.append(len(buffer))
                lines = CutLines(buffer, ends)
                offsets = [pos, *(pos + end + 1 for end in ends)]
            if not lines:
                return
            pending = [] if at_eof or not tail else [tail]
            if at_eof and tail:
                offsets[-1] -= 1  # no newline after the last line
            if end is not None and offsets[-1] > end:
                owned = bisect_left(offsets, end, hi=len(lines))
                if owned < len(lines):
                    cursor.next_line = offsets[owned]
                    if owned:
                        kept = CutLines(buffer, lines.ends[:owned]) if isinstance(
                            lines, CutLines) else lines[:owned]
                        yield LineChunk(block_id, offsets[: owned + 1], kept, data=buffer)
                    return
            pos = cursor.next_line = offsets[-1]
            yield LineChunk(block_id, offsets, lines, data=buffer)
            if at_eof:
                return


def _tar_members(tar: tarfile.TarFile, url: str) -> Iterator[tarfile.TarInfo]:
    """The members of a tar opened in stream mode, without keeping them in `tar.members`.

    `TarFile` iteration ends silently at a header that is cut short or damaged, which would
    drop the rest of the shard; here only the end-of-archive block ends it, anything else
    raises `CorruptShardError`.
    """
    member = tar.next()  # the first member, read when the archive was opened
    while member is not None:
        yield member
        tar.fileobj.seek(tar.offset)  # past the member's data: reads forward in stream mode
        try:
            member = tarfile.TarInfo.fromtarfile(tar)
        except tarfile.EOFHeaderError:
            return
        except tarfile.HeaderError as err:
            raise CorruptShardError(
                f"{url}: truncated or damaged tar header at byte {tar.offset}: {err}; copy or "
                "convert the file again",
                url=url,
                offset=tar.offset,
            ) from err


class TarRecords(NamedTuple):
    """The records of one tar member: `records[i]` is record number `first + i` of the shard."""

    member: str
    first: int
    records: list[bytes]


def tar_records(stream: BinaryIO, url: str, first: int = 0) -> Iterator[TarRecords]:
    """The records of a tar shard, member by member, from record number `first` on.

    `stream` holds the shard's decoded bytes from its start. A ``.json`` member is one record
    (one per webdataset sample, else `TarSampleError`); a ``.jsonl`` member is one record per
    line (blank lines count, so numbers match the reader's; parsing skips them). Members are
    read forward only, one at a time. A cut or damaged header or member raises
    `CorruptShardError` naming `url` and the record it follows: never a silently short shard.
    The library's reader and the converter both read tar shards here.
    """
    ordinal = 0
    samples = SampleKeys(url)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in _tar_members(tar, url):
                if not member.isfile():
                    continue
                if member.name.endswith(TAR_RECORD_MEMBERS):
                    samples.check(member.name)  # one JSON member per webdataset sample
                    one_record = True  # the member is one record
                elif member.name.endswith(TAR_LINES_MEMBERS):
                    one_record = False  # the member holds JSON lines
                else:
                    continue
                if one_record and ordinal < first:
                    ordinal += 1
                    continue
                extracted = tar.extractfile(member)
                data = extracted.read() if extracted is not None else b""
                records = [data] if one_record else data.split(b"\n")
                if not one_record and records and not records[-1]:
                    records.pop()
                skip = max(0, first - ordinal)
                ordinal += len(records)
                if records[skip:]:
                    yield TarRecords(member.name, ordinal - len(records) + skip, records[skip:])
    except tarfile.TarError as err:  # a member's data cut short, an unreadable first header
        raise CorruptShardError(
            f"{url}: truncated or damaged tar data after record {max(ordinal, first)}: "
            f"{err}; copy or convert the file again",
            url=url,
            offset=max(ordinal, first),
        ) from err


def _tar_chunks(
    opener: Opener, shard: Shard, block_id: int, cursor: _NextLine, read_size: int
) -> Iterator[LineChunk]:
    """Records of a tar shard (`tar_records`), a chunk per member.

    Offsets are record ordinals, so a resume skips that many records.
    """
    first = cursor.next_line or 0
    cursor.next_line = first
    stream = io.BufferedReader(opener(shard, 0), buffer_size=read_size)  # type: ignore[arg-type]
    with closing(stream):
        for member in tar_records(stream, shard.url, first):
            end = member.first + len(member.records)
            cursor.next_line = end
            yield LineChunk(
                block_id,
                list(range(member.first, end + 1)),
                member.records,
                [f"member {member.member}"] * len(member.records),
            )


_DOCUMENT_CHUNK = 1024  # records per chunk of an array document


def _json_chunks(
    opener: Opener, shard: Shard, block: Block, block_id: int, cursor: _NextLine, read_size: int
) -> Iterator[LineChunk]:
    """Records of a ``.json`` shard, by the rule of `streamds.formats.documents`: JSON lines
    (offsets are bytes, as in any JSONL file), or one document (offsets are record
    ordinals: 0 for the document, i for an array's element i, so a resume skips that many).
    """
    with closing(opener(shard, 0)) as stream:
        found, head = probe(stream.read)
        if found != LINES:
            data = b"".join([head, *iter(lambda: stream.read(read_size), b"")])
    if found == LINES:
        yield from _line_chunks(opener, shard, block, block_id, cursor, read_size)
        return
    records, is_array = document_records(data)
    label = "element of the JSON array" if is_array else "the JSON document"
    first = cursor.next_line or 0
    cursor.next_line = first
    for begin in range(first, len(records), _DOCUMENT_CHUNK):
        end = min(begin + _DOCUMENT_CHUNK, len(records))
        cursor.next_line = end
        yield LineChunk(
            block_id, list(range(begin, end + 1)), records[begin:end], [label] * (end - begin)
        )


def read_lines(
    shard: Shard,
    block: Block,
    block_id: int,
    *,
    resume_at: int | None = None,
    opener: Opener = open_decoded_at,
    retry: RetryPolicy = DEFAULT_RETRY,
    read_size: int = READ_SIZE,
) -> Iterator[LineChunk]:
    """Chunks of the raw lines `block` owns, from `resume_at` (a line start) when given.

    Memory is one read of `read_size` bytes plus the longest line. A transient storage error
    is retried per `retry`, reopening at the first line not yet handed out, so nothing is lost
    or repeated; damaged data raises `CorruptShardError` at once.
    """
    cursor = _NextLine(resume_at)
    failures, first_failure = 0, 0.0
    while True:
        try:
            if shard.format == "tar":
                chunks = _tar_chunks(opener, shard, block_id, cursor, read_size)
            elif shard.format == "json":
                chunks = _json_chunks(opener, shard, block, block_id, cursor, read_size)
            else:
                chunks = _line_chunks(opener, shard, block, block_id, cursor, read_size)
            for chunk in chunks:
                failures = 0
                yield chunk
            return
        except GaveUpError as err:  # the storage layer's retries ran out: say where we were
            at = block.start if cursor.next_line is None else cursor.next_line
            raise GaveUpError(
                err.errno, f"{shard.url}: gave up at decoded offset {at}: {err.strerror}"
            ) from err
        except OSError as err:
            if not is_transient(err):
                raise
            failures += 1
            if failures == 1:
                first_failure = time.monotonic()
            if retry.gives_up(failures, first_failure):
                at = block.start if cursor.next_line is None else cursor.next_line
                raise GaveUpError(
                    err.errno or errno.EIO,
                    f"{shard.url}: reading failed {failures} times in a row at decoded offset "
                    f"{at}: {err}; check the storage, or give the dataset a longer "
                    "retry=streamds.RetryPolicy(give_up_after=...)",
                ) from err
            delay = retry.delay(failures)
            log.warning(
                "%s: read failed at offset %s (%s); retry %d in %.1fs",
                shard.url, cursor.next_line, err, failures, delay,
            )
            time.sleep(delay)


def count_newlines(
    shard: Shard, start: int, end: int, opener: Opener = open_decoded_at
) -> tuple[int, int]:
    """Newlines in the shard's decoded bytes [start, end), and how many of those bytes were
    missing (the data ended first; 0 normally).

    Reads the shard from `start`, so it is only called on error and warning paths (line
    numbers for messages).
    """
    newlines, remaining = 0, end - start
    with closing(opener(shard, start, end)) as stream:
        while remaining > 0:
            data = stream.read(min(READ_SIZE, remaining))
            if not data:
                break
            newlines += data.count(b"\n")
            remaining -= len(data)
    return newlines, remaining
