"""What a state says about the corpus and settings it was taken with, so that it loads after
the files moved and is refused, naming the difference, when they changed.

A corpus is its files in reading order, each named relative to the source root (the folder a
directory or glob names, a single file's folder, the folder a list's items share), with its
size, the manifest's checksum where there is one, and how it is read (format, codec,
seekable frames). Absolute paths, mount points, hosts and query strings are no part of it, so
the same files copied from a mounted Drive to local disk, or mounted elsewhere, are the same
corpus.

A state carries one `Identity` (``state["fingerprint"]``), made once per dataset and shared by
every state it takes, so taking a state stays O(1)::

    {"corpus": hex digest of the files,
     "files": number of files, "bytes": their stored bytes (None: a size is unknown),
     "listing": "files:" + base64(zlib(JSON [[name, size, checksum], ...]))   # small corpora
              | "folders:" + base64(zlib(JSON [[folder, files, bytes, digest], ...]))
              | "",                            # too many folders: the totals alone
     "settings": {"seed", "shuffle", "buffer_size", "block_size", "even_ranks"},
     "modified": "times:" + base64(zlib(JSON [seconds | null, ...]))   # per file
               | "digest:" + hex digest of them}                        # too many files

A file's name, size and checksum say where its records are only where a checksum is known
(a converted corpus's manifest): a file rewritten at the same size with its lines in another
order has the same name and size. So a state also carries each file's modification time
(from the storage's mtime or Last-Modified; null where a checksum names the content or the
storage gives none), and a file whose time differs is refused by name: its records may have
moved. Copies that keep modification times (``cp -p``, ``rsync -t``, ``shutil.copy2``)
still load anywhere; a time that cannot be compared (none on one side) is logged as a file
that cannot be checked.

The listing only serves to name what differs when the digests disagree; it is bounded
(`LISTING_LIMIT` characters) so that a StatefulDataLoader worker can send it after every batch.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import logging
import math
import posixpath
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
from fsspec.core import url_to_fs

from ..errors import StateMismatchError
from ..storage.shards import Shard, has_magic

__all__ = ["IDENTITY_KEYS", "LISTING_LIMIT", "SETTINGS", "Identity", "check_identity",
           "differences", "modified_time", "relative_names", "source_root"]

log = logging.getLogger(__name__)

IDENTITY_KEYS = frozenset(("corpus", "files", "bytes", "listing", "settings", "modified"))
SETTINGS = ("seed", "shuffle", "buffer_size", "block_size", "even_ranks")
LISTING_LIMIT = 16384  # characters of listing a state carries at most
_FILES, _FOLDERS = "files:", "folders:"
_TIMES, _TIMES_DIGEST = "times:", "digest:"
# where a storage's version names the modification time (`Shard.version`: "key=value ..."):
# a local or SFTP mtime in seconds, an HTTP Last-Modified date, S3's and GCS's timestamps
_MTIME = re.compile(r"(?:^| )mtime=([0-9.eE+-]+)(?: |$)")
_HTTP_DATE = re.compile(r"(?:^| )last-modified=(\w{3}, \d{2} \w{3} \d{4} [\d:]{8} GMT)")
_ISO_DATE = re.compile(r"(?:^| )(?:lastmodified|last_modified|updated)=(\d{4}-\d{2}-\d{2}"
                       r"[T ][\d:.]+(?:Z|[+-]\d{2}:?\d{2})?)")
_NAMED = 5  # files named per kind of difference; the rest are counted


def _plain(name: str) -> str:
    """`name` without what identifies a location rather than a file: a URL's user
    information (credentials), query and fragment (signatures, tokens)."""
    if "://" not in name:
        return name
    parts = urlsplit(name)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def source_root(item: str, shards: Sequence[Shard], storage_options: dict[str, Any]) -> str:
    """The folder under which the files of source item `item` are named: a directory
    itself, a glob's fixed folder (before its first wildcard), a single file's folder.
    A path in the item's filesystem, as `Shard.path` is."""
    _, path = url_to_fs(item, **storage_options)
    path = path.rstrip("/")
    if any(shard.path == path for shard in shards):  # a file (a literal "a[1].jsonl" too)
        return posixpath.dirname(path)
    if has_magic(path):
        cut = min(path.find(char) for char in "*?[" if char in path)
        return path[: path.rfind("/", 0, cut)]
    return path


def _common_folder(roots: Sequence[str]) -> str:
    """The deepest folder (whole "/"-separated parts) that holds every root, with its
    trailing "/" ("" where they share nothing)."""
    common = roots[0].split("/")
    for root in roots[1:]:
        parts = root.split("/")
        same = 0
        while same < min(len(common), len(parts)) and common[same] == parts[same]:
            same += 1
        common = common[:same]
    return "/".join(common) + "/" if common else ""


def relative_names(shards: Sequence[Shard], roots: Sequence[str]) -> list[str]:
    """Each shard's name under the folder the source roots share (its plain full name
    where nothing is shared, e.g. files of two filesystems)."""
    prefix = _common_folder([_plain(root) for root in roots]) if roots else ""
    names = []
    for shard in shards:
        path = _plain(shard.path)
        names.append(path[len(prefix):] if prefix and path.startswith(prefix) else path)
    return names


def modified_time(version: str | None) -> float | None:
    """The modification time (seconds since the epoch) a storage's version string names
    (`Shard.version`), None where it names none (an ETag alone, nothing)."""
    if not version:
        return None
    found = _MTIME.search(version)
    if found:
        try:
            return float(found.group(1))
        except ValueError:
            return None
    found = _HTTP_DATE.search(version)
    try:
        if found:
            return email.utils.parsedate_to_datetime(found.group(1)).timestamp()
        found = _ISO_DATE.search(version)
        if found:
            when = datetime.fromisoformat(found.group(1).replace("Z", "+00:00"))
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
            return when.timestamp()
    except (TypeError, ValueError):
        return None
    return None


def _same_time(theirs: float, mine: float) -> bool:
    """Whether two modification times are one: equal, or equal to the second where either
    comes from a date with whole seconds (an HTTP Last-Modified beside a local mtime)."""
    if theirs == mine:
        return True
    return (float(theirs).is_integer() or float(mine).is_integer()) and (
        math.floor(theirs) == math.floor(mine))


def _times_state(times: list[float | None]) -> str:
    packed = _TIMES + base64.b64encode(zlib.compress(orjson.dumps(times))).decode("ascii")
    return packed if len(packed) <= LISTING_LIMIT else _TIMES_DIGEST + _digest(times)


def _times_of(modified: str) -> list[float | None] | None:
    """The per-file times of a state's "modified" (None: only their digest is there)."""
    if not modified.startswith(_TIMES):
        return None
    return orjson.loads(zlib.decompress(base64.b64decode(modified[len(_TIMES):])))


def _digest(value: Any, size: int = 12) -> str:
    return hashlib.blake2b(orjson.dumps(value), digest_size=size).hexdigest()


def _pack(kind: str, rows: list[list[Any]]) -> str:
    return kind + base64.b64encode(zlib.compress(orjson.dumps(rows))).decode("ascii")


def _unpack(listing: str) -> tuple[str, list[list[Any]]]:
    kind = _FILES if listing.startswith(_FILES) else _FOLDERS
    raw = base64.b64decode(listing[len(kind):])
    return kind, orjson.loads(zlib.decompress(raw))


def _folder_rows(files: list[list[Any]]) -> list[list[Any]]:
    """[folder, files, bytes, digest] per folder (its files' digest), in order of first use."""
    folders: dict[str, list[list[Any]]] = {}
    for row in files:
        folders.setdefault(posixpath.dirname(row[0]), []).append(row)
    return [[folder, len(rows), _bytes(rows), _digest(rows, 6)]
            for folder, rows in folders.items()]


def _bytes(rows: list[list[Any]]) -> int | None:
    sizes = [row[1] for row in rows]
    return None if None in sizes else sum(sizes)


@dataclass(frozen=True)
class Identity:
    """The identity of one dataset's corpus and settings; `state` is what its states hold."""

    state: dict[str, Any]
    files: list[list[Any]]  # [name, size, checksum] per shard, in reading order

    @classmethod
    def of(cls, shards: Sequence[Shard], names: Sequence[str],
           settings: dict[str, Any]) -> Identity:
        files = [[name, shard.size, shard.checksum] for name, shard in zip(names, shards,
                                                                            strict=True)]
        read = [[shard.format.name, shard.codec, len(shard.frames or ())] for shard in shards]
        # the columns a Parquet or Arrow file is read with: other columns, other records
        read += [[index, list(shard.columns)] for index, shard in enumerate(shards)
                 if shard.columns]
        # a file takes a few characters at least: skip compressing what cannot fit
        listing = _pack(_FILES, files) if len(files) <= LISTING_LIMIT // 2 else ""
        if not listing or len(listing) > LISTING_LIMIT:
            listing = _pack(_FOLDERS, _folder_rows(files))
        if len(listing) > LISTING_LIMIT:
            listing = ""
        # a checksum names a file's content wherever it lies; else its modification time
        # tells a rewritten file from the one the state was taken over
        times = [None if shard.checksum is not None else modified_time(shard.version)
                 for shard in shards]
        state = {"corpus": _digest([files, read]), "files": len(files), "bytes": _bytes(files),
                 "listing": listing, "settings": {key: settings[key] for key in SETTINGS},
                 "modified": _times_state(times)}
        return cls(state, files)

    def to_state(self) -> dict[str, Any]:
        """A copy for one state (its values are immutable; the copy is a few pointers)."""
        return {**self.state, "settings": dict(self.state["settings"])}

    def differences(self, theirs: Any) -> list[str]:
        """What differs between the state identity `theirs` and this one, in words; empty
        when they are the same corpus and settings."""
        return differences(theirs, self.state, self.files)


def _check_shape(identity: Any) -> None:
    if (not isinstance(identity, dict) or set(identity) != IDENTITY_KEYS
            or not isinstance(identity["settings"], dict)
            or set(identity["settings"]) != set(SETTINGS)):
        raise StateMismatchError(
            "the state's corpus description is not one this streamds version writes (an "
            "earlier version identified the corpus by absolute paths); finish the epoch with "
            "the version that took the state, or restart the epoch (its records are re-read, "
            "not lost)"
        )


def _rows(identity: dict[str, Any]) -> tuple[str, list[list[Any]]]:
    """(kind, rows) of an identity's listing; kind "" when it holds the totals alone."""
    return _unpack(identity["listing"]) if identity["listing"] else ("", [])


def differences(theirs: Any, mine: dict[str, Any], files: list[list[Any]] | None = None, *,
                labels: tuple[str, str] = ("in the state", "here")) -> list[str]:
    """What differs between the identities `theirs` and `mine` (`files`: mine's full listing,
    where known beyond its state), in words that place them by `labels`; empty when they are
    the same."""
    _check_shape(theirs)
    old_at, new_at = labels
    said = [f"{key}={theirs['settings'][key]!r} {old_at}, {value!r} {new_at}"
            for key, value in mine["settings"].items() if theirs["settings"][key] != value]
    if theirs["corpus"] == mine["corpus"]:
        changed = _times_differ(theirs, mine, files, old_at, new_at)
        return said + ([changed] if changed else [])
    old_kind, old = _rows(theirs)
    new_kind, new = (_FILES, files) if files is not None else _rows(mine)
    if old_kind == new_kind == _FILES:
        said.append(_files_differ(old, new, old_at, new_at))
        return said
    if old_kind and new_kind:  # compare folder by folder
        old = _folder_rows(old) if old_kind == _FILES else old
        new = _folder_rows(new) if new_kind == _FILES else new
        found = _folders_differ(old, new, old_at, new_at)
        if found:
            said.append(found)
            return said
    said.append(f"the corpus has {theirs['files']} files ({theirs['bytes']} bytes) {old_at}, "
                f"{mine['files']} ({mine['bytes']} bytes) {new_at}")
    return said


def _times_differ(theirs: dict[str, Any], mine: dict[str, Any],
                  files: list[list[Any]] | None, old_at: str, new_at: str) -> str:
    """What differs between the modification times of the same files (names, sizes and
    checksums alike), in words; "" where nothing shows a change. A file without a time on
    one side cannot be checked: logged."""
    if theirs["modified"] == mine["modified"]:
        return ""
    old, new = _times_of(theirs["modified"]), _times_of(mine["modified"])
    fix = ("its records may have moved, so the state cannot say where it stands in it. "
           "If the files are the same, copied without their modification times, copy them "
           "with the times kept (cp -p, rsync -t, shutil.copy2) or convert the corpus "
           "(`streamds convert`: its manifest's checksums name the content); else restart "
           "the epoch")
    if old is None or new is None or len(old) != len(new):
        return (f"the modification times of the {mine['files']} files differ ({old_at}, "
                f"{new_at}; too many files to name which): a file rewritten at the same size: "
                + fix)
    if files is None:
        kind, files = _rows(mine)
        if kind != _FILES:
            files = [[f"file {i + 1}"] for i in range(len(new))]
    names = [row[0] for row in files]
    pairs = list(zip(old, new, strict=True))
    changed = [i for i, (a, b) in enumerate(pairs)
               if a is not None and b is not None and not _same_time(a, b)]
    unknown = [i for i, (a, b) in enumerate(pairs) if (a is None) != (b is None)]
    if unknown:
        log.info("%d file(s) of the state's corpus cannot be checked for changes (a "
                 "modification time is known only %s), e.g. %r", len(unknown),
                 old_at if new[unknown[0]] is None else new_at, names[unknown[0]])
    if not changed:
        return ""
    listed = [f"{names[i]!r} ({_when(old[i])} {old_at}, {_when(new[i])} {new_at})"
              for i in changed]
    return _listed("files modified since (the same name and size)", listed) + "; " + fix


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="microseconds")


def _listed(label: str, items: list[str]) -> str:
    more = f" and {len(items) - _NAMED} more" if len(items) > _NAMED else ""
    return f"{label}: {', '.join(items[:_NAMED])}{more}"


def _files_differ(theirs: list[list[Any]], mine: list[list[Any]], old_at: str,
                  new_at: str) -> str:
    old = {row[0]: row for row in theirs}
    new = {row[0]: row for row in mine}
    kinds = {
        f"missing {new_at} (only {old_at})": [repr(name) for name in old if name not in new],
        f"added {new_at} (not {old_at})": [repr(name) for name in new if name not in old],
        "other size": [f"{name!r} ({old[name][1]} bytes {old_at}, {new[name][1]} {new_at})"
                       for name in old if name in new and old[name][1] != new[name][1]],
        "other checksum": [f"{name!r} (checksum {old[name][2]} {old_at}, {new[name][2]} "
                           f"{new_at})" for name in old if name in new
                           and old[name][1] == new[name][1] and old[name][2] != new[name][2]],
    }
    said = [_listed(label, items) for label, items in kinds.items() if items]
    if said:
        return "files differ: " + "; ".join(said)
    if [row[0] for row in theirs] != [row[0] for row in mine]:
        return ("the same files in another reading order (files from several source items "
                "sort by their full paths: give the items the same folder layout)")
    return ("the same files (names, sizes, checksums) read another way (format, codec or "
            "seekable frames: another streamds version?)")


def _folders_differ(theirs: list[list[Any]], mine: list[list[Any]], old_at: str,
                    new_at: str) -> str:
    old = {row[0]: row for row in theirs}
    new = {row[0]: row for row in mine}
    said = [f"folder {name or '.'!r}: {row[1]} files ({row[2]} bytes) {old_at}, "
            + (f"{new[name][1]} ({new[name][2]} bytes) {new_at}" if name in new
               else f"missing {new_at}")
            for name, row in old.items() if new.get(name) != row]
    said += [f"folder {name or '.'!r}: added {new_at} ({row[1]} files)"
             for name, row in new.items() if name not in old]
    if not said:
        return ""
    return _listed("files differ (too many to list them in a state)", said)


def check_identity(theirs: Any, mine: Identity, what: str) -> None:
    """Refuse `what` (a state, a merged state) whose identity `theirs` is not `mine`."""
    said = mine.differences(theirs)
    if said:
        raise StateMismatchError(
            f"{what} was taken from another corpus or with other settings: {'; '.join(said)}. "
            "States name files relative to the source root (with sizes and checksums), so "
            "the same files under another folder or mount point load; build the dataset over "
            "the files and with the settings the state was taken with, or restart the epoch"
        )
