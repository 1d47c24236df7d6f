"""Raw byte ranges of shards: one request per range, retried, and a file made of them.

The storage seam under the reader. `RangeReader.read(shard, start, end)` fetches stored bytes
[start, end) of one shard in one request: `os.pread` on one descriptor per shard for local
files (so a slow mount sees one open per shard and parallel reads), one ranged GET
(`fs.cat_file`) for remote filesystems, never more than asked. Transient failures are retried
at the same offset per the `RetryPolicy`; permanent ones (missing, forbidden, a file that
shrank since it was listed) raise at once, naming the URL.

`StreamFile` reads a file from a server that ignores Range (`range_probe`) as one stream.

`RangeFile` is a read-only file over those ranges, from an offset on. Its reads come from a
`ReadAhead`'s prefetched pieces when one holds the bytes, else straight from storage in
requests sized to what the caller planned to read (`planned_end`), so a block never fetches
much past its end, and to the storage (`RangeReader.request_size`).
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import threading
from bisect import bisect_left, bisect_right
from typing import Protocol

from fsspec.implementations.local import LocalFileSystem

from ..errors import CorruptShardError
from ..formats.codecs import READ_SIZE
from ..redact import describe_error, redact, safe_cause, scrubbed
from ..retry import DEFAULT_RETRY, RangeNotSupportedError, RetryPolicy, as_os_error, retrying
from .mounts import on_fuse_mount, on_remote_mount
from .shard_cache import Cache, ShardCacheSettings, pread_full
from .shards import Shard, process_fs

__all__ = ["DIRECT_REQUEST", "LINE_PROBE", "LOCAL_REQUEST", "Prefetched", "RangeFile",
           "RangeReader", "StreamFile", "stored_span"]

DIRECT_REQUEST = 4 << 20  # bytes per request when nothing was fetched ahead ...
LOCAL_REQUEST = READ_SIZE  # ... of a file on a local disk (`RangeReader.request_size`)
LINE_PROBE = 64 << 10  # bytes planned past a plain block's end, for the line crossing it
_TAIL_REQUEST = 64 << 10  # bytes per request past the planned end
_PAGE = mmap.PAGESIZE


def stored_span(shard: Shard, start: int, end: int | None) -> tuple[int, int, int | None]:
    """Where decoded bytes [start, end) of `shard` lie in the stored file.

    Returns (stored start, the decoded offset there, stored end or None: to the file's end).
    Plain files: the same bytes, plus LINE_PROBE for the line crossing `end` where records
    are lines (a Parquet row group's chunks end where they say); seekable zstd files: the
    frames holding them; other compressed files and tars: the whole file.
    """
    if shard.codec is None:
        if end is None or shard.size is None:
            return start, start, shard.size
        probe = LINE_PROBE if shard.format.line_positions else 0
        return start, start, min(end + probe, shard.size)
    if not shard.frames:
        return 0, 0, shard.size
    starts = [frame.decompressed_offset for frame in shard.frames]
    first = shard.frames[max(0, bisect_right(starts, start) - 1)]
    last = shard.frames[-1 if end is None else max(0, bisect_left(starts, end) - 1)]
    if last.compressed_offset < first.compressed_offset:
        last = first
    return (first.compressed_offset, first.decompressed_offset,
            last.compressed_offset + last.compressed_size)


class RangeReader:
    """Stored bytes of shards by range; thread-safe. Close it to release its descriptors.

    Once `stop` is set, no read starts and no failed one is retried (`retrying`): the
    reader's owner wants no more bytes (a closed `ReadAhead`).
    """

    def __init__(self, retry: RetryPolicy = DEFAULT_RETRY,
                 cache: ShardCacheSettings | None = None, *, fuse_direct: bool = False,
                 stop: threading.Event | None = None) -> None:
        self.retry = retry
        self._stop = stop
        self._fuse_direct = fuse_direct  # files on FUSE mounts: bypass the page cache
        self._fds: dict[str, int] = {}
        self._direct: set[int] = set()  # descriptors opened with O_DIRECT
        self._on_disk: dict[str, bool] = {}  # url -> a file on a local disk (request_size)
        self._lock = threading.Lock()
        self._cache = None if cache is None else Cache(
            cache, self._read_source, lambda: RangeReader(retry))

    def read(self, shard: Shard, start: int, end: int) -> bytes:
        """Bytes [start, end) of `shard`; fewer only where the file ends (at its listed size
        when it has one: ending earlier means it shrank, a `CorruptShardError`). With a
        cache, through it (`Cache.read`)."""
        if end <= start:
            return b""
        if self._cache is not None:
            return self._cache.read(shard, start, end)
        return self._read_source(shard, start, end)

    def request_size(self, shard: Shard) -> int:
        """Bytes to ask for at a time where nothing was fetched ahead. A file on a local disk:
        a line reader's read (the kernel reads ahead of it; a piece that fits the CPU's cache
        is copied again cheaply, and one read whole is handed on as it came: `RangeFile`);
        anything else, where each request is a round trip (a network or FUSE mount, an object
        store, through the shard cache): DIRECT_REQUEST."""
        on_disk = self._on_disk.get(shard.url)
        if on_disk is None:
            on_disk = self._on_disk[shard.url] = (
                self._cache is None and type(process_fs(shard.fs)) is LocalFileSystem
                and not on_remote_mount([shard.path]))
        return min(LOCAL_REQUEST, DIRECT_REQUEST) if on_disk else DIRECT_REQUEST

    def _read_source(self, shard: Shard, start: int, end: int) -> bytes:
        try:
            data = retrying(lambda: self._read_once(shard, start, end), self.retry,
                            f"{shard.url} (bytes {start}-{end})", stop=self._stop)
        except (FileNotFoundError, PermissionError) as err:
            if shard.url in str(err):
                raise
            fix = ("make the dataset again from what the storage holds now"
                   if isinstance(err, FileNotFoundError) else "check the credentials")
            raise type(err)(err.errno, f"{shard.url}: {redact(str(err))}; {fix}"
                            ) from safe_cause(err)
        except OSError as err:  # a storage error whose text shows a credential: without it
            if safe_cause(err) is not None:
                raise
            raise OSError(err.errno, f"{shard.url}: {describe_error(err)}") from None
        if len(data) < end - start and shard.size is not None and start + len(data) < min(
            end, shard.size
        ):
            raise CorruptShardError(
                f"{shard.url}: the file ends at byte {start + len(data)} but was "
                f"{shard.size} bytes when the dataset was made; it shrank or is being "
                "rewritten: make the dataset again once the file is complete",
                url=shard.url,
                offset=start + len(data),
            )
        return data

    def _read_once(self, shard: Shard, start: int, end: int) -> bytes:
        fs = process_fs(shard.fs)
        if type(fs) is LocalFileSystem:
            return self._pread(shard, start, end)
        if isinstance(fs, LocalFileSystem):  # a local filesystem with its own file class
            with fs.open(shard.path, mode="rb") as f:
                f.seek(start)
                return _read_full(f, end - start)
        if shard.size is not None:
            end = min(end, shard.size)
            if end <= start:
                return b""
        try:
            data = fs.cat_file(shard.path, start=start, end=end)
        except Exception as err:
            if getattr(err, "status", None) == 416:  # asked past the end of a file of unknown size
                return b""
            converted = as_os_error(err, shard.url)
            if converted is err:
                raise
            raise converted from safe_cause(err)
        if len(data) > end - start:  # the server ignored the Range header: sent the whole file
            raise RangeNotSupportedError(shard.url)  # (each read would fetch all of it again)
        return data

    def _pread(self, shard: Shard, start: int, end: int) -> bytes:
        fd = self._fd(shard.path)
        if fd in self._direct:
            return _pread_direct(fd, start, end)
        return pread_full(fd, start, end)

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = self._open(path)
            return fd

    def _open(self, path: str) -> int:
        """A descriptor of `path`: with O_DIRECT when asked for and the file is on a FUSE
        mount (each thread's read is then its own request, not one of the few background
        requests the kernel's page cache keeps in flight); plain where that is refused."""
        if self._fuse_direct and hasattr(os, "O_DIRECT") and on_fuse_mount([path]):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
            else:
                self._direct.add(fd)
                return fd
        return os.open(path, os.O_RDONLY)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            self._direct.clear()
        for fd in fds:
            os.close(fd)


def _pread_direct(fd: int, start: int, end: int) -> bytes:
    """`pread_full` for an O_DIRECT descriptor: whole pages into a page-aligned buffer (what
    O_DIRECT asks on most filesystems; on FUSE an unaligned buffer is cut into a request per
    page it straddles), then the bytes asked for."""
    first = start - start % _PAGE
    size = -(-(end - first) // _PAGE) * _PAGE
    buffer = mmap.mmap(-1, size)
    try:
        got = 0
        while got < size:
            with memoryview(buffer) as view:
                count = os.preadv(fd, [view[got:]], first + got)
            if not count:
                break
            got += count
        return buffer[start - first : min(got, end - first)]
    finally:
        buffer.close()


def _read_full(f: io.RawIOBase, size: int) -> bytes:
    parts = []
    while size > 0:
        data = f.read(size)
        if not data:
            break
        parts.append(data)
        size -= len(data)
    return b"".join(parts)


class StreamFile(io.RawIOBase):
    """Stored bytes of one shard from `start` on, read as one stream (one GET of the whole
    file, the bytes before `start` discarded): for a server that ignores HTTP Range
    (`Shard.ranged` false). Not seekable; a failure mid-way raises the `as_os_error` kind,
    and the line reader retries by opening a new stream at its first unread line."""

    def __init__(self, shard: Shard, start: int) -> None:
        self._shard = shard
        self._pos = 0
        self._stream = None
        try:
            fs = process_fs(shard.fs)
            self._stream = fs.open(shard.path, mode="rb", block_size=0, size=shard.size)
            self._skip(start)
        except BaseException as err:
            self.close()
            self._raise(err)

    def _raise(self, err: BaseException) -> None:
        converted = as_os_error(err, self._shard.url)
        if isinstance(converted, Exception) and safe_cause(converted) is None:
            raise scrubbed(converted) from None  # fsspec's text shows the URL as given
        if converted is err:
            raise
        raise converted from safe_cause(err)

    def _skip(self, start: int) -> None:
        while self._pos < start:
            data = self._stream.read(min(start - self._pos, DIRECT_REQUEST))
            if not data:
                raise CorruptShardError(
                    f"{self._shard.url}: the file ends at byte {self._pos}, before offset "
                    f"{start}; it shrank or is being rewritten: make the dataset again once "
                    "the file is complete", url=self._shard.url, offset=self._pos)
            self._pos += len(data)

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return _read_full(self, 1 << 62)  # type: ignore[arg-type]
        try:
            data = self._stream.read(size)
        except Exception as err:
            self._raise(err)
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        super().close()


class Prefetched(Protocol):
    """Where a `RangeFile` looks first: bytes already fetched ahead."""

    def take(self, shard: Shard, pos: int) -> tuple[int, bytes] | None:
        """(start, data) of a fetched piece of `shard` holding stored byte `pos`, or None."""


class RangeFile(io.RawIOBase):
    """Stored bytes of one shard from `start` on, read by ranges.

    Reads up to `planned_end` (None: the file's end) come from `ahead` when it holds them,
    else in requests of up to DIRECT_REQUEST bytes that stop at `planned_end`; past it, in
    requests of the size asked (at least _TAIL_REQUEST). The file ends at `stop` (None: where
    the stored file ends). With `owns_reader`, closing the file closes `reader`.
    """

    def __init__(
        self, reader: RangeReader, shard: Shard, start: int, planned_end: int | None = None,
        *, stop: int | None = None, ahead: Prefetched | None = None, owns_reader: bool = False,
    ) -> None:
        self._stop = shard.size if stop is None else stop
        self._reader = reader
        self._owns_reader = owns_reader
        self._shard = shard
        self._pos = start
        self._planned_end = planned_end
        self._ahead = ahead
        self._buffer = memoryview(b"")
        self._buffer_start = start

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence == io.SEEK_END and self._stop is not None:  # a Parquet footer's reader
            offset += self._stop
        elif whence != io.SEEK_SET:
            raise io.UnsupportedOperation("a RangeFile of unknown size seeks from the start or "
                                          "the current spot")
        self._pos = offset
        return offset

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return _read_full(self, 1 << 62)  # type: ignore[arg-type]
        if self._stop is not None:
            size = min(size, self._stop - self._pos)
        if size <= 0:
            return b""
        held = self._pos - self._buffer_start
        if not 0 <= held < len(self._buffer) and not self._fill(size):
            return b""
        held = self._pos - self._buffer_start
        buffer = self._buffer
        whole = buffer.obj
        if held == 0 and size >= len(buffer) and type(whole) is bytes and len(whole) == len(
                buffer):
            data = whole  # all of what one request fetched: handed on, not copied
        else:
            data = bytes(buffer[held : held + size])
        self._pos += len(data)
        return data

    def _fill(self, size: int) -> bool:
        """Load the bytes at the current position; False at the end of the file."""
        self._buffer = memoryview(b"")  # let the bytes read go before asking for more
        found = None if self._ahead is None else self._ahead.take(self._shard, self._pos)
        if found is not None:
            self._buffer_start, data = found
        else:
            end = self._pos + max(size, _TAIL_REQUEST)
            if self._planned_end is None or self._pos < self._planned_end:
                end = self._pos + max(size, self._reader.request_size(self._shard))
                if self._planned_end is not None:
                    end = max(self._pos + size, min(end, self._planned_end))
            if self._stop is not None:
                end = min(end, self._stop)
            data = self._reader.read(self._shard, self._pos, end)
            self._buffer_start = self._pos
        self._buffer = memoryview(data)
        return len(data) > self._pos - self._buffer_start

    def close(self) -> None:
        self._buffer = memoryview(b"")
        if self._owns_reader:
            self._reader.close()
        super().close()
