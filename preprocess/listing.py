"""Listing conversion inputs: local trees many folders at a time, remote trees with fsspec.

Both give the files of one input as paths under its root (`Rel`) by the reader's rule and
in the reader's order (`streamds.formats.trees`: natural order of full paths):

- `ListingWalk` is the local `Walk` with its folder listings made ahead in threads, the
  folders the walk will enter next first. On a network mount that does not report entry
  types (fusepy's), telling a folder from a file costs a round trip per entry, and the
  kernel serialises the lookups within one folder, so only listing several folders at once
  makes a deep tree list fast. It also notes which entries are symbolic links, so checking
  that no file is named twice costs no request per file.
- `remote_tree` lists a remote directory or glob with the reader's own rule
  (`streamds.formats.trees.remote_record_files`) and sorts it naturally.
"""

from __future__ import annotations

import heapq
import os
import threading
from collections.abc import Iterator
from typing import Any

from fsspec import AbstractFileSystem

from streamds.formats.trees import (
    Rel,
    Walk,
    has_magic,
    natural_key,
    remote_is_folder,
    remote_record_files,
    remote_rel,
)

__all__ = ["ListingWalk", "RemoteTree", "remote_tree", "remote_version"]

Entry = tuple[tuple[Any, ...], str, bool]  # (sort key, name, is a directory): Walk's listing
SOME_FILES = 5  # files a listing keeps to name in a message
_NOTES = threading.Lock()  # listings are made in threads


def _order(rel: Rel) -> tuple[Any, ...]:
    """Where the folder `rel` comes in a walk: folders sort by their names plus "/"."""
    return tuple((natural_key(name + "/"), name) for name in rel)


class ListingWalk(Walk):
    """A `Walk` whose folder listings are made up to `threads` at a time, ahead of the walk.

    Yields exactly what `Walk.files` yields. `links` collects the paths of the symbolic links
    among the entries listed so far (files and folders). Listings held ahead are bounded to
    ``2 * threads`` folders; symbolic links to folders are listed when the walk gets there.
    """

    def __init__(self, walk: Walk, threads: int, markers: frozenset[str] = frozenset()) -> None:
        super().__init__(walk.root, walk.pattern, walk.exclude)
        self.threads = threads
        self.links: set[Rel] = set()
        self.markers = markers
        self.marked: dict[Rel, tuple[str, ...]] = {}  # folder -> the `markers` it holds
        self.files_seen = 0  # files in the listings so far, named or not
        self.some_files: list[Rel] = []  # the first few of them, for messages
        self._ahead: _Ahead | None = None

    def files(self, start: Rel | None = None) -> Iterator[Rel]:
        """What `Walk.files` yields; notes `marked`, `files_seen` and `some_files` on the way
        (a walk from `start` notes only the folders it lists)."""
        ahead = _Ahead(self, self.threads) if self.threads > 1 else None
        self._ahead = ahead
        try:
            yield from super().files(start)
        finally:
            self._ahead = None
            if ahead is not None:
                ahead.close()

    def _listing(self, rel: Rel) -> list[Entry]:  # the walk asks for folders in its order
        if self._ahead is None:
            return self.list_folder(rel)
        return self._ahead.take(rel)

    def list_folder(self, rel: Rel) -> list[Entry]:
        """One folder's entries, sorted as `Walk` sorts them (thread-safe)."""
        directory = os.path.join(self.root, *rel) if (self.root or rel) else "."
        entries: list[Entry] = []
        links: list[Rel] = []
        with os.scandir(directory or ".") as it:
            for entry in it:
                try:
                    is_dir = entry.is_dir()  # follows a symbolic link
                    if entry.is_symlink():
                        links.append((*rel, entry.name))
                except OSError:
                    is_dir = False
                key = natural_key(entry.name + "/" if is_dir else entry.name)
                entries.append((key, entry.name, is_dir))
        entries.sort()
        self.links.update(links)  # one bytecode-level update: safe under the GIL
        self._note(rel, entries)
        return entries

    def _note(self, rel: Rel, entries: list[Entry]) -> None:
        """Note the `markers` a folder holds (what makes it a converter's output) and a few
        of the files seen, to say what a listing that named nothing found."""
        names = {name for _key, name, _is_dir in entries}
        found = tuple(sorted(names & self.markers))
        files = [(*rel, name) for _key, name, is_dir in entries if not is_dir]
        with _NOTES:
            if found:
                self.marked[rel] = found
            self.files_seen += len(files)
            self.some_files.extend(files[:SOME_FILES - len(self.some_files)])

    def subfolders(self, rel: Rel, entries: list[Entry]) -> list[Rel]:
        """The folders in a listing the walk may enter, symbolic links left out."""
        found = []
        for _key, name, is_dir in entries:
            child = (*rel, name)
            if is_dir and child not in self.links and self.pattern.may_enter(child):
                found.append(child)
        return found


class _Ahead:
    """Lists the folders of a `ListingWalk` in threads, the ones the walk reaches first first.

    The walk asks for folders in increasing `_order`; a listing it has passed is dropped.
    State, under one lock: `pending` (a heap of folders found, not started), `claimed`
    (started), `done` (listing or error, not yet taken), `floor` (the order of the last
    folder taken).
    """

    def __init__(self, walk: ListingWalk, threads: int) -> None:
        self.walk = walk
        self.keep = 2 * threads
        self.cond = threading.Condition()
        self.pending: list[tuple[tuple[Any, ...], Rel]] = []
        self.claimed: set[Rel] = set()
        self.done: dict[Rel, list[Entry] | BaseException] = {}
        self.floor: tuple[Any, ...] = ()
        self.closed = False
        for n in range(threads):
            threading.Thread(target=self._work, name=f"streamds-list-{n}", daemon=True).start()

    def take(self, rel: Rel) -> list[Entry]:
        key = _order(rel)
        with self.cond:
            self.floor = key
            for old in [r for r in self.done if _order(r) < key]:
                del self.done[old]  # passed by the walk (skipped, excluded, a loop)
            mine = rel not in self.claimed
            self.claimed.add(rel)
            while not mine and rel not in self.done:
                self.cond.wait()
            result = None if mine else self.done.pop(rel)
            self.cond.notify_all()  # room for more listings ahead
        if result is None:
            entries = self.walk.list_folder(rel)  # errors reach the walk as they would
            self._found(rel, entries)
            return entries
        if isinstance(result, BaseException):
            raise result
        return result

    def _found(self, rel: Rel, entries: list[Entry]) -> None:
        children = self.walk.subfolders(rel, entries)
        with self.cond:
            for child in children:
                heapq.heappush(self.pending, (_order(child), child))
            self.cond.notify_all()

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (
                    not self.pending or len(self.done) >= self.keep
                ):
                    self.cond.wait()
                if self.closed:
                    return
                key, rel = heapq.heappop(self.pending)
                if rel in self.claimed or key < self.floor:
                    continue
                self.claimed.add(rel)
            try:
                entries = self.walk.list_folder(rel)
            except BaseException as err:  # handed to the walk when it gets there
                with self.cond:
                    self.done[rel] = err
                    self.cond.notify_all()
                continue
            self._found(rel, entries)
            with self.cond:
                self.done[rel] = entries
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.pending.clear()
            self.done.clear()
            self.cond.notify_all()


# fsspec info keys that change with a remote file's content, most specific first
VERSION_KEYS = ("ETag", "etag", "md5Hash", "Content-MD5", "Digest", "LastModified",
                "last_modified", "mtime", "updated", "created")


def remote_version(info: dict[str, Any]) -> str | None:
    """A string that changes with a remote file's content, from its fsspec info (None: the
    listing says nothing, and the size alone tells versions apart)."""
    for key in VERSION_KEYS:
        value = info.get(key)
        if value is not None:
            return str(value)
    return None


class RemoteTree:
    """The files of a remote directory or glob, listed once: `files` (rels, in natural
    order) and `sizes` (stored bytes where the listing says, else None), under `root`."""

    def __init__(self, fs: AbstractFileSystem, root: str, found: dict[str, dict]) -> None:
        self.fs = fs
        self.root = root
        self.sizes: dict[Rel, int | None] = {
            remote_rel(name, root): info.get("size") for name, info in found.items()
        }
        self.versions: dict[Rel, str | None] = {
            remote_rel(name, root): remote_version(info) for name, info in found.items()
        }
        self.files = sorted(self.sizes, key=lambda rel: natural_key("/".join(rel)))

    def path_of(self, rel: Rel) -> str:
        return "/".join((self.root, *rel))


def remote_tree(fs: AbstractFileSystem, path: str) -> RemoteTree | None:
    """The record files `path` names on `fs` (a directory or a glob) by the reader's rule
    (`streamds.formats.trees.Pattern`), or None when `path` is one file.

    Raises FileNotFoundError naming `path` when nothing is there or nothing matches.
    """
    # an existing "train[1].jsonl" is a file; so is an HTTP URL whose "?" starts its query
    named = path.partition("?")[0] if path.startswith(("http://", "https://")) else path
    glob = has_magic(named) and not fs.exists(path)
    if not glob:
        try:
            info = fs.info(path)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{path!r} does not exist; check the URL") from err
        if not remote_is_folder(fs, path, info):
            return None
    root, named = remote_record_files(fs, path, glob)
    if not named:
        what = "no files match" if glob else "no record files under"
        raise FileNotFoundError(
            f"{what} {path!r} (record files end in .json, .jsonl, .ndjson or .tar, plain or "
            "compressed, at any depth; hidden names are skipped unless a pattern spells the "
            "dot)"
        )
    return RemoteTree(fs, root, named)
