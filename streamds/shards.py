"""Sources -> shards: resolve a path, list, directory, glob or fsspec URL to sorted files.

A `Shard` is one file with what planning needs to know about it: its size, its format
(JSON lines or a tar of JSON members), its codec and, for seekable zstd files, its frames.
Resolving lists and stats files but keeps nothing open, so shards pickle into workers.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import fsspec
from fsspec.core import url_to_fs

from .errors import CorruptShardError
from .formats.codecs import require_codec
from .formats.filenames import RECORD_SUFFIXES, format_of, is_record_name
from .formats.manifest import MANIFEST_NAME, parse_manifest
from .formats.seekable import Frame, SeekTableError, read_seek_table
from .retry import DEFAULT_RETRY, retrying

__all__ = ["Shard", "natural_key", "resolve_shards"]

log = logging.getLogger(__name__)

Source = str | os.PathLike | Sequence[str | os.PathLike]

_GLOB_CHARS = re.compile(r"[*?\[]")


def has_magic(path: str) -> bool:
    """Whether `path` is a glob pattern."""
    return _GLOB_CHARS.search(path) is not None


# Filesystems rebuilt in this process after a fork: fsspec's async ones (HTTP, S3) hold an
# event loop that must not cross a fork, and DataLoader workers are forked by default.
_REBUILT: dict[int, fsspec.AbstractFileSystem] = {}
_forked = False


def _after_fork() -> None:
    global _forked
    _forked = True
    _REBUILT.clear()


os.register_at_fork(after_in_child=_after_fork)


def _process_fs(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """`fs`, or in a forked child an equivalent instance made in this process."""
    if not _forked:
        return fs
    rebuilt = _REBUILT.get(id(fs))
    if rebuilt is None:
        rebuilt = _REBUILT[id(fs)] = pickle.loads(pickle.dumps(fs))
    return rebuilt


@dataclass(frozen=True)
class Shard:
    """One file of the corpus."""

    url: str  # how the user and error messages name it
    path: str  # the path within `fs`
    size: int | None  # stored bytes; None when the storage does not say (some HTTP servers)
    format: str  # "jsonl" or "tar"
    codec: str | None  # "zst", "gz", "bz2", "xz" or None
    frames: tuple[Frame, ...] | None = None  # seekable zstd frames, when the file has a seek table
    frame_records: tuple[int, ...] | None = None  # records per frame, from a manifest
    fs: fsspec.AbstractFileSystem = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    @property
    def decoded_size(self) -> int | None:
        """Decoded bytes when known without reading: plain files and seekable zstd files."""
        if self.codec is None:
            return self.size
        if self.frames is not None:
            return sum(frame.decompressed_size for frame in self.frames)
        return None

    def open_raw(self) -> BinaryIO:
        """The stored bytes, unbuffered by fsspec's read-ahead beyond its default block."""
        return _process_fs(self.fs).open(self.path, mode="rb")


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key putting `part-2` before `part-10`."""
    return tuple(int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", text))


def _in_hidden_folder(found: str, root: str) -> bool:
    """Whether `found` lies in a hidden folder below `root` (Colab's .ipynb_checkpoints)."""
    relative = found[len(root.rstrip("/")) :].strip("/")
    return any(part.startswith(".") for part in relative.split("/")[:-1])


def _url_of(fs: fsspec.AbstractFileSystem, path: str, given: str) -> str:
    if given and not has_magic(given) and "::" in given:
        return given  # chained URL named by the user: keep their spelling
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    return path if protocol in ("file", "local") else fs.unstrip_protocol(path)


def _list_files(item: str, storage_options: dict[str, Any]) -> tuple[Any, list[dict]]:
    """The file infos one source item names: a glob, a directory (recursive) or a file."""
    fs, path = url_to_fs(item, **storage_options)
    if has_magic(path) and not fs.exists(path):  # an existing "train[1].jsonl" is a file
        infos = [i for i in fs.glob(path, detail=True).values() if i.get("type") != "directory"]
        if not infos:
            raise FileNotFoundError(f"no files match the pattern {item!r}; check the glob")
        return fs, infos
    try:
        info = fs.info(path)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"source {item!r} does not exist; check the path or URL") from err
    if info.get("type") != "directory":
        return fs, [info]
    infos = [
        i for i in fs.find(path, detail=True).values()
        if is_record_name(i["name"].rsplit("/", 1)[-1]) and not _in_hidden_folder(i["name"], path)
    ]
    if not infos:
        raise FileNotFoundError(
            f"directory {item!r} has no JSONL files (looked for {', '.join(RECORD_SUFFIXES)}, "
            "plain or with .zst/.gz/.bz2/.xz, at any depth); name files explicitly or with a glob"
        )
    return fs, infos


def _read_frames(fs: fsspec.AbstractFileSystem, path: str, size: int, url: str):
    with fs.open(path, mode="rb") as raw:
        return read_seek_table(raw, size, name=url)


def _frames_of(
    fs: fsspec.AbstractFileSystem, path: str, size: int | None, url: str, on_error: str
) -> tuple[Frame, ...] | None:
    """The seek table of a .zst file (None: a foreign .zst). Transient errors are retried.

    A damaged table raises CorruptShardError, or under on_error="skip" the file is read
    as a plain zstd stream (whole-file block) instead.
    """
    if size is None:
        return None
    try:
        frames = retrying(
            lambda: _read_frames(fs, path, size, url), DEFAULT_RETRY, f"{url}: seek table"
        )
    except SeekTableError as err:
        if on_error == "skip":
            log.warning("%s; reading it as a plain zstd stream", err)
            return None
        raise CorruptShardError(
            f"{url}: damaged seek table ({err}); convert the file again, or pass "
            "on_error='skip' to read it as a plain zstd stream",
            url=url,
            offset=size,
        ) from err
    return tuple(frames) if frames is not None else None


def _manifest_frames(fs: fsspec.AbstractFileSystem, infos: list[dict]) -> dict[str, Any]:
    """path -> (bytes, frames, records per frame) from the manifest.json beside .zst files.

    Saves opening every shard for its seek table. A missing or unreadable manifest is
    skipped (the seek tables are read instead); so is an entry whose size is not the file's.
    """
    known: dict[str, Any] = {}
    parents = {info["name"].rsplit("/", 1)[0] for info in infos if info["name"].endswith(".zst")}
    for parent in sorted(parents):
        try:
            manifest = parse_manifest(fs.cat_file(f"{parent}/{MANIFEST_NAME}"), name=parent)
        except Exception:  # optional: any failure falls back to reading the seek tables
            continue
        if manifest.shard_format == "jsonl.zst":
            for entry in manifest.shards:
                known[f"{parent}/{entry.name}"] = (
                    entry.bytes, entry.seek_frames(), tuple(entry.records_per_frame)
                )
    return known


def _shard_of(
    fs: fsspec.AbstractFileSystem, info: dict, given: str, known: dict, on_error: str
) -> Shard:
    path = info["name"]
    url = _url_of(fs, path, given)
    fmt, codec = format_of(path.rsplit("/", 1)[-1])
    require_codec(codec, url)
    size = info.get("size")
    frames = frame_records = None
    if codec == "zst" and fmt == "jsonl":
        listed = known.get(path)
        if listed is not None and listed[0] == size:
            frames, frame_records = listed[1], listed[2] or None
        else:
            frames = _frames_of(fs, path, size, url, on_error)
    return Shard(
        url=url, path=path, size=size, format=fmt, codec=codec, frames=frames,
        frame_records=frame_records, fs=fs,
    )


def resolve_shards(
    source: Source, storage_options: dict[str, Any] | None = None, *, on_error: str = "raise"
) -> list[Shard]:
    """All files `source` names, in natural order of their URLs.

    `source` is a path, a directory (searched recursively for JSONL-like files), a glob, an
    fsspec URL (chained URLs such as ``simplecache::https://...`` too) or a list of these.
    Raises FileNotFoundError naming the item that matched nothing.
    """
    items: Iterable[str | os.PathLike]
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not items:
        raise ValueError("source is an empty list; pass at least one path, glob or URL")
    options = dict(storage_options or {})
    shards: list[Shard] = []
    for item in items:
        given = os.fspath(item)
        fs, infos = retrying(functools.partial(_list_files, given, options), DEFAULT_RETRY, given)
        known = _manifest_frames(fs, infos)
        shards.extend(_shard_of(fs, info, given, known, on_error) for info in infos)
    shards.sort(key=lambda shard: natural_key(shard.url))
    seen: set[str] = set()
    for shard in shards:
        if shard.url in seen:
            raise ValueError(
                f"source names {shard.url!r} more than once; list each file once so every "
                "record is read exactly once"
            )
        seen.add(shard.url)
    return shards
