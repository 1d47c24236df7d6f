"""Conversion inputs -> raw records, in input order, each with the position it starts at.

An input is a JSONL file (plain, .zst, .gz, .bz2 or .xz; any name but .json and .tar counts
as JSONL, so PubMed's ``train.txt`` is one), a ``.json`` file (one document, possibly
pretty-printed, an array being its elements, or JSON lines: the reader's rule, see
`streamds.formats.documents`), a tar shard (webdataset layout: each ``.json`` member is one
record, each ``.jsonl`` member one record per line), a directory, or a glob. Inputs expand
to *leaves* (single files) lazily:

- a directory or a glob, expanded by the reader's rule (`streamds.formats.trees`): a
  directory names every record-looking file at any depth (``.json``, ``.jsonl``,
  ``.ndjson``, ``.tar``, ``.tgz``, plain or compressed; ``_``-prefixed and ``.tmp`` files and
  ``manifest.json`` skipped); a glob (``data/part_*/*.json``, ``data/**/*.json``) matches
  component by component, only descending into directories that can still match, and a
  pattern without ``**`` whose last component matches a directory takes that directory's
  files. Hidden files and folders (``.ipynb_checkpoints``, dotfiles) are skipped unless a
  pattern spells the dot; symbolic links are followed. Each directory is listed with one
  ``os.scandir`` call and sorted in natural order (``part_2`` before ``part_10``), so
  memory is one listing per level.

One file under two names (a symbolic link, ``d//a.jsonl``, an input listed twice, a file
inside a directory also listed) is refused before a record is read: see `Inputs.leaves`.

A `Position` (input index, path under the input, offset, line) names where a record
begins: the decoded byte offset of its line in a JSONL file (a ``.json`` file of lines too),
its ordinal in a tar shard or an array document, 0 for any other document.
`Inputs.records(start=position)` restarts exactly there, without listing or reading what
lies before beyond one listing per directory level (compressed files decode and discard up
to the offset). This is what makes an interrupted conversion resume.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, NamedTuple

from streamds.errors import CorruptShardError
from streamds.formats.codecs import decode, require_codec, strip_codec
from streamds.formats.documents import LINES, document_records, probe
from streamds.formats.filenames import TAR_LINES_MEMBERS, TAR_RECORD_MEMBERS, format_of
from streamds.formats.trees import (
    Rel,
    Walk,
    canonical_path,
    directory_walk,
    glob_walk,
    has_magic,
)
from streamds.retry import PERMANENT_ERRORS
from streamds.shards import same_file_error, source_items

__all__ = ["Inputs", "Leaf", "Meter", "Position", "RawRecord", "SourceError"]

READ_SIZE = 1 << 20  # raw bytes per read of a JSONL file


class SourceError(ValueError):
    """An input that cannot be read as records: the message names the file and the place."""


@dataclass(frozen=True)
class Leaf:
    """One input file. `rel` is its path under the input's root (None: the input itself)."""

    input: int
    rel: Rel | None
    path: str
    kind: str  # "jsonl", "json" (a document or JSON lines, decided when read) or "tar"
    codec: str | None


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


class RawRecord(NamedTuple):
    """The bytes of one record before parsing, and where they came from."""

    data: bytes
    leaf: Leaf
    offset: int  # decoded byte offset of the line (JSONL), ordinal (tar, array element)
    line: int  # 1-based line number (JSONL), ordinal + 1 (tar, array element), 1 (document)
    member: str | None = None  # tar member name
    element: int | None = None  # the ordinal of an array document's element

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
        return f"{self.leaf.path}: line {self.line}"


class Meter:
    """Reading progress: files finished and stored (raw, possibly compressed) bytes read."""

    def __init__(self) -> None:
        self.files = 0
        self.stored_bytes = 0


class _Counted(io.RawIOBase):
    """A raw file whose reads add to `meter.stored_bytes`."""

    def __init__(self, raw: BinaryIO, meter: Meter) -> None:
        self._raw = raw
        self._meter = meter

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._meter.stored_bytes += len(data)
        return data

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def close(self) -> None:
        self._raw.close()
        super().close()


# -- names -------------------------------------------------------------------------------


def leaf_kind(name: str) -> tuple[str, str | None]:
    """(kind, codec) of a file name: ``x.json.gz`` -> ("json", "gz"), ``x.txt`` -> jsonl."""
    if name.endswith(".json"):  # the common case of a small-file tree, without codec lookups
        return "json", None
    fmt, codec = format_of(name)
    if fmt == "jsonl" and strip_codec(name).endswith(".json"):
        return "json", codec
    return fmt, codec


# -- reading -----------------------------------------------------------------------------


def _read_jsonl(leaf: Leaf, offset: int, line: int, meter: Meter) -> Iterator[RawRecord]:
    raw = _Counted(open(leaf.path, "rb", buffering=0), meter)
    try:
        if leaf.codec is None and offset:
            raw.seek(offset)
        stream = decode(raw, leaf.codec, leaf.path)  # type: ignore[arg-type]
        skip = offset if leaf.codec is not None else 0
        while skip > 0:
            data = stream.read(min(skip, READ_SIZE))
            if not data:
                raise SourceError(
                    f"{leaf.path}: ends before decoded offset {offset}, where the conversion "
                    "stopped; the input changed since, so convert into a new directory"
                )
            skip -= len(data)
        pos = offset
        pending: list[bytes] = []
        while True:
            data = stream.read(READ_SIZE)
            if not data:
                break
            if data.find(b"\n") < 0:
                pending.append(data)
                continue
            pending.append(data)
            lines = b"".join(pending).split(b"\n")
            tail = lines.pop()
            pending = [tail] if tail else []
            for text in lines:
                if text and not text.isspace():
                    yield RawRecord(text, leaf, pos, line)
                pos += len(text) + 1
                line += 1
        tail = b"".join(pending)
        if tail and not tail.isspace():
            yield RawRecord(tail, leaf, pos, line)
    finally:
        raw.close()


def _read_json_file(leaf: Leaf, meter: Meter) -> bytes | None:
    """A ``.json`` file's whole document, or None when it is JSON lines (read as such), by
    the reader's rule (`streamds.formats.documents`). Only a document's bytes are metered
    here: a file of lines is metered as it is read."""
    probed = Meter()
    with open(leaf.path, "rb", buffering=0) as f:
        raw = _Counted(f, probed)  # type: ignore[arg-type]
        stream: Any = raw
        if leaf.codec is not None:
            stream = decode(raw, leaf.codec, leaf.path)  # type: ignore[arg-type]
        found, head = probe(stream.read)
        if found == LINES:
            return None
        data = b"".join([head, *iter(lambda: stream.read(READ_SIZE), b"")])
    meter.stored_bytes += probed.stored_bytes
    return data


def _json_records(
    leaf: Leaf, offset: int, line: int, meter: Meter, document: bytes | None
) -> Iterator[RawRecord]:
    """The records of a ``.json`` leaf from `offset` (a byte offset in a file of lines, an
    element's ordinal in an array document); `document` is its bytes when already read."""
    if document is None:
        yield from _read_jsonl(replace(leaf, kind="jsonl"), offset, line, meter)
        return
    records, is_array = document_records(document)
    if not is_array:
        yield RawRecord(records[0], leaf, 0, 1)
        return
    for ordinal in range(offset, len(records)):
        yield RawRecord(records[ordinal], leaf, ordinal, ordinal + 1, element=ordinal)


def _read_tar(leaf: Leaf, first: int, meter: Meter) -> Iterator[RawRecord]:
    raw = _Counted(open(leaf.path, "rb", buffering=0), meter)
    stream = io.BufferedReader(decode(raw, leaf.codec, leaf.path), READ_SIZE)  # type: ignore[arg-type]
    ordinal = 0
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                if member.name.endswith(TAR_RECORD_MEMBERS):
                    if ordinal < first:
                        ordinal += 1
                        continue
                    records = [_member_bytes(tar, member)]
                elif member.name.endswith(TAR_LINES_MEMBERS):
                    records = _member_bytes(tar, member).split(b"\n")
                    records = [r for r in records if r and not r.isspace()]
                else:
                    continue
                for data in records:
                    if ordinal >= first:
                        yield RawRecord(data, leaf, ordinal, ordinal + 1, member.name)
                    ordinal += 1
    except tarfile.TarError as err:
        raise CorruptShardError(
            f"{leaf.path}: not a readable tar file after record {ordinal}: {err}",
            url=leaf.path,
            offset=ordinal,
        ) from err
    finally:
        stream.close()


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    extracted = tar.extractfile(member)
    return extracted.read() if extracted is not None else b""


# -- inputs ------------------------------------------------------------------------------


class Inputs:
    """The conversion inputs, in the order given; each expands to leaves lazily.

    Raises FileNotFoundError at construction for a path that does not exist or a glob whose
    fixed directory does not exist. `exclude` names a directory never walked into (the
    conversion's output, when it lies inside an input directory).

    >>> inputs = Inputs(["data/train.txt", "data/small/"])      # doctest: +SKIP
    >>> next(inputs.records()).where                            # doctest: +SKIP
    'data/train.txt: line 1'
    """

    def __init__(self, items: Any) -> None:
        if isinstance(items, (list, tuple)) and not items:
            raise ValueError("no inputs given; name JSONL files, directories, globs or tar files")
        self.items = tuple(source_items(items, name="inputs"))
        self._exclude: set[tuple[int, int]] = set()
        self._walks: list[Walk | None] = []
        self._checked = False  # every file was found under one name only
        for item in self.items:
            self._walks.append(self._plan(item))

    def exclude(self, directory: str | os.PathLike) -> None:
        """Never walk into `directory` (an existing one): the output, when inside an input."""
        info = os.stat(directory)
        self._exclude.add((info.st_dev, info.st_ino))

    def _plan(self, item: str) -> Walk | None:
        if os.path.exists(item) and not os.path.isdir(item):
            _kind, codec = leaf_kind(item)
            require_codec(codec, item)
            return None
        if os.path.isdir(item):
            return directory_walk(item, self._exclude)
        if has_magic(item):
            walk = glob_walk(item, self._exclude)
            if not os.path.isdir(walk.root or "."):
                raise FileNotFoundError(f"no files match {item!r}: {walk.root!r} is no directory")
            return walk
        raise FileNotFoundError(f"input {item!r} does not exist; check the path")

    def leaves(self, start: Position | None = None) -> Iterator[Leaf]:
        """Every input file in order, from the one holding `start` on.

        The first call lists every input once to refuse a file found under two names
        (ValueError from `same_file_error`), before a record is read.
        """
        if not self._checked:
            self._check_identities()
        return self._leaves(start)

    def _check_identities(self) -> None:
        """Raise ValueError when two leaves are one file (its real path), whatever the names."""
        named: dict[str, str] = {}
        real_dirs: dict[str, str] = {}
        for leaf in self._leaves(None):
            real = canonical_path(leaf.path, is_link=os.path.islink(leaf.path),
                                  real_dirs=real_dirs)
            if real in named:
                raise same_file_error(named[real], leaf.path, real, named_by="the inputs name")
            named[real] = leaf.path
        self._checked = True

    def _leaves(self, start: Position | None) -> Iterator[Leaf]:
        first = 0 if start is None else start.input
        for index in range(first, len(self.items)):
            item, walk = self.items[index], self._walks[index]
            if walk is None:
                kind, codec = leaf_kind(item)
                yield Leaf(index, None, item, kind, codec)
                continue
            resume = start.file if start is not None and index == start.input else None
            for rel in walk.files(resume):
                kind, codec = leaf_kind(rel[-1])
                if codec is not None:
                    require_codec(codec, rel[-1])
                yield Leaf(index, rel, os.path.join(walk.root, *rel), kind, codec)

    def stored_size(self) -> tuple[int, int]:
        """(files, stored bytes) of all inputs: a listing and a stat per file, no reads."""
        files = size = 0
        for leaf in self.leaves():
            files += 1
            try:
                info = os.stat(leaf.path)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                size += info.st_size
        return files, size

    def records(
        self,
        start: Position | None = None,
        *,
        meter: Meter | None = None,
        prefetch: int = 0,
        on_corrupt: Callable[[Leaf, CorruptShardError], None] | None = None,
    ) -> Iterator[RawRecord]:
        """Raw records in input order, from `start` on (a position a record began at).

        With `prefetch` > 0, that many threads read ``.json`` files ahead of the consumer
        (a bounded window, results in order): small files on network storage are latency
        bound, not CPU bound. A damaged compressed or tar file raises CorruptShardError
        naming it, or, with `on_corrupt`, is reported there and the rest of it skipped.
        A file that cannot be opened raises SourceError.
        """
        meter = meter if meter is not None else Meter()
        leaves = self.leaves(start)
        if prefetch <= 0:
            for leaf in leaves:
                yield from self._leaf_records(leaf, start, meter, None, on_corrupt)
            return
        window: deque[tuple[Leaf, Future[bytes | None] | None]] = deque()
        with ThreadPoolExecutor(prefetch, thread_name_prefix="streamds-read") as pool:
            try:
                for leaf in leaves:
                    doc = pool.submit(_read_json_file, leaf, meter) if leaf.kind == "json" else None
                    window.append((leaf, doc))
                    while len(window) > 8 * prefetch or (window and window[-1][1] is None):
                        head, future = window.popleft()
                        yield from self._leaf_records(head, start, meter, future, on_corrupt)
                while window:
                    head, future = window.popleft()
                    yield from self._leaf_records(head, start, meter, future, on_corrupt)
            finally:
                for _, future in window:
                    if future is not None:
                        future.cancel()

    @staticmethod
    def _leaf_records(
        leaf: Leaf,
        start: Position | None,
        meter: Meter,
        doc: Future[bytes | None] | None,
        on_corrupt: Callable[[Leaf, CorruptShardError], None] | None,
    ) -> Iterator[RawRecord]:
        here = start is not None and start.input == leaf.input and start.file == leaf.rel
        offset, line = (start.offset, start.line) if here and start is not None else (0, 1)
        try:
            if leaf.kind == "json":
                document = doc.result() if doc is not None else _read_json_file(leaf, meter)
                yield from _json_records(leaf, offset, line, meter, document)
            elif leaf.kind == "tar":
                yield from _read_tar(leaf, offset, meter)
            else:
                yield from _read_jsonl(leaf, offset, line, meter)
        except CorruptShardError as err:
            if on_corrupt is None:
                raise
            on_corrupt(leaf, err)
        except PERMANENT_ERRORS as err:
            raise SourceError(f"{leaf.path}: cannot read: {err}") from err
        meter.files += 1
