"""Conversion inputs -> raw records, in input order, each with the position it starts at.

An input is a JSONL file (plain, .zst, .gz, .bz2 or .xz; any name but .json and .tar counts
as JSONL, so PubMed's ``train.txt`` is one), a ``.json`` file (one document, possibly
pretty-printed, an array being its elements, or JSON lines: the reader's rule, see
`streamds.formats.documents`), a tar shard (webdataset layout: each ``.json`` member is one
record, each ``.jsonl`` member one record per line), a Parquet or Arrow IPC file (each row
one record, as `StreamingJsonl` reads it: `preprocess.rows`), a directory, or a glob.
Inputs expand to *leaves* (single files), listed once before the first record is read and
kept (a few hundred bytes per file):

- a directory or a glob, expanded by the reader's rule (`streamds.formats.trees`): a
  directory names every record-looking file at any depth (``.json``, ``.jsonl``,
  ``.ndjson``, ``.tar``, ``.tgz``, plain or compressed; ``_``-prefixed and ``.tmp`` files and
  ``manifest.json`` skipped); a glob (``data/part_*/*.json``, ``data/**/*.json``) matches
  component by component, only descending into directories that can still match, and a
  pattern without ``**`` whose last component matches a directory takes that directory's
  files. Hidden files and folders (``.ipynb_checkpoints``, dotfiles) are skipped unless a
  pattern spells the dot; symbolic links are followed. Each directory is listed with one
  ``os.scandir`` call and sorted in natural order (``part_2`` before ``part_10``); up to
  `read_ahead` directories are listed at once (`preprocess.listing`).

One file under two names (a symbolic link, ``d//a.jsonl``, an input listed twice, a file
inside a directory also listed) is refused before a record is read: see `Inputs.leaves`.

An input may also be an fsspec URL (``https://host/d/train.jsonl.zst``, ``s3://bucket/d/``,
``memory://tree/*/*.json``; options in `storage_options`): a remote file, or a remote
directory or glob expanded by the same rule (listed once with fsspec, sorted the same way).

Reading: every open and read retries transient errors (Drive's ``[Errno 5]``, a dropped
connection) per a `RetryPolicy`, reopening at the same byte, so nothing is lost or repeated.
``.json`` files are read ahead by a `FilesAhead` pool (`read_ahead` opens in flight, spread
over folders, bounded in bytes). The records and their order never depend on either.
Lines are split and tar members read by the library's own readers
(`streamds.storage.read.read_lines`, `tar_records`; documents by
`streamds.formats.documents`), with its byte-order-mark rule, so a file converts to exactly
the records `StreamingJsonl` reads from it.

A `Position` (input index, path under the input, offset, line) names where a record
begins: the decoded byte offset of its line in a JSONL file (a ``.json`` file of lines too),
its ordinal in a tar shard or an array document, the file row of a Parquet or Arrow row, 0
for any other document.
`Inputs.records(start=position)` restarts exactly there, without reading the files before
it (a plain file, local or remote, is read from the offset; compressed files decode and
discard up to it). This is what makes an interrupted conversion resume.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO, NamedTuple

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from streamds.errors import CorruptShardError
from streamds.formats.codecs import decode, require_codec, strip_codec
from streamds.formats.documents import LINES, document_records, probe
from streamds.formats.filenames import COLUMNAR_SUFFIXES, format_of
from streamds.formats.samples import TarSampleError
from streamds.formats.tar_links import TarLinkError
from streamds.formats.trees import (
    Rel,
    canonical_path,
    directory_walk,
    glob_walk,
    has_magic,
    natural_key,
)
from streamds.redact import guard_source, redact, safe_cause, scrubbed
from streamds.retry import (
    DEFAULT_RETRY,
    PERMANENT_ERRORS,
    RetryPolicy,
    lookup_error,
    option_error,
    retrying,
)
from streamds.stages.parse import without_bom
from streamds.storage.plan import Block
from streamds.storage.read import LineChunk, Opener, read_lines, tar_records
from streamds.storage.shards import Shard, check_options, same_file_error, source_items

from .files_ahead import FilesAhead
from .listing import ListingWalk, RemoteTree, remote_tree, remote_version
from .rows import rows_of_file

__all__ = [
    "DEFAULT_READ_AHEAD",
    "DEFAULT_READ_AHEAD_BYTES",
    "Cut",
    "Inputs",
    "Leaf",
    "Meter",
    "Position",
    "RawRecord",
    "SourceError",
    "Span",
]

READ_SIZE = 1 << 20  # raw bytes per read of a JSONL file
HOLD_LINES = 4 << 20  # a .json file of JSON lines up to this size is read ahead whole
DEFAULT_READ_AHEAD = 64  # .json files opening or reading at once (and folders listed at once)
DEFAULT_READ_AHEAD_BYTES = 256 << 20  # bytes read ahead, beyond the next `read_ahead` files


class SourceError(ValueError):
    """An input that cannot be read as records: the message names the file and the place."""


@dataclass(frozen=True)
class Leaf:
    """One input file. `rel` is its path under the input's root (None: the input itself).

    `path` names it in messages: a local path, or a URL for a file on `fs` (a remote
    fsspec filesystem) at `fs_path`.
    """

    input: int
    rel: Rel | None
    path: str
    kind: str  # "jsonl", "json" (a document or JSON lines, decided when read), "tar", or
    # "rows" (Parquet, Arrow: records by file row, `preprocess.rows`)
    codec: str | None
    size: int | None = None  # stored bytes, when known without asking (a listing, a stat)
    fs: AbstractFileSystem | None = field(default=None, compare=False, repr=False)
    fs_path: str = field(default="", repr=False)  # a URL's credentials included
    lines_from: int = 0  # decoded offset its line numbers count from (a part cut inside it)
    version: str | None = None  # a remote file's ETag or modification time, as listed

    @property
    def folder(self) -> tuple[int, Rel]:
        """The folder the file lies in (what a mount serialises lookups by)."""
        return self.input, () if self.rel is None else self.rel[:-1]

    def open(self) -> BinaryIO:
        """The stored bytes, unbuffered where local."""
        if self.fs is None:
            return open(self.path, "rb", buffering=0)
        return self.fs.open(self.fs_path, "rb")


@dataclass(frozen=True)
class Position:
    """Where a record begins: input index, file under it, offset, 1-based line (or ordinal)."""

    input: int
    file: Rel | None
    offset: int
    line: int

    def to_json(self) -> dict[str, Any]:
        return {
            "input": self.input,
            "file": None if self.file is None else list(self.file),
            "offset": self.offset,
            "line": self.line,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Position:
        file = data["file"]
        return cls(data["input"], None if file is None else tuple(file), data["offset"],
                   data["line"])


@dataclass(frozen=True)
class Cut:
    """Where a part of the input begins: a line beginning (or a file's start) in the file
    `file` of input `input`, at decoded byte `offset` and stored byte `stored` (they differ
    at a seekable zstd frame boundary)."""

    input: int
    file: Rel | None
    offset: int
    stored: int

    def holds(self, leaf: Leaf) -> bool:
        return leaf.input == self.input and leaf.rel == self.file

    def position(self) -> Position:
        return Position(self.input, self.file, self.offset, 1)

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "file": None if self.file is None else list(self.file),
                "offset": self.offset, "stored": self.stored}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cut:
        file = data["file"]
        return cls(data["input"], None if file is None else tuple(file), data["offset"],
                   data["stored"])


@dataclass(frozen=True)
class Span:
    """The records from `begin` up to `end` (None: the end of the input), `begin`'s own
    record included and `end`'s not: one part of a planned conversion. `begin` None: the
    part is empty (it begins at the input's end)."""

    begin: Cut | None
    end: Cut | None


class RawRecord(NamedTuple):
    """The bytes of one record before parsing, and where they came from."""

    data: bytes
    leaf: Leaf
    offset: int  # decoded byte offset of the line (JSONL), ordinal (tar, array element,
    # a Parquet or Arrow file's row)
    line: int  # 1-based line number (JSONL), ordinal + 1 (tar, array element, row), 1
    # (document)
    member: str | None = None  # tar member name
    element: int | None = None  # the ordinal of an array document's element
    value: dict[str, Any] | None = None  # the record, where the reader yields values (Parquet,
    # Arrow: `data` is its JSON text)

    @property
    def position(self) -> Position:
        return Position(self.leaf.input, self.leaf.rel, self.offset, self.line)

    @property
    def where(self) -> str:
        """The record's place for an error message: file and line, or tar member."""
        if self.member is not None:
            return f"{self.leaf.path}: member {self.member} (record {self.line})"
        if self.element is not None:
            return f"{self.leaf.path}: element {self.element} of the JSON array"
        if self.leaf.kind == "json":
            return self.leaf.path
        if self.leaf.kind == "rows":
            return f"{self.leaf.path}: row {self.offset} of the file"
        if self.leaf.lines_from:  # a part cut inside the file numbers from its cut
            before = _newlines_before(self.leaf)
            if before is None:
                return (f"{self.leaf.path}: byte {self.offset} (line {self.line} of the part "
                        f"that begins at byte {self.leaf.lines_from})")
            return f"{self.leaf.path}: line {before + self.line}"
        return f"{self.leaf.path}: line {self.line}"


@functools.lru_cache(maxsize=8)
def _newlines_before(leaf: Leaf) -> int | None:
    """The newlines in `leaf`'s decoded bytes before `leaf.lines_from` (where a part cut
    inside it begins), so a message names the file's line; None where the file cannot be
    read. Reads the file up to there: only messages (an error, a skipped record) ask."""
    try:
        with closing(decode(_Reopening(leaf, DEFAULT_RETRY), leaf.codec, leaf.path)) as stream:
            count, left = 0, leaf.lines_from
            while left > 0 and (data := stream.read(min(left, READ_SIZE))):
                count += data.count(b"\n")
                left -= len(data)
            return count if left == 0 else None
    except (OSError, ValueError):
        return None


class Meter:
    """Reading progress: files passed (those before a resumed run's start included) and
    stored (raw, possibly compressed) bytes read, counted as each read returns (so one big
    file shows progress). Updated by the consuming thread only."""

    def __init__(self) -> None:
        self.files = 0
        self.stored_bytes = 0


class _Reopening(io.RawIOBase):
    """A leaf's stored bytes from byte `start`, each read added to `count`.

    A transient error while opening or reading (`streamds.retry`) closes the file, and the
    read is tried again per `policy` on a new handle at the same byte, so a decoder above
    never sees the failure. Opens at once (retried), so a missing file raises here.
    """

    def __init__(self, leaf: Leaf, policy: RetryPolicy, start: int = 0,
                 end: int | None = None, meter: Meter | None = None) -> None:
        self.leaf = leaf
        self.policy = policy
        self.pos = start
        self.end = end  # reads stop here (None: at the end of the file)
        self.count = 0
        self.meter = meter  # counts each read as it happens (progress inside one big file)
        self._file: BinaryIO | None = retrying(self._open, policy, f"{leaf.path}: open")

    def _open(self) -> BinaryIO:
        file = self.leaf.open()
        if self.pos:
            try:
                file.seek(self.pos)
            except (OSError, ValueError, io.UnsupportedOperation):  # a stream: read up to it
                left = self.pos
                while left > 0:
                    data = file.read(min(left, READ_SIZE))
                    if not data:
                        break
                    left -= len(data)
        return file

    def _read(self, size: int) -> bytes:
        if self._file is None:
            self._file = self._open()
        try:
            return self._file.read(size)
        except OSError:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):
                file.close()
            raise

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if self.end is not None:
            size = max(0, min(self.end - self.pos, READ_SIZE if size < 0 else size))
            if size == 0:
                return b""
        data = retrying(lambda: self._read(size), self.policy,
                        f"{self.leaf.path}: read at byte {self.pos}")
        self.pos += len(data)
        self.count += len(data)
        if self.meter is not None:
            self.meter.stored_bytes += len(data)
        return data

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


# -- names -------------------------------------------------------------------------------


def leaf_kind(name: str) -> tuple[str, str | None]:
    """(kind, codec) of a file name: ``x.json.gz`` -> ("json", "gz"), ``x.txt`` -> jsonl."""
    if name.endswith(".json"):  # the common case of a small-file tree, without codec lookups
        return "json", None
    if name.lower().endswith(COLUMNAR_SUFFIXES):  # rows, not lines: refused when read
        return "rows", None
    fmt, codec = format_of(name)
    if fmt == "jsonl" and strip_codec(name).lower().endswith(".json"):
        return "json", codec
    return fmt, codec


def _is_url(item: str) -> bool:
    return "://" in item or "::" in item


# -- reading -----------------------------------------------------------------------------


def _numbered(chunks: Iterator[LineChunk], leaf: Leaf, line: int) -> Iterator[RawRecord]:
    """The non-blank lines of the library reader's `chunks` as raw records, numbered from
    `line` (the number of the chunks' first line).

    A byte-order mark is cut from the file's first line by the reader's rule
    (`streamds.stages.parse.without_bom`), so a file streamds reads converts too.
    """
    for chunk in chunks:
        for text, pos in zip(chunk.lines, chunk.offsets, strict=False):  # offsets: one more
            record = without_bom(text, pos, None) if pos == 0 else text
            if record and not record.isspace():
                yield RawRecord(record, leaf, pos, line)
            line += 1


def _line_records(
    leaf: Leaf, offset: int, line: int, opener: Opener, policy: RetryPolicy
) -> Iterator[RawRecord]:
    """The records of a file of JSON lines from decoded `offset` (a line start, line number
    `line`), split by the library's reader (`streamds.storage.read.read_lines`: the same
    lines, offsets and final line without a newline as `StreamingJsonl` reads) from the
    decoded bytes `opener` gives."""
    # named for messages only: `opener` reads the leaf (no path, so no credential, held here)
    shard = Shard(url=leaf.path, path="", size=leaf.size, format="jsonl", codec=leaf.codec)
    chunks = read_lines(shard, Block(0, offset), 0, resume_at=offset, opener=opener,
                        retry=policy, read_size=READ_SIZE)
    return _numbered(chunks, leaf, line)


def _read_jsonl(
    leaf: Leaf, offset: int, line: int, meter: Meter, policy: RetryPolicy,
    anchor: tuple[int, int] = (0, 0), stop: int | None = None,
) -> Iterator[RawRecord]:
    """The records of a JSONL leaf from decoded `offset`, up to stored byte `stop`.

    A plain file is read from `offset`; a compressed one decodes from `anchor` (stored,
    decoded offset: a seekable zstd frame's start at or before `offset`, or the file's) and
    discards up to `offset`. Every stored byte read is counted in `meter`.
    """

    def opener(_shard: Shard, at: int, _end: int | None = None) -> BinaryIO:
        stored, decoded = (at, at) if leaf.codec is None else anchor
        raw = _Reopening(leaf, policy, stored, stop, meter)
        try:
            stream = decode(raw, leaf.codec, leaf.path, start=stored,  # type: ignore[arg-type]
                            decoded_start=decoded)
            skip = at - decoded
            while skip > 0:
                data = stream.read(min(skip, READ_SIZE))
                if not data:
                    raise SourceError(
                        f"{leaf.path}: ends before decoded offset {at}, where the conversion "
                        "stopped; the input changed since: rerun with --overwrite to convert "
                        "afresh, or convert into a new directory"
                    )
                skip -= len(data)
            return stream
        except BaseException:
            raw.close()
            raise

    return _line_records(leaf, offset, line, opener, policy)


class Fetched(NamedTuple):
    """A ``.json`` file read ahead: its layout by the reader's rule, and its decoded bytes
    (None: JSON lines too long to hold, streamed when reached)."""

    layout: str
    data: bytes | None
    stored: int  # stored bytes read (0 when `data` is None: the stream counts its own)


def fetch_json(leaf: Leaf, policy: RetryPolicy = DEFAULT_RETRY) -> Fetched:
    """Read a ``.json`` file whole (a document, or JSON lines up to `HOLD_LINES`), or as
    far as its first lines when it is longer JSON lines. Transient errors are retried."""
    if leaf.fs is not None and leaf.size is not None and leaf.size <= HOLD_LINES:
        stored = retrying(lambda: leaf.fs.cat_file(leaf.fs_path), policy,  # type: ignore[union-attr]
                          f"{leaf.path}: read")
        raw: Any = io.BytesIO(stored)
        count = len(stored)
    else:
        raw = _Reopening(leaf, policy)
        count = -1
    with raw:
        stream: Any = raw
        if leaf.codec is not None:
            stream = decode(raw, leaf.codec, leaf.path)
        ended = False

        def read(size: int) -> bytes:
            nonlocal ended
            data = b"" if ended else stream.read(size)
            ended = not data
            return data

        found, head = probe(read)
        parts, held = [head], len(head)
        while not ended and (found != LINES or held <= HOLD_LINES):
            data = read(READ_SIZE)
            parts.append(data)
            held += len(data)
        if ended:
            return Fetched(found, b"".join(parts), count if count >= 0 else raw.count)
    return Fetched(LINES, None, 0)


def _json_records(
    leaf: Leaf, offset: int, line: int, meter: Meter, fetched: Fetched, policy: RetryPolicy
) -> Iterator[RawRecord]:
    """The records of a ``.json`` leaf from `offset` (a byte offset in a file of lines, an
    element's ordinal in an array document)."""
    data = fetched.data
    if fetched.layout == LINES:
        if data is None:
            yield from _read_jsonl(replace(leaf, kind="jsonl"), offset, line, meter, policy)
        else:
            held = data
            yield from _line_records(replace(leaf, kind="jsonl"), offset, line,
                                     lambda _shard, at, _end=None: io.BytesIO(held[at:]), policy)
        return
    assert data is not None
    records, is_array = document_records(data)
    if not is_array:
        yield RawRecord(records[0], leaf, 0, 1)
        return
    for ordinal in range(offset, len(records)):
        yield RawRecord(records[ordinal], leaf, ordinal, ordinal + 1, element=ordinal)


def _read_tar(leaf: Leaf, first: int, meter: Meter, policy: RetryPolicy) -> Iterator[RawRecord]:
    """The records of a tar leaf from record number `first`, read by the library's reader
    (`streamds.storage.read.tar_records`: same members, same numbers, same damage checks)."""
    raw = _Reopening(leaf, policy, meter=meter)
    stream = io.BufferedReader(decode(raw, leaf.codec, leaf.path), READ_SIZE)  # type: ignore[arg-type]

    def reopen() -> BinaryIO:  # the tar again from its start, to follow a link member
        again = _Reopening(leaf, policy)
        return io.BufferedReader(decode(again, leaf.codec, leaf.path), READ_SIZE)  # type: ignore[arg-type]

    try:
        for member in tar_records(stream, leaf.path, first, reopen):
            for ordinal, data in enumerate(member.records, member.first):
                if data and not data.isspace():
                    yield RawRecord(data, leaf, ordinal, ordinal + 1, member.member)
    except (TarSampleError, TarLinkError) as err:
        raise SourceError(str(err)) from err
    finally:
        stream.close()


def _read_rows(leaf: Leaf, first: int, meter: Meter) -> Iterator[RawRecord]:
    """The records of a Parquet or Arrow leaf from file row `first` (`preprocess.rows`)."""

    def count(stored: int) -> None:
        meter.stored_bytes += stored

    found = rows_of_file(leaf.path, first, count, size=leaf.size, fs=leaf.fs,
                         fs_path=leaf.fs_path, version=leaf.version)
    for row, data, record in found:
        yield RawRecord(data, leaf, row, row + 1, value=record)


# -- inputs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LocalFile:
    path: str


@dataclass(frozen=True)
class _RemoteFile:
    fs: AbstractFileSystem
    path: str
    size: int | None
    version: str | None = None


_Plan = _LocalFile | _RemoteFile | ListingWalk | RemoteTree


class Inputs:
    """The conversion inputs, in the order given; each expands to leaves (files).

    Raises FileNotFoundError at construction for a path that does not exist, a glob whose
    fixed directory does not exist, or a remote directory or glob with no record files.
    `exclude` names a directory never walked into (the conversion's output, when it lies
    inside an input directory). `storage_options` go to fsspec for URLs; `read_ahead` is
    how many ``.json`` files open at once and how many local folders list at once (0 or 1:
    one at a time), `read_ahead_bytes` how much read-ahead data may wait beyond the next
    `read_ahead` files; `retry` how transient errors are retried. None of these changes the
    records or their order. Local folders holding one of the file names `markers` are noted
    as they are listed (`plans`: each input's `ListingWalk.marked`).

    >>> inputs = Inputs(["data/train.txt", "data/small/"])      # doctest: +SKIP
    >>> next(inputs.records()).where                            # doctest: +SKIP
    'data/train.txt: line 1'
    """

    def __init__(
        self,
        items: Any,
        *,
        storage_options: dict[str, Any] | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
        read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
        retry: RetryPolicy = DEFAULT_RETRY,
        markers: frozenset[str] = frozenset(),
    ) -> None:
        if isinstance(items, (list, tuple)) and not items:
            raise ValueError("no inputs given; name JSONL files, directories, globs or tar files")
        self.items = tuple(source_items(items, name="inputs"))
        self.storage_options = dict(storage_options or {})
        check_options(self.storage_options)  # headers as a string: refused, not "missing"
        guard_source(self.items, self.storage_options)  # the storage libraries' log records
        self.read_ahead = read_ahead
        self.read_ahead_bytes = read_ahead_bytes
        self.retry = retry
        self.markers = markers
        self._exclude: set[tuple[int, int]] = set()
        self._plans: list[_Plan] = [self._plan(item) for item in self.items]
        self._all: list[Leaf] | None = None  # every leaf, once listed and checked
        self._index: dict[tuple[int, Rel | None], int] | None = None  # leaf -> its place

    @property
    def plans(self) -> tuple[Any, ...]:
        """What each input expands by: a `ListingWalk` for a local folder or glob, a
        `RemoteTree` for a remote one, else a file."""
        return tuple(self._plans)

    def exclude(self, directory: str | os.PathLike) -> None:
        """Never walk into `directory` (an existing one): the output, when inside an input."""
        info = os.stat(directory)
        self._exclude.add((info.st_dev, info.st_ino))

    def _plan(self, item: str) -> _Plan:
        if _is_url(item):
            try:
                fs, path = url_to_fs(item, **self.storage_options)
            except TypeError as err:
                if not self.storage_options:
                    raise
                raise option_error(f"input {redact(item)!r}", self.storage_options, err
                                   ) from safe_cause(err)
            except ImportError as err:
                raise ImportError(
                    f"input {redact(item)!r} needs a filesystem library that is not installed "
                    f"({err}); "
                    "for https:// install the 'remote' extra (pip install 'streamds[remote]'; "
                    "in a clone: pip install -e '.[remote]'), "
                    "for s3:// s3fs, for gs:// gcsfs"
                ) from err
            protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
            if protocol not in ("file", "local"):
                return self._plan_remote(item, fs, path)
            item = path
        if os.path.exists(item) and not os.path.isdir(item):
            _kind, codec = leaf_kind(item)
            require_codec(codec, item)
            return _LocalFile(item)
        threads = self.read_ahead if self.read_ahead > 1 else 0
        if os.path.isdir(item):
            return ListingWalk(directory_walk(item, self._exclude), threads, self.markers)
        if has_magic(item):
            walk = ListingWalk(glob_walk(item, self._exclude), threads, self.markers)
            if not os.path.isdir(walk.root or "."):
                raise FileNotFoundError(f"no files match {item!r}: {walk.root!r} is no directory")
            return walk
        raise FileNotFoundError(f"input {item!r} does not exist; check the path")

    def _plan_remote(self, item: str, fs: AbstractFileSystem, path: str) -> _Plan:
        """The remote file or tree `item` names; messages show it redacted (`redact`)."""
        shown = redact(item)
        try:
            tree = retrying(lambda: remote_tree(fs, path), self.retry, shown)
        except FileNotFoundError as err:
            found = lookup_error(f"input {shown!r}", self.storage_options, err)
            if isinstance(found, FileNotFoundError):  # it is not there: the listing's words
                found = FileNotFoundError(f"input {shown!r}: {redact(str(err))}")
            raise found from safe_cause(err)
        except (OSError, ValueError) as err:  # what the storage raised, credentials redacted
            if safe_cause(err) is not None:
                raise
            raise scrubbed(err) from None
        except Exception as err:  # e.g. botocore's NoCredentialsError, which is no OSError
            raise SourceError(
                f"input {shown!r} cannot be listed: {type(err).__name__}: {redact(str(err))}; "
                "check the URL and the credentials (--storage-options)"
            ) from safe_cause(err)
        if tree is not None:
            return tree
        _kind, codec = leaf_kind(path.rsplit("/", 1)[-1])
        require_codec(codec, shown)
        info = retrying(lambda: fs.info(path), self.retry, shown)
        return _RemoteFile(fs, path, info.get("size"), remote_version(info))

    def leaves(self, start: Position | None = None) -> Iterator[Leaf]:
        """Every input file in order, from the one holding `start` on.

        The first call lists every input once to refuse a file found under two names
        (ValueError from `same_file_error`), before a record is read.
        """
        return iter(self._leaf_list(start)[1])

    @property
    def listed(self) -> bool:
        """Whether the inputs are listed (by `leaves` or `use_listing`)."""
        return self._all is not None

    def use_listing(self, leaves: Sequence[Leaf]) -> None:
        """Take `leaves` as the listing: the files of one part, listed by the process that
        planned it and sent with the task, so reading the part lists nothing."""
        self._all, self._index = list(leaves), None

    def span_leaves(self, span: Span) -> list[Leaf]:
        """The files `span` reads, from the listing (made here, by `leaves`, or taken)."""
        if span.begin is None:
            return []
        return list(self._span_leaves(span.begin.position(), span.end))

    def _place(self, start: Position) -> int | None:
        """Where the file holding `start` is in the listing (None: not listed)."""
        if self._all is None:
            return None
        if self._index is None:
            self._index = {(leaf.input, leaf.rel): at for at, leaf in enumerate(self._all)}
        return self._index.get((start.input, start.file))

    def _leaf_list(self, start: Position | None) -> tuple[int, list[Leaf]]:
        """(files before `start`, the leaves from the one holding it on)."""
        if self._all is None:
            self._all = self._checked_leaves()
        if start is None:
            return 0, self._all
        for index, leaf in enumerate(self._all):
            if leaf.input == start.input and leaf.rel == start.file:
                return index, self._all[index:]
        rest = list(self._leaves(start))  # the file is gone: the walk finds what follows
        return len(self._all) - len(rest), rest

    def _checked_leaves(self) -> list[Leaf]:
        """Every leaf; ValueError when two are one file (its real path), whatever the names."""
        named: dict[str, str] = {}
        real_dirs: dict[str, str] = {}
        leaves = []
        for leaf in self._leaves(None):
            real = self._identity(leaf, real_dirs)
            if real in named:
                raise same_file_error(named[real], leaf.path, real, named_by="the inputs name")
            named[real] = leaf.path
            leaves.append(leaf)
        return leaves

    def _identity(self, leaf: Leaf, real_dirs: dict[str, str]) -> str:
        if leaf.fs is not None:
            return leaf.fs.unstrip_protocol(leaf.fs._strip_protocol(leaf.fs_path))
        plan = self._plans[leaf.input]
        if isinstance(plan, ListingWalk) and leaf.rel is not None:
            is_link = leaf.rel in plan.links  # from the listing: no request per file
        else:
            is_link = os.path.islink(leaf.path)
        return canonical_path(leaf.path, is_link=is_link, real_dirs=real_dirs)

    def _leaves(self, start: Position | None) -> Iterator[Leaf]:
        first = 0 if start is None else start.input
        for index in range(first, len(self.items)):
            item, plan = self.items[index], self._plans[index]
            resume = start.file if start is not None and index == start.input else None
            if isinstance(plan, _LocalFile):
                kind, codec = leaf_kind(plan.path)
                yield Leaf(index, None, plan.path, kind, codec, _local_size(plan.path))
            elif isinstance(plan, _RemoteFile):
                kind, codec = leaf_kind(plan.path.rsplit("/", 1)[-1])
                # a remote leaf's `path` only names it: credentials redacted
                yield Leaf(index, None, redact(item), kind, codec, plan.size, plan.fs, plan.path,
                           version=plan.version)
            elif isinstance(plan, RemoteTree):
                for rel in plan.files:
                    if resume is not None and _before(rel, resume):
                        continue
                    kind, codec = leaf_kind(rel[-1])
                    if codec is not None:
                        require_codec(codec, rel[-1])
                    path = plan.path_of(rel)
                    yield Leaf(index, rel, redact(plan.fs.unstrip_protocol(path)), kind, codec,
                               plan.sizes[rel], plan.fs, path, version=plan.versions[rel])
            else:
                for rel in plan.files(resume):
                    kind, codec = leaf_kind(rel[-1])
                    if codec is not None:
                        require_codec(codec, rel[-1])
                    yield Leaf(index, rel, os.path.join(plan.root, *rel), kind, codec)

    def totals(self) -> tuple[int, int | None]:
        """(files, stored bytes) of all inputs; bytes None unless every size is known without
        a request per file (local files named as inputs, remote listings)."""
        leaves = self._leaf_list(None)[1]
        sizes = [leaf.size for leaf in leaves]
        return len(leaves), None if None in sizes else sum(sizes)  # type: ignore[arg-type]

    def records(
        self,
        start: Position | None = None,
        *,
        span: Span | None = None,
        meter: Meter | None = None,
        on_corrupt: Callable[[Leaf, CorruptShardError], None] | None = None,
        after_file: Callable[[Leaf], None] | None = None,
    ) -> Iterator[RawRecord]:
        """Raw records in input order, from `start` on (a position a record began at), or
        those of one part, `span`, from `start` (within it) or its beginning. `after_file`
        is called with each file once its records are read (before the next file's).

        ``.json`` files are read ahead (see the class). A damaged compressed or tar file
        raises CorruptShardError naming it, or, with `on_corrupt`, is reported there and
        the rest of it skipped. A file that cannot be opened raises SourceError.
        """
        meter = meter if meter is not None else Meter()
        if span is None:
            meter.files, leaves = self._leaf_list(start)  # counting the files before `start`
        elif span.begin is None:
            return  # an empty part at the end of the input
        else:
            start = start or span.begin.position()
            leaves = [self._within(leaf, span) for leaf in self._span_leaves(start, span.end)]
        policy = self.retry
        ahead: FilesAhead[Leaf, Fetched] = FilesAhead(
            leaves,
            lambda leaf: fetch_json(leaf, policy),
            wants=lambda leaf: leaf.kind == "json",
            group=lambda leaf: leaf.folder,
            size=lambda fetched: len(fetched.data or b""),
            threads=self.read_ahead,
            max_bytes=self.read_ahead_bytes,
        )
        for leaf, fetched in ahead:
            yield from self._leaf_records(leaf, start, meter, fetched, on_corrupt, span)
            if after_file is not None:
                after_file(leaf)

    def _span_leaves(self, start: Position, end: Cut | None) -> Iterator[Leaf]:
        """The leaves from the one holding `start` up to the one `end` cuts (included when
        the cut lies inside it). Lists only that far, and checks nothing: the plan
        that made the cuts checked every leaf. Inputs listed already (the plan's, in the
        process that made it) are not listed again."""
        at = self._place(start)
        listed = self._leaves(start) if at is None else itertools.islice(self._all or (), at, None)
        for leaf in listed:
            if end is not None and end.holds(leaf):
                if end.offset > 0:
                    yield leaf
                return
            yield leaf

    @staticmethod
    def _within(leaf: Leaf, span: Span) -> Leaf:
        """`leaf`, numbering lines from the part's first byte when the part begins in it."""
        begin = span.begin
        if begin is not None and begin.holds(leaf) and begin.offset > 0 and leaf.kind == "jsonl":
            return replace(leaf, lines_from=begin.offset)
        return leaf

    def _leaf_records(
        self,
        leaf: Leaf,
        start: Position | None,
        meter: Meter,
        fetched: Any,
        on_corrupt: Callable[[Leaf, CorruptShardError], None] | None,
        span: Span | None,
    ) -> Iterator[RawRecord]:
        here = start is not None and start.input == leaf.input and start.file == leaf.rel
        offset, line = (start.offset, start.line) if here and start is not None else (0, 1)
        policy = self.retry
        anchor, stop = (0, 0), None
        if span is not None:
            if span.begin is not None and span.begin.holds(leaf):
                anchor = (span.begin.stored, span.begin.offset)
            if span.end is not None and span.end.holds(leaf):
                stop = span.end.stored
        try:
            if leaf.kind == "json":
                got: Fetched = fetched.result()
                meter.stored_bytes += got.stored
                yield from _json_records(leaf, offset, line, meter, got, policy)
            elif leaf.kind == "tar":
                yield from _read_tar(leaf, offset, meter, policy)
            elif leaf.kind == "rows":
                yield from _read_rows(leaf, offset, meter)
            else:
                yield from _read_jsonl(leaf, offset, line, meter, policy, anchor, stop)
        except CorruptShardError as err:
            if on_corrupt is None:
                raise
            on_corrupt(leaf, err)
        except PERMANENT_ERRORS as err:
            raise SourceError(f"{leaf.path}: cannot read: {err}") from err
        meter.files += 1


def _before(rel: Rel, start: Rel) -> bool:
    """Whether `rel` comes before `start` in a remote tree's order (a resume skips it)."""
    return natural_key("/".join(rel)) < natural_key("/".join(start))


def _local_size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None
