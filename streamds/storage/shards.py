"""Sources -> shards: resolve a path, list, directory, glob or fsspec URL to sorted files.

A `Shard` is one file with what planning needs to know about it: its size, its format
(a `streamds.formats.registry` format object, settled when the file is resolved: JSON lines,
seekable zstd JSON lines, a tar of JSON members, a ``.json`` file read whole ...), its codec
and, for seekable zstd files, its frames. Resolving lists and stats files but keeps nothing
open, so shards pickle into workers.

A folder listing also checks what it found against any `manifest.json` in the folder (a
listed shard that is missing is an error: its records would be lost), reports the files it
left out and why (a debug log record; a warning for data in formats streamds does not read),
and warns when two files it found look like copies of each other (their records would come
twice). Only the heads of such pairs are read.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import fsspec
from fsspec.core import url_to_fs

from ..formats.codecs import codec_of, decode, require_codec, strip_codec
from ..formats.filenames import (
    RECORD_SUFFIXES,
    copy_of,
    foreign_format,
    foreign_hint,
    sibling_key,
)
from ..formats.manifest import (
    MANIFEST_NAME,
    ForeignManifestError,
    ManifestError,
    MissingShardError,
    check_listing,
    parse_manifest,
)
from ..formats.protocol import FileFacts, Format
from ..formats.registry import named, of_file
from ..formats.registry import named as format_named
from ..formats.seekable import Frame
from ..formats.trees import (
    LeftOut,
    canonical_path,
    directory_walk,
    glob_walk,
    has_magic,
    natural_key,
    remote_is_folder,
    remote_record_files,
)
from ..formats.unfinished import check_finished
from ..redact import guard_loggers, guard_source, redact, safe_cause, scrubbed
from ..retry import DEFAULT_RETRY, RetryPolicy, lookup_error, option_error, retrying
from .range_probe import RangeAnswers

__all__ = [
    "Listing",
    "Shard",
    "canonical_path",
    "check_options",
    "has_magic",
    "list_source",
    "natural_key",
    "process_fs",
    "resolve_shards",
    "same_file_error",
    "source_items",
    "stat_shard",
    "unsplit_note",
    "with_columns",
]

log = logging.getLogger(__name__)
guard_loggers()  # fsspec and its kin log the URLs they are given: credentials redacted

Source = str | os.PathLike | Sequence[str | os.PathLike]

# Filesystems rebuilt in this process after a fork: fsspec's async ones (HTTP, S3) hold an
# event loop that must not cross a fork, and DataLoader workers are forked by default.
_REBUILT: dict[int, fsspec.AbstractFileSystem] = {}
_forked = False


def _after_fork() -> None:
    global _forked
    _forked = True
    _REBUILT.clear()


os.register_at_fork(after_in_child=_after_fork)


def process_fs(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
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

    url: str  # how messages, sorting and the cache name it: credentials redacted (`redact`)
    path: str = field(repr=False)  # the path within `fs` (a URL's credentials included)
    size: int | None  # stored bytes; None when the storage does not say (some HTTP servers)
    # how the file is read (`streamds.formats.registry`); a name given here is looked up
    format: Format
    codec: str | None  # "zst", "gz", "bz2", "xz" or None
    frames: tuple[Frame, ...] | None = None  # seekable zstd frames, when the file has a seek table
    frame_records: tuple[int, ...] | None = None  # records per frame, from a manifest
    checksum: str | None = None  # the manifest's xxh64 hex digest of the stored file
    layout: Any = None  # what else the format read to cut blocks (`Settled.layout`)
    columns: tuple[str, ...] | None = None  # Parquet and Arrow files: the columns read (None: all)
    # what the storage said identifies this content (ETag, Last-Modified, mtime: `_version_of`)
    version: str | None = field(default=None, compare=False)
    # the storage serves parts of the file (False: an HTTP server that ignores Range; the
    # file is then one block, read as one stream: `range_probe`)
    ranged: bool = field(default=True, compare=False)
    fs: fsspec.AbstractFileSystem = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if isinstance(self.format, str):
            object.__setattr__(self, "format", named(self.format))
        self.format.check(self)

    @property
    def decoded_size(self) -> int | None:
        """Decoded bytes when known without reading: plain files and seekable zstd files."""
        if self.codec is None:
            return self.size
        if self.frames is not None:
            return sum(frame.decompressed_size for frame in self.frames)
        return None

    @property
    def frames_end_lines(self) -> bool:
        """Whether every frame ends a line: true of shards `streamds convert` wrote (their
        manifest lists records per frame); other seekable files may cut lines."""
        return self.frames is not None and self.frame_records is not None

    def open_raw(self) -> BinaryIO:
        """The stored bytes, unbuffered by fsspec's read-ahead beyond its default block."""
        return process_fs(self.fs).open(self.path, mode="rb")


# the shards this process listed, by URL, while a dataset holds them: a message about a line
# of a remote file, made where only its URL travelled (the main process parsing a worker's
# lines), counts the line through them (their storage options stay in memory, never sent)
_LISTED: weakref.WeakValueDictionary[str, Shard] = weakref.WeakValueDictionary()


def listed_shard(url: str) -> Shard | None:
    """The shard this process listed under `url` (credentials redacted, as `Shard.url`), while
    something still holds it; None otherwise."""
    return _LISTED.get(url)


def _url_of(fs: fsspec.AbstractFileSystem, path: str, given: str) -> str:
    """How messages name the file: the user's spelling, credentials redacted."""
    if given and not has_magic(given) and "::" in given:
        return redact(given)  # chained URL named by the user: keep their spelling
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    return path if protocol in ("file", "local") else redact(fs.unstrip_protocol(path))


# What the storage says identifies a file's content, most specific first: an object store's
# ETag or generation, the Hugging Face Hub's git blob id, an HTTP server's ETag or
# Last-Modified, a local file's modification time, an in-memory file's creation time
_VERSION_KEYS = ("etag", "generation", "version_id", "blob_id", "last-modified",
                 "lastmodified", "last_modified", "updated", "mtime", "created")


def _version_of(info: dict) -> str | None:
    """The validators the storage gave for a file (None: it gave none), for the cache to tell a
    changed file from its stale copy when no manifest checksum does."""
    lowered = {str(key).lower(): value for key, value in info.items()}
    found = [f"{key}={lowered[key]}" for key in _VERSION_KEYS if lowered.get(key) is not None]
    return " ".join(found) or None


def stat_shard(shard: Shard) -> tuple[int | None, str | None]:
    """(size, version) the storage gives for `shard` now, as `Shard` holds them from the
    listing: one stat (a HEAD request remotely)."""
    info = process_fs(shard.fs).info(shard.path)
    return info.get("size"), _version_of(info)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    return protocol in ("file", "local")


def _local_info(fs: fsspec.AbstractFileSystem, path: str, item: str) -> dict:
    """The info of a file a local walk found (a symbolic link: of what it points to)."""
    try:
        return fs.info(path)
    except FileNotFoundError as err:
        target = os.readlink(path) if os.path.islink(path) else None
        if target is None:
            raise
        raise FileNotFoundError(
            f"{path!r} (found under source {item!r}) is a broken symbolic link to {target!r}; "
            "remove it or restore its target"
        ) from err


def _remote_files(
    fs: fsspec.AbstractFileSystem, path: str, glob: bool, left_out: LeftOut,
    storage_options: dict[str, Any],
) -> list[dict]:
    """The record files of a remote directory or glob, by the rule of `formats.trees`."""
    _, found = remote_record_files(fs, path, glob, left_out)
    # an HTTP listing gives names without sizes: ask each file once (a HEAD), here in the
    # constructor, so blocks can be cut and requests stop at the file's end
    return [_remote_info(fs, name, storage_options) if info.get("size") is None else info
            for name, info in found.items()]


def _remote_info(fs: fsspec.AbstractFileSystem, name: str, storage_options: dict[str, Any]
                 ) -> dict:
    try:
        return fs.info(name)
    except FileNotFoundError as err:  # a listed file refused or gone: say which and why
        shown = f"listed file {redact(fs.unstrip_protocol(name))!r}"
        raise lookup_error(shown, storage_options, err) from safe_cause(err)


def _before_query(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """`path` without an HTTP URL's query (a presigned URL's "?" is no wildcard)."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return path.partition("?")[0] if {"http", "https"} & protocols else path


@dataclass
class _Found:
    """What one source item names: its files' infos, and for a folder or glob what the
    listing left out (None for a file named itself)."""

    fs: fsspec.AbstractFileSystem
    infos: list[dict]
    left_out: LeftOut | None


def _list_files(item: str, storage_options: dict[str, Any]) -> _Found:
    """The file infos one source item names: a glob, a directory (recursive) or a file.

    Directories and globs expand by the one rule of `streamds.formats.trees` (hidden names
    skipped unless spelled out, symbolic links followed), as the converter expands them.
    """
    shown = redact(item)
    try:
        fs, path = url_to_fs(item, **storage_options)
    except ImportError as err:  # fsspec's hf:// needs huggingface_hub
        if not item.startswith("hf://"):
            raise
        raise ImportError(f"source {shown!r} is on the Hugging Face Hub, which needs "
                          "huggingface_hub; install it with pip install 'streamds[hub]'"
                          ) from err
    except TypeError as err:
        if not storage_options:
            raise
        raise option_error(f"source {shown!r}", storage_options, err) from safe_cause(err)
    # an existing "train[1].jsonl" is a file; so is an HTTP URL whose "?" starts its query
    glob = has_magic(_before_query(fs, path)) and not fs.exists(path)
    if not glob:
        try:
            info = fs.info(path)
        except FileNotFoundError as err:
            raise lookup_error(f"source {shown!r}", storage_options, err) from safe_cause(err)
        if info.get("type") != "directory" and (
            _is_local(fs) or not remote_is_folder(fs, path, info)
        ):
            return _Found(fs, [info], None)
    left_out = LeftOut()
    if _is_local(fs):
        walk = (glob_walk if glob else directory_walk)(path, left_out=left_out)
        try:
            rels = list(walk.files())
        except FileNotFoundError:  # the glob's fixed directory does not exist
            rels = []
        infos = [_local_info(fs, os.path.join(walk.root, *rel), item) for rel in rels]
    else:
        infos = _remote_files(fs, path, glob, left_out, storage_options)
    if left_out.markers:  # a conversion that stopped: its shards hold only some records
        check_finished(left_out.markers, left_out.manifests, fs.cat_file,
                       lambda folder: folder if _is_local(fs) else redact(folder))
    if not infos and glob:
        raise FileNotFoundError(
            f"no files match the pattern {shown!r}; check the glob (wildcards skip hidden "
            "names such as .ipynb_checkpoints unless the pattern spells the dot)"
            + (f"; left out: {left_out.summary()}" if left_out else "")
        )
    if not infos:  # a converted folder whose shards are all gone: name them
        _check_manifests(item, _Found(fs, infos, left_out))
    foreign = [path for path, _ in left_out.examples if foreign_format(path) is not None]
    if not infos and foreign:
        kind = foreign_format(foreign[0]) or ""
        raise FileNotFoundError(
            f"directory {shown!r} has no JSON lines files but {len(foreign)} file(s) in a format "
            f"streamds does not read ({', '.join(map(repr, foreign[:5]))}): "
            f"{foreign_hint(kind)}; left out: {left_out.summary()}"
        )
    if not infos:
        raise FileNotFoundError(
            f"directory {shown!r} has no JSONL files (looked for {', '.join(RECORD_SUFFIXES)}, "
            "plain or with .zst/.gz/.bz2/.xz, in any case, at any depth; hidden folders such as "
            ".ipynb_checkpoints skipped); name files explicitly or with a glob"
            + (f"; left out: {left_out.summary()}" if left_out else "")
        )
    return _Found(fs, infos, left_out)


def _report_left_out(item: str, left_out: LeftOut) -> None:
    """Log what the listing of `item` left out: every reason at debug level, and a warning
    when files in a data format streamds does not read were passed over."""
    if not left_out:
        return
    item = redact(item)
    log.debug("listing %r left out %d files and folders: %s", item, len(left_out),
              redact(left_out.summary(limit=left_out.keep)))
    foreign = [path for path, _ in left_out.examples if foreign_format(path) is not None]
    if foreign:
        kinds = sorted({foreign_format(path) or "" for path in foreign})
        log.warning(
            "listing %r left out %s file(s) (%s): %s", item, " and ".join(kinds),
            redact(", ".join(map(repr, foreign[:5])) + (" ..." if len(foreign) > 5 else "")),
            foreign_hint(kinds[0]),
        )


def _check_manifests(item: str, found: _Found) -> None:
    """Compare each streamds manifest a folder listing passed with the files it found.

    A listed shard that is missing raises MissingShardError naming it (its records would be
    lost without a word); listed shards of another size and record files the manifest does
    not list are read as found, with a warning naming them.
    """
    if found.left_out is None or not found.left_out.manifests:
        return
    fs = found.fs
    sizes = {fs._strip_protocol(info["name"]): info.get("size") for info in found.infos}
    for path in found.left_out.manifests:
        folder = fs._strip_protocol(path).rsplit("/", 1)[0]
        shown = _url_of(fs, folder, item)  # the folder as messages name it
        try:
            manifest = parse_manifest(fs.cat_file(path), name=f"{shown}/{MANIFEST_NAME}")
        except ForeignManifestError:
            continue  # another tool's manifest.json: nothing to check against
        except (ManifestError, OSError) as err:
            log.warning("%s; the files beside it are read as found (run `streamds verify %s` "
                        "to check them)", err, shown)
            continue
        files = {name[len(folder) + 1 :]: size for name, size in sizes.items()
                 if name.startswith(folder + "/")}
        check = check_listing(manifest, files)
        if check.missing:
            first = check.missing[0]
            more = (f" (and {len(check.missing) - 1} more: "
                    f"{', '.join(e.name for e in check.missing[1:6])})"
                    if len(check.missing) > 1 else "")
            raise MissingShardError(
                f"{shown}/{first.name} is listed in {shown}/{MANIFEST_NAME} "
                f"({first.records:,} records) but missing{more}; reading the rest would "
                "silently lose its records. Restore the file or convert again, and run "
                f"`streamds verify {shown}` to check the other shards"
            )
        if check.resized:
            log.warning(
                "%s lists %s; the manifest is stale, the files are read as they are (run "
                "`streamds verify %s`)", f"{shown}/{MANIFEST_NAME}",
                ", ".join(f"{e.name} with {e.bytes} bytes, the file has {size}"
                          for e, size in check.resized[:5]), shown,
            )
        if check.unlisted:
            log.warning(
                "%s does not list %d record file(s) beside it (%s); they are read too. If they "
                "are left from an earlier conversion, remove them (`streamds verify %s` lists "
                "them)", f"{shown}/{MANIFEST_NAME}", len(check.unlisted),
                ", ".join(check.unlisted[:5]), shown,
            )


def same_file_error(
    first: str, second: str, real: str, *, named_by: str = "source names"
) -> ValueError:
    """The refusal of one file named twice, for the reader and the converter alike."""
    first, second, real = redact(first), redact(second), redact(real)
    how = "twice" if first == second else f"as {first!r} and as {second!r}"
    return ValueError(
        f"{named_by} the file {real!r} more than once ({how}); list each file once and "
        "remove extra names (a symbolic link, 'd//a.jsonl', 'd/./a.jsonl' or 'd/../d/a.jsonl' "
        "is the same file again, and so is a file inside a directory or glob also listed) so "
        "every record is read exactly once"
    )


def _identity(fs: fsspec.AbstractFileSystem, info: dict, real_dirs: dict[str, str]) -> str:
    """What makes two listed files one: the local real path, or the filesystem's own name."""
    if _is_local(fs):
        return canonical_path(info["name"], is_link=bool(info.get("islink")), real_dirs=real_dirs)
    return fs.unstrip_protocol(fs._strip_protocol(info["name"]))


def _manifest_entries(fs: fsspec.AbstractFileSystem, infos: list[dict]) -> dict[str, Any]:
    """path -> (the manifest's format, its `ShardEntry`) from the manifest.json beside .zst
    files, for their formats to settle from (`FileFacts.listed`).

    Saves opening every shard for its seek table. A missing or unreadable manifest is
    skipped (the seek tables are read instead).
    """
    known: dict[str, Any] = {}
    parents = {info["name"].rsplit("/", 1)[0] for info in infos if codec_of(info["name"]) == "zst"}
    for parent in sorted(parents):
        try:
            manifest = parse_manifest(fs.cat_file(f"{parent}/{MANIFEST_NAME}"), name=parent)
            fmt = named(manifest.shard_format)
        except Exception:  # optional: any failure falls back to reading the seek tables
            continue
        for entry in manifest.shards:
            known[f"{parent}/{entry.name}"] = (fmt, entry)
    return known


def _reader_of(fs: fsspec.AbstractFileSystem, path: str, url: str, retry: RetryPolicy
               ) -> Callable[[Callable[[BinaryIO], Any], str], Any]:
    """`FileFacts.read`: fn(the stored file), opened and closed here, transient errors retried."""

    def read(fn: Callable[[BinaryIO], Any], what: str) -> Any:
        def once() -> Any:
            with fs.open(path, mode="rb") as raw:
                return fn(raw)

        return retrying(once, retry, f"{url}: {what}")

    return read


def _exact_reader_of(fs: fsspec.AbstractFileSystem, path: str, url: str, retry: RetryPolicy
                     ) -> Callable[[int, int], bytes]:
    """`FileFacts.read_exact`: stored bytes [start, end) in one ranged read, retried."""

    def read_exact(start: int, end: int) -> bytes:
        return retrying(lambda: fs.cat_file(path, start=start, end=end), retry,
                        f"{url}: bytes {start}-{end}")

    return read_exact


def _shard_of(
    fs: fsspec.AbstractFileSystem, info: dict, given: str, known: dict, on_error: str,
    retry: RetryPolicy, answers: RangeAnswers, forced: Format | None = None,
) -> Shard:
    path = info["name"]
    url = _url_of(fs, path, given)
    name = _before_query(fs, path).rsplit("/", 1)[-1]  # "a.jsonl.zst?sig=..." is a .zst file
    foreign = foreign_format(name)
    if foreign in ("Feather", "Avro", "ORC"):  # binary: never JSON lines
        raise ValueError(f"{url} is a {foreign} file: {foreign_hint(foreign)}")
    fmt, codec = of_file(name)
    if forced is not None:  # format=...: a file whose name says nothing (or says wrong)
        fmt = forced
    require_codec(codec, url)
    size = info.get("size")
    ranged = answers.honours_range(fs, path)  # else one stream: no probe, no seek table
    # a file read as one stream is planned as a file of unknown size: one block, no seek
    # table or first line probed (its format settles without reading it)
    settled = fmt.settle(FileFacts(name=name, url=url, size=size if ranged else None,
                                   codec=codec, on_error=on_error,
                                   read=_reader_of(fs, path, url, retry),
                                   listed=known.get(path) if ranged else None,
                                   read_exact=_exact_reader_of(fs, path, url, retry)
                                   if ranged else None,
                                   local=_is_local(fs)))
    return Shard(
        url=url, path=path, size=size, format=settled.format, codec=codec,
        frames=settled.frames, frame_records=settled.frame_records, checksum=settled.checksum,
        version=_version_of(info), layout=settled.layout, ranged=ranged, fs=fs,
    )


def unsplit_note(shards: Sequence[Shard]) -> str:
    """What to add to a refusal of a split that blocks cannot give (an empty rank, ranks
    without records) when some files are whole because their server ignores Range."""
    whole = [shard.url for shard in shards if not shard.ranged]
    if not whole:
        return ""
    return (f"; {len(whole)} file(s) ({whole[0]!r}{' ...' if len(whole) > 1 else ''}) come "
            "from a server that ignores HTTP Range, so each is one block read by one reader: "
            "serve them from a server that honours Range (an object store, nginx, Apache) or "
            "download them, and they split across readers")


def with_columns(shards: list[Shard], columns: Sequence[str] | None) -> list[Shard]:
    """`shards` with the Parquet and Arrow files set to read `columns` only (None: all).

    Refuses a `columns` that is not a list of names, or that names a column a file of the
    corpus lacks (naming the file), here in the constructor rather than in a worker.
    """
    if columns is None:
        return shards
    if isinstance(columns, str) or not all(isinstance(name, str) for name in columns):
        raise TypeError(f"columns must be a list of column names, got {columns!r:.80}")
    if not columns:
        raise ValueError("columns is empty; name at least one column, or pass None for all")
    chosen = tuple(dict.fromkeys(columns))
    columnar = [shard for shard in shards if hasattr(shard.layout, "columns")]
    if not columnar:
        raise ValueError(
            f"columns={list(chosen)!r} selects columns of Parquet and Arrow files, and the "
            "source has none; leave columns out for JSON lines"
        )
    for shard in columnar:
        missing = [name for name in chosen if name not in shard.layout.columns]
        if missing:
            raise ValueError(
                f"columns: {shard.url} has no column {missing[0]!r}; its columns are "
                f"{list(shard.layout.columns)}; fix columns=[...]"
            )
    picked = set(map(id, columnar))
    return [dataclasses.replace(shard, columns=chosen) if id(shard) in picked else shard
            for shard in shards]


def source_items(source: Any, *, name: str = "source") -> list[str]:
    """The items of `source` (a path, URL or list of them) as strings.

    Refuses None, an empty list and an empty path (ValueError: an unset setting gives these,
    and "" would name the working directory) and anything else than str, os.PathLike, list
    or tuple (TypeError naming the type). `name` is the parameter's name in messages.
    """
    if source is None:
        raise ValueError(
            f"{name} is None; pass a file, directory, glob or URL (an unset setting such as "
            "os.environ.get('DATA') gives None)"
        )
    if isinstance(source, (str, os.PathLike)):
        items, single = [source], True
    elif isinstance(source, (list, tuple)):
        items, single = list(source), False
        if not items:
            raise ValueError(f"{name} is an empty list; pass at least one path, glob or URL")
    else:
        raise TypeError(
            f"{name} must be a path (str or os.PathLike), a URL or a list of them, got "
            f"{type(source).__name__} {source!r:.80}"
        )
    texts = []
    for index, item in enumerate(items):
        where = name if single else f"{name}[{index}]"
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(
                f"{where} must be a path (str or os.PathLike) or a URL, got "
                f"{type(item).__name__} {item!r:.80}"
            )
        text = os.fspath(item)
        if not isinstance(text, str):
            raise TypeError(f"{where} must be a str path, got bytes {text!r:.80}; decode it")
        if not text.strip():
            raise ValueError(
                f"{where} is {text!r}, an empty path, which would name the working directory; "
                "pass a file, directory, glob or URL (an unset setting such as "
                "os.environ.get('DATA', '') gives '')"
            )
        texts.append(text)
    return texts


@dataclass
class Listing:
    """What a source names: its shards, and what its folder and glob listings left out."""

    shards: list[Shard]
    left_out: LeftOut


# storage options the filesystems take as mappings (HTTP's headers, the clients' keyword
# arguments): anything else fails deep inside the client, where it reads as a missing file
_MAPPING_OPTIONS = ("headers", "client_kwargs", "config_kwargs", "s3_additional_kwargs")


def check_options(options: Mapping[str, Any], where: str = "storage_options") -> None:
    """Refuse an option that must be a mapping given as something else (a header line as a
    string), naming the option and the fix; its value is never shown (it may be a secret)."""
    for name in _MAPPING_OPTIONS:
        value = options.get(name)
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(
                f"{where}[{name!r}] must be a dict, got a {type(value).__name__} (not shown: it "
                "may hold a secret); pass one entry per name, e.g. Storage(options={'headers': "
                "{'Authorization': 'Bearer TOKEN'}}) for HTTP headers"
            )
    nested = options.get("client_kwargs")
    if isinstance(nested, Mapping):
        check_options(nested, f"{where}['client_kwargs']")


def list_source(
    source: Source, storage_options: dict[str, Any] | None = None, *, on_error: str = "raise",
    retry: RetryPolicy = DEFAULT_RETRY,
    format: str | None = None,
) -> Listing:
    """The shards of `source` (`resolve_shards`) and what its listings left out, and why.
    A listing or a look at a file that fails for a transient cause (a 5xx, a dropped
    connection) is retried per `retry`, the dataset's policy. `format`: the registered format
    every file is read in, whatever its name says."""
    forced = None if format is None else format_named(format)  # ValueError: the known ones
    items = source_items(source)
    options = dict(storage_options or {})
    check_options(options)
    guard_source(items, options)  # the storage libraries' log records: these secrets redacted
    shards: list[Shard] = []
    listed: list[Shard] = []  # found by a folder or glob listing (not named themselves)
    left_out = LeftOut()
    answers = RangeAnswers()  # which HTTP servers ignore Range, asked once each
    named: dict[str, str] = {}  # identity -> the URL that first named it
    real_dirs: dict[str, str] = {}
    for given in items:
        try:
            found = retrying(functools.partial(_list_files, given, options), retry,
                             redact(given))
        except Exception as err:  # what the storage raised, showing a credential: redacted
            if safe_cause(err) is not None:
                raise
            raise scrubbed(err) from None
        fs, infos = found.fs, found.infos
        for info in infos:
            identity = _identity(fs, info, real_dirs)
            url = _url_of(fs, info["name"], given)
            if identity in named:
                raise same_file_error(named[identity], url, identity)
            named[identity] = url
        if found.left_out is not None:
            _check_manifests(given, found)
            _report_left_out(given, found.left_out)
            left_out.extend(found.left_out)
        known = _manifest_entries(fs, infos)
        made = [_shard_of(fs, info, given, known, on_error, retry, answers, forced)
                for info in infos]
        shards.extend(made)
        if found.left_out is not None:
            listed.extend(made)
    shards.sort(key=lambda shard: natural_key(shard.url))
    _warn_copies(listed)
    _LISTED.update((shard.url, shard) for shard in shards)
    return Listing(shards, left_out)


def resolve_shards(
    source: Source, storage_options: dict[str, Any] | None = None, *, on_error: str = "raise",
    retry: RetryPolicy = DEFAULT_RETRY,
    format: str | None = None,
) -> list[Shard]:
    """All files `source` names, in natural order of their URLs, each file once.

    `source` is a path, a directory (searched recursively for JSONL-like files), a glob, an
    fsspec URL (chained URLs such as ``simplecache::https://...`` too) or a list of these.
    Hidden names (``.ipynb_checkpoints``, dotfiles) are skipped unless spelled out. Raises
    FileNotFoundError naming the item that matched nothing or a shard its folder's manifest
    lists that is missing (`MissingShardError`), and ValueError when one file is named twice
    under any spelling (see `canonical_path`) or is in a format streamds does not read.
    """
    return list_source(source, storage_options, on_error=on_error, retry=retry,
                       format=format).shards


# -- copies ------------------------------------------------------------------------------

_HEAD_BYTES = 4096  # decoded bytes compared to tell a copy: the first records


def _head(shard: Shard) -> bytes | None:
    """The first decoded bytes of `shard` (None when they cannot be read)."""
    try:
        with closing(decode(shard.open_raw(), shard.codec, shard.url)) as stream:
            return stream.read(_HEAD_BYTES)
    except (OSError, ValueError) as err:
        log.debug("%s: head not read to compare with a possible copy: %s", shard.url,
                  redact(str(err)))
        return None


def _same_head(first: Shard, second: Shard) -> bool:
    a, b = _head(first), _head(second)
    if not a or not b:
        return False
    size = min(len(a), len(b))
    return a[:size] == b[:size]


def _warn_copies(shards: Sequence[Shard]) -> None:
    """Warn once when files that folder and glob listings found look like copies of each
    other, naming each pair: the same name with another codec (``a.jsonl``, ``a.jsonl.gz``),
    or a copy's name (``train (1).jsonl``, ``Copy of train.jsonl``) holding the same first
    records. Both are read, so their records would come twice."""
    groups: dict[tuple[str, str], list[Shard]] = {}
    for shard in shards:
        parent, _, name = shard.url.rpartition("/")
        groups.setdefault((parent, sibling_key(name)), []).append(shard)
    pairs = []
    for members in groups.values():
        if len(members) < 2:
            continue
        names = {id(s): s.url.rpartition("/")[2] for s in members}
        original = next((s for s in members if copy_of(names[id(s)]) is None), members[0])
        for other in members:
            if other is original:
                continue
            if strip_codec(names[id(other)]) == strip_codec(names[id(original)]):
                pairs.append(f"{original.url!r} and {other.url!r} (the same name, another codec)")
            elif _same_head(original, other):
                pairs.append(f"{original.url!r} and {other.url!r} (a copy's name, the same "
                             "first records)")
    if pairs:
        log.warning(
            "%d pair(s) of files look like copies of each other, and both of each are read, "
            "so their records would come twice: %s. Remove or move one of each pair, or name "
            "the files to read explicitly", len(pairs), "; ".join(pairs),
        )
