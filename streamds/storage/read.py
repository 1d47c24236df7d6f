"""Read: a block's raw records, each with its position, through the shard's format.

The seam is an `Opener`: "give me the decoded bytes of this shard from offset N"
(`open_decoded_at`: ranges, codecs, read-ahead, cache). The shard's format
(`streamds.formats.registry`) reads a block through it: JSON lines aligned to lines at block
edges and split in bulk, tar members, documents. Here are the retries that reopen at the
first record not yet handed out; all of it is tested against the seam with fakes.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterator
from contextlib import closing
from typing import BinaryIO

from ..errors import CorruptShardError
from ..formats.codecs import READ_SIZE, decode
from ..formats.protocol import Cursor, LineChunk, Opener
from ..formats.tar import TarRecords, tar_records
from ..retry import DEFAULT_RETRY, GaveUpError, RetryPolicy, is_transient
from .cache import CacheSpec
from .plan import Block
from .ranges import RangeFile, RangeReader, StreamFile, stored_span
from .readahead import ReadAhead
from .shards import Shard

__all__ = [
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
    ranged requests retried per `retry`, through `cache` when given; a file from a server
    that ignores Range (`Shard.ranged` false) comes as one stream, uncached.
    """
    stored_start, decoded_start, stored_end = stored_span(shard, offset, end)
    stop = None  # a seekable file's data ends at its last frame (its seek table follows)
    if shard.frames:
        stop = shard.frames[-1].compressed_offset + shard.frames[-1].compressed_size
    if not shard.ranged:  # a server that ignores Range: one stream, read by its one reader
        raw: BinaryIO = StreamFile(shard, stored_start)  # type: ignore[assignment]
    elif ahead is not None:
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
    cursor = Cursor(resume_at)
    failures, first_failure = 0, 0.0
    while True:
        try:
            # the shard's format reads the block, moving the cursor past each chunk
            chunks = shard.format.read_block(opener, shard, block, block_id, cursor, read_size)
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
