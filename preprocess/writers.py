"""Shard writers: records (compact JSON lines) -> one complete shard file, published atomically.

A shard is written to a hidden temporary name (``.shard-000003.jsonl.zst.tmp``), flushed,
fsynced and renamed to its final name only when complete, so a shard under its final name is
always whole. While writing, the stored bytes pass through xxh64 and a byte counter, so
`finish()` returns the shard's manifest entry without reading the file again.

Two formats:

- ``jsonl.zst``: `streamds.formats.seekable.SeekableWriter`, frames of whole lines with a
  seek table;
- ``tar``: `webdataset.TarWriter`, one ``KEY.json`` member per record, KEY the record's
  10-digit ordinal in the whole output; mtime 0 and fixed owner, so bytes are reproducible.
  webdataset is the optional 'tar' extra (``pip install 'streamds[tar]'``); `check_tar_writer`
  refuses ``--format tar`` without it before any output is made.

`BackgroundShard` runs a shard writer in a worker thread fed through a bounded queue: the
caller parses the next records while zstd (which releases the GIL) compresses these.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Protocol

import xxhash

from streamds.formats.manifest import ShardEntry
from streamds.formats.seekable import SeekableWriter

__all__ = [
    "FORMATS",
    "BackgroundShard",
    "ShardFile",
    "TarShard",
    "ZstdShard",
    "check_tar_writer",
    "is_shard_name",
    "open_shard",
    "shard_name",
    "tar_member_size",
    "temp_name",
]

FORMATS = {"jsonl.zst": ".jsonl.zst", "tar": ".tar"}
_SHARD_PREFIX = "shard-"
_TAR_BLOCK = 512
_BATCH_BYTES = 1 << 20  # lines handed to a background writer at a time
_NO_TAR_WRITER = ("--format tar writes webdataset tar shards and needs the 'webdataset' package, "
                  "which is not installed; install the 'tar' extra: pip install 'streamds[tar]' "
                  "(in a clone: pip install -e '.[tar]'), or convert to the default format, "
                  "jsonl.zst")


def check_tar_writer() -> None:
    """Refuse tar output where webdataset (the 'tar' extra) is missing, without importing it
    (it imports torch)."""
    if importlib.util.find_spec("webdataset") is None:
        raise ImportError(_NO_TAR_WRITER)
_QUEUED_BATCHES = 16  # per background shard: at most ~16 MiB of lines wait in its queue


def shard_name(index: int, fmt: str) -> str:
    """``shard-000042.jsonl.zst``: 6 digits, natural and lexical order agree to 1e6 shards.

    >>> shard_name(42, "jsonl.zst"), shard_name(7, "tar")
    ('shard-000042.jsonl.zst', 'shard-000007.tar')
    """
    return f"{_SHARD_PREFIX}{index:06d}{FORMATS[fmt]}"


def is_shard_name(name: str, fmt: str) -> bool:
    """Whether `name` is a shard file name of format `fmt` (see `shard_name`).

    >>> [is_shard_name(name, "tar") for name in ("shard-000007.tar", ".shard-000007.tar.tmp",
    ...                                          "shard-000007.jsonl.zst", "train.tar")]
    [True, False, False, False]
    """
    return name.startswith(_SHARD_PREFIX) and name.endswith(FORMATS[fmt])


def temp_name(name: str) -> str:
    """The hidden name a shard has while it is written; readers skip it."""
    return f".{name}.tmp"


def tar_member_size(record_bytes: int) -> int:
    """Bytes one record takes in a tar shard: a header block plus data padded to 512."""
    return _TAR_BLOCK + -(-record_bytes // _TAR_BLOCK) * _TAR_BLOCK


class _HashingFile:
    """Writes through to `fileobj`, hashing (xxh64) and counting the bytes."""

    def __init__(self, fileobj: BinaryIO) -> None:
        self._fileobj = fileobj
        self.digest = xxhash.xxh64()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        self._fileobj.write(data)
        return len(data)

    def flush(self) -> None:
        self._fileobj.flush()


class ShardFile(Protocol):
    """One shard being written."""

    name: str

    def write(self, line: bytes) -> None: ...

    def write_lines(self, lines: Sequence[bytes]) -> None: ...

    def finish(self) -> ShardEntry: ...

    def discard(self) -> None: ...


class _TempFile:
    """The temporary file behind a shard, and its atomic publication."""

    def __init__(self, directory: Path, name: str) -> None:
        self.name = name
        self._final = directory / name
        self._tmp = directory / temp_name(name)
        self._file = open(self._tmp, "wb")
        self.out = _HashingFile(self._file)

    def publish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self._final)

    def discard(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


class ZstdShard:
    """A seekable zstd JSONL shard: lines -> frames of about `frame_size` decoded bytes."""

    def __init__(self, directory: Path, name: str, *, level: int, frame_size: int) -> None:
        self.name = name
        self._temp = _TempFile(directory, name)
        self._writer = SeekableWriter(self._temp.out, level=level, frame_size=frame_size)  # type: ignore[arg-type]
        self.write = self._writer.write_line

    def write_lines(self, lines: Sequence[bytes]) -> None:
        self._writer.write_lines(lines)

    def finish(self) -> ShardEntry:
        stats = self._writer.close()
        out = self._temp.out
        self._temp.publish()
        return ShardEntry(
            name=self.name,
            bytes=out.size,
            decoded_bytes=sum(s.decompressed_size for s in stats),
            records=sum(s.records for s in stats),
            checksum=out.digest.hexdigest(),
            records_per_frame=tuple(s.records for s in stats),
            frame_sizes=tuple((s.compressed_size, s.decompressed_size) for s in stats),
        )

    def discard(self) -> None:
        self._temp.discard()


class TarShard:
    """A webdataset tar shard: record k of the output becomes member ``{k:010d}.json``
    (``{key_prefix}{k:010d}.json``, k counted within the part, when the output is in parts)."""

    def __init__(self, directory: Path, name: str, *, first_record: int,
                 key_prefix: str = "") -> None:
        try:
            from webdataset import TarWriter  # imports torch: only when tar output is asked for
        except ImportError as err:
            raise ImportError(f"--format tar needs the 'webdataset' package ({err}); install "
                              "the 'tar' extra: pip install 'streamds[tar]' (in a clone: "
                              "pip install -e '.[tar]')") from err

        self.name = name
        self._temp = _TempFile(directory, name)
        self._next = first_record
        self._prefix = key_prefix
        self._records = 0
        self._writer = TarWriter(
            self._temp.out, encoder=False, mtime=0, user="streamds", group="streamds", mode=0o444
        )

    def write(self, line: bytes) -> None:
        self._writer.write({"__key__": f"{self._prefix}{self._next:010d}", "json": line})
        self._next += 1
        self._records += 1

    def write_lines(self, lines: Sequence[bytes]) -> None:
        for line in lines:
            self.write(line)

    def finish(self) -> ShardEntry:
        self._writer.close()
        out = self._temp.out
        self._temp.publish()
        return ShardEntry(
            name=self.name,
            bytes=out.size,
            decoded_bytes=out.size,
            records=self._records,
            checksum=out.digest.hexdigest(),
        )

    def discard(self) -> None:
        self._temp.discard()


def open_shard(
    directory: Path, index: int, fmt: str, *, level: int, frame_size: int, first_record: int,
    key_prefix: str = "",
) -> ShardFile:
    """A new shard file number `index` in format `fmt` ("jsonl.zst" or "tar")."""
    name = shard_name(index, fmt)
    if fmt == "tar":
        return TarShard(directory, name, first_record=first_record, key_prefix=key_prefix)
    return ZstdShard(directory, name, level=level, frame_size=frame_size)


_END = object()
_ABORT = object()


class BackgroundShard:
    """Feeds a ShardFile from a pool thread; `write` batches lines into a bounded queue.

    Memory: at most `_QUEUED_BATCHES` batches of ~1 MiB wait per shard. If the worker thread
    fails, it drains the queue (so `write` never blocks forever) and the next `write` or the
    future from `finish()` raises the error.
    """

    def __init__(self, shard: ShardFile, pool: ThreadPoolExecutor) -> None:
        self.name = shard.name
        self._queue: queue.Queue[object] = queue.Queue(_QUEUED_BATCHES)
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._failed: BaseException | None = None
        self.future: Future[ShardEntry | None] = pool.submit(self._run, shard)

    def _run(self, shard: ShardFile) -> ShardEntry | None:
        item: object = None
        try:
            while True:
                item = self._queue.get()
                if item is _END:
                    return shard.finish()
                if item is _ABORT:
                    shard.discard()
                    return None
                shard.write_lines(item)  # type: ignore[arg-type]
        except BaseException as err:
            self._failed = err
            shard.discard()
            while item is not _END and item is not _ABORT:
                item = self._queue.get()  # the caller may still be putting: never block it
            raise

    def _put(self, item: object) -> None:
        while True:
            if self._failed is not None:
                raise RuntimeError(f"writing {self.name} failed: {self._failed}") from self._failed
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def write(self, line: bytes) -> None:
        self._batch.append(line)
        self._batch_bytes += len(line)
        if self._batch_bytes >= _BATCH_BYTES:
            self._put(self._batch)
            self._batch, self._batch_bytes = [], 0

    def finish(self) -> Future[ShardEntry | None]:
        """Hand over the last lines; the future gives the entry once the shard is renamed."""
        if self._batch:
            self._put(self._batch)
            self._batch = []
        self._put(_END)
        return self.future

    def discard(self) -> None:
        """Stop without publishing; the temporary file is removed."""
        self._batch = []
        with contextlib.suppress(RuntimeError):
            self._put(_ABORT)
