"""The shard manifest: `manifest.json` beside converted shards, and checks against it.

The converter writes it last, atomically, listing only complete shards. Layout (format
version 1; one shard per line so a diff or `grep` reads it)::

    {
      "format": "streamds.manifest", "version": 1,
      "shard_format": "jsonl.zst" | "tar",
      "checksum": "xxh64",              # algorithm of every shard's "checksum": hex digest
      "totals": {"shards", "records", "bytes", "decoded_bytes", "frames"},
      "counts": {"records_in", "records_out", "dropped", "bad", "input_bytes"},
      "options": {...},                 # the conversion options that shape the output
      "inputs": ["data/train.txt", ...],
      "shards": [
        {"name": "shard-000000.jsonl.zst", "bytes": 1234, "decoded_bytes": 5678,
         "records": 10, "checksum": "0123456789abcdef", "frames": 2,
         "records_per_frame": [6, 4], "frame_sizes": [[700, 3000], [534, 2678]]},
        ...
      ]
    }

`frame_sizes` is the seek table as (compressed, decompressed) bytes per frame, so a reader
can plan frame blocks without opening each shard. Tar shards have no frames (`frames` 0).
Nothing time-dependent goes in: the same input and options give the same bytes. A shard's
`name` is a path relative to the manifest's directory: a file name, or for a conversion in
parts ``part-00003/shard-000000.jsonl.zst`` (shards listed in part order).
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from . import values
from .filenames import MANIFEST_NAME, TAR_RECORD_MEMBERS
from .seekable import Frame, SeekTableError, decompress_frames, read_seek_table

__all__ = [
    "CHECKSUM_ALGORITHM",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "SHARD_FORMATS",
    "ForeignManifestError",
    "ListingCheck",
    "Manifest",
    "ManifestError",
    "MissingShardError",
    "ShardEntry",
    "check_listing",
    "file_checksum",
    "parse_manifest",
    "read_manifest",
    "verify_shard",
    "write_manifest",
]

MANIFEST_FORMAT = "streamds.manifest"
MANIFEST_VERSION = 1
CHECKSUM_ALGORITHM = "xxh64"
SHARD_FORMATS = ("jsonl.zst", "tar")

_READ_SIZE = 1 << 20


class ManifestError(ValueError):
    """A manifest that cannot be read: bad JSON, wrong format or version, missing fields."""


class ForeignManifestError(ManifestError):
    """A `manifest.json` that some other tool wrote (no streamds format field)."""


class MissingShardError(FileNotFoundError):
    """A shard that a manifest lists is not there: reading the rest would lose its records."""


@dataclass(frozen=True)
class ShardEntry:
    """One complete shard as the manifest lists it."""

    name: str
    bytes: int  # stored size of the file
    decoded_bytes: int  # JSONL bytes after decompression (tar: the file size)
    records: int
    checksum: str  # CHECKSUM_ALGORITHM hex digest of the stored file
    records_per_frame: tuple[int, ...] = ()
    frame_sizes: tuple[tuple[int, int], ...] = ()  # (compressed, decompressed) per frame

    @property
    def frames(self) -> int:
        return len(self.frame_sizes)

    def seek_frames(self) -> tuple[Frame, ...]:
        """The frame table as `streamds.formats.seekable.Frame`s, offsets included."""
        frames = []
        compressed = decompressed = 0
        for compressed_size, decompressed_size in self.frame_sizes:
            frames.append(Frame(compressed, compressed_size, decompressed, decompressed_size))
            compressed += compressed_size
            decompressed += decompressed_size
        return tuple(frames)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": self.bytes,
            "decoded_bytes": self.decoded_bytes,
            "records": self.records,
            "checksum": self.checksum,
            "frames": self.frames,
            "records_per_frame": list(self.records_per_frame),
            "frame_sizes": [list(pair) for pair in self.frame_sizes],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], *, where: str = "manifest") -> ShardEntry:
        try:
            entry = cls(
                name=data["name"],
                bytes=data["bytes"],
                decoded_bytes=data["decoded_bytes"],
                records=data["records"],
                checksum=data["checksum"],
                records_per_frame=tuple(data["records_per_frame"]),
                frame_sizes=tuple((int(c), int(d)) for c, d in data["frame_sizes"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ManifestError(f"{where}: shard entry {data!r} is malformed: {err!r}") from err
        if data["frames"] != entry.frames or len(entry.records_per_frame) != entry.frames:
            raise ManifestError(
                f"{where}: shard {entry.name}: frames={data['frames']} but "
                f"{len(entry.frame_sizes)} frame sizes and {len(entry.records_per_frame)} "
                "record counts; the manifest was edited or damaged"
            )
        if any(not part or part.startswith(".") for part in entry.name.split("/")):
            raise ManifestError(
                f"{where}: shard name {entry.name!r} must be a file name, or a relative path of "
                "plain names (a conversion in parts: part-00003/shard-000000.jsonl.zst)"
            )
        return entry


@dataclass(frozen=True)
class Manifest:
    """What a converted directory holds. `totals` derive from `shards`."""

    shard_format: str
    shards: tuple[ShardEntry, ...]
    counts: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()

    @property
    def totals(self) -> dict[str, int]:
        return {
            "shards": len(self.shards),
            "records": sum(s.records for s in self.shards),
            "bytes": sum(s.bytes for s in self.shards),
            "decoded_bytes": sum(s.decoded_bytes for s in self.shards),
            "frames": sum(s.frames for s in self.shards),
        }

    def to_bytes(self) -> bytes:
        """The manifest file's bytes: indented header, one shard entry per line."""
        head = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "shard_format": self.shard_format,
            "checksum": CHECKSUM_ALGORITHM,
            "totals": self.totals,
            "counts": self.counts,
            "options": self.options,
            "inputs": list(self.inputs),
        }
        parts = [b'  "%s": %s' % (key.encode(), orjson.dumps(value)) for key, value in head.items()]
        entries = b",\n".join(b"    " + orjson.dumps(s.to_json()) for s in self.shards)
        parts.append(b'  "shards": [\n' + entries + b"\n  ]" if entries else b'  "shards": []')
        return b"{\n" + b",\n".join(parts) + b"\n}\n"


def parse_manifest(data: bytes, *, name: str = MANIFEST_NAME) -> Manifest:
    """A Manifest from the file's bytes; ManifestError names `name` and what is wrong."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        raise ManifestError(f"{name}: not valid JSON ({err}); convert the shards again") from err
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ForeignManifestError(
            f"{name}: not a streamds manifest (no format {MANIFEST_FORMAT!r})"
        )
    if doc.get("version") != MANIFEST_VERSION:
        raise ManifestError(
            f"{name}: manifest version {doc.get('version')!r}, this streamds reads version "
            f"{MANIFEST_VERSION}; upgrade streamds or convert the shards again"
        )
    if doc.get("checksum") != CHECKSUM_ALGORITHM:
        raise ManifestError(
            f"{name}: checksum algorithm {doc.get('checksum')!r} is not {CHECKSUM_ALGORITHM!r}"
        )
    try:
        shard_format = doc["shard_format"]
        shards = tuple(ShardEntry.from_json(s, where=name) for s in doc["shards"])
        manifest = Manifest(
            shard_format=shard_format,
            shards=shards,
            counts=dict(doc["counts"]),
            options=dict(doc["options"]),
            inputs=tuple(doc["inputs"]),
        )
    except (KeyError, TypeError) as err:
        raise ManifestError(f"{name}: missing or malformed field {err}") from err
    if shard_format not in SHARD_FORMATS:
        raise ManifestError(f"{name}: shard_format {shard_format!r} is not one of {SHARD_FORMATS}")
    names = [s.name for s in shards]
    if len(set(names)) != len(names):
        raise ManifestError(f"{name}: a shard is listed twice; the manifest was edited")
    return manifest


@dataclass(frozen=True)
class ListingCheck:
    """How a manifest and the files in its folder disagree (all empty: they agree)."""

    missing: tuple[ShardEntry, ...]  # listed, not there
    resized: tuple[tuple[ShardEntry, int], ...]  # listed with another size: (entry, size)
    unlisted: tuple[str, ...]  # record files directly in the folder, not listed


def check_listing(manifest: Manifest, files: Mapping[str, int | None]) -> ListingCheck:
    """Compare `manifest` with `files`: the record files a listing found below its folder,
    as {path relative to the folder ("/"-separated): size, None when unknown}.

    Files in subfolders count as unlisted only when the manifest lists none there (a
    conversion in parts lists ``part-00003/...``; another folder is another corpus).
    """
    listed = {entry.name for entry in manifest.shards}
    folders = {name.rsplit("/", 1)[0] for name in listed if "/" in name}
    missing = tuple(entry for entry in manifest.shards if entry.name not in files)
    resized = tuple(
        (entry, size) for entry in manifest.shards
        if (size := files.get(entry.name)) is not None and size != entry.bytes
    )
    unlisted = tuple(
        name for name in files
        if name not in listed and ("/" not in name or name.rsplit("/", 1)[0] in folders)
    )
    return ListingCheck(missing, resized, unlisted)


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest at `path`, or in the directory `path`."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    return parse_manifest(path.read_bytes(), name=str(path))


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> Path:
    """Write `directory/manifest.json` atomically (temp file, fsync, rename); return its path."""
    path = Path(directory) / MANIFEST_NAME
    _write_atomic(path, manifest.to_bytes())
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_checksum(path: str | os.PathLike) -> str:
    """The CHECKSUM_ALGORITHM (xxh64, seed 0) hex digest of a file, read in 1 MiB pieces."""
    import xxhash

    digest = xxhash.xxh64()
    with open(path, "rb") as f:
        while data := f.read(_READ_SIZE):
            digest.update(data)
    return digest.hexdigest()


# -- verification ------------------------------------------------------------------------


def verify_shard(directory: str | os.PathLike, entry: ShardEntry, shard_format: str) -> list[str]:
    """Re-read one shard against its entry; return the problems found (empty: intact).

    Checks, in order: the file exists with the listed size and checksum; for seekable zstd
    shards the seek table equals `frame_sizes`, every frame decodes to its size and holds
    `records_per_frame` lines; every record parses as JSON. Reads the whole shard once.
    """
    path = Path(directory) / entry.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [f"{entry.name}: missing"]
    problems = []
    if size != entry.bytes:
        problems.append(f"{entry.name}: {size} bytes, the manifest says {entry.bytes}")
    checksum = file_checksum(path)
    if checksum != entry.checksum:
        problems.append(
            f"{entry.name}: {CHECKSUM_ALGORITHM} checksum {checksum}, the manifest says "
            f"{entry.checksum}"
        )
    if entry.frames and sum(entry.records_per_frame) != entry.records:
        problems.append(
            f"{entry.name}: the manifest says records={entry.records} but its frames hold "
            f"{sum(entry.records_per_frame)} (records_per_frame)"
        )
    check = _verify_zstd if shard_format == "jsonl.zst" else _verify_tar
    problems.extend(check(path, entry, size))
    return problems


def _bad_records(lines: Sequence[bytes]) -> Iterator[tuple[int, Exception]]:
    loads = orjson.loads
    try:
        for _ in map(loads, lines):
            pass
        return
    except orjson.JSONDecodeError:
        pass
    for index, line in enumerate(lines):
        try:
            values.loads(line)  # a lone surrogate escape, as convert writes it, is no damage
        except orjson.JSONDecodeError as err:
            yield index, err


def _verify_zstd(path: Path, entry: ShardEntry, size: int) -> list[str]:
    name = entry.name
    with open(path, "rb") as f:
        try:
            frames = read_seek_table(f, size, name=name)
        except SeekTableError as err:
            return [str(err)]
        if frames is None:
            return [f"{name}: no seek table at the end of the file; truncated or not seekable"]
        table = tuple((fr.compressed_size, fr.decompressed_size) for fr in frames)
        if table != entry.frame_sizes:
            return [
                f"{name}: seek table lists {len(table)} frames that differ from the "
                f"manifest's {entry.frames}"
            ]
        problems = []
        line_number = 0
        try:
            for index, data in enumerate(decompress_frames(f, frames, name=name)):
                if data and not data.endswith(b"\n"):
                    problems.append(f"{name}: frame {index} does not end with a newline")
                lines = data.split(b"\n")[:-1] if data else []
                if len(lines) != entry.records_per_frame[index]:
                    problems.append(
                        f"{name}: frame {index} holds {len(lines)} records, the manifest says "
                        f"{entry.records_per_frame[index]}"
                    )
                for bad, err in _bad_records(lines):
                    problems.append(f"{name}: line {line_number + bad + 1}: invalid JSON ({err})")
                    break
                line_number += len(lines)
        except SeekTableError as err:
            problems.append(str(err))
    return problems


def _verify_tar(path: Path, entry: ShardEntry, size: int) -> list[str]:
    name = entry.name
    records = 0
    problems = []
    try:
        with open(path, "rb") as raw, tarfile.open(fileobj=raw, mode="r|") as tar:
            for member in tar:
                if not member.isfile() or not member.name.endswith(TAR_RECORD_MEMBERS):
                    continue
                extracted = tar.extractfile(member)
                data = extracted.read() if extracted is not None else b""
                records += 1
                for _, err in _bad_records([data]):
                    problems.append(f"{name}: member {member.name}: invalid JSON ({err})")
    except (tarfile.TarError, OSError, EOFError) as err:
        return [*problems, f"{name}: not a readable tar file: {err}"]
    if records != entry.records:
        problems.append(f"{name}: holds {records} records, the manifest says {entry.records}")
    return problems
