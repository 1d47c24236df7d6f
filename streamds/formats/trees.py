"""Trees: which files a directory or a glob names, one rule for the reader and the converter.

`streamds.storage.shards` (the reader) and `preprocess.sources` (the converter) both expand sources
here, so they read the same files:

- a directory names its record files (`is_record_name`) at any depth;
- a glob matches component by component: ``*``, ``?`` and ``[...]`` within one name, ``**``
  across any number of folders; a pattern without ``**`` whose last component matches a
  directory takes that directory's record files;
- hidden names (`is_hidden`: ``.ipynb_checkpoints``, dotfiles) are skipped unless a pattern
  component spells the dot, as in the shell;
- symbolic links are followed, to files and to folders; a link back to a folder being walked
  (a loop) is skipped. Files keep the names they were found under: `canonical_path` says
  which names are one file, and the callers refuse a file found twice.

A local walk lists each directory once with ``os.scandir`` and sorts it in natural order
(``part_2`` before ``part_10``), so memory is one listing per level; it restarts from a file
it once yielded. Remote filesystems list with fsspec and filter with the same `Pattern`.

Where a source names a folder's record files, a `LeftOut` given to the walk collects the
files and hidden folders it did not take, with the reason (`left_out_reason`), and the
manifests it passed, so the reader can report them and check the manifests' shards.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from fnmatch import fnmatchcase
from pathlib import PurePath
from typing import Any

from .filenames import MANIFEST_NAME, is_hidden, is_record_name, left_out_reason
from .unfinished import MARKER_NAMES

__all__ = [
    "LeftOut",
    "Pattern",
    "Rel",
    "Walk",
    "canonical_path",
    "directory_walk",
    "glob_walk",
    "has_magic",
    "natural_key",
    "remote_is_folder",
    "remote_record_files",
    "remote_rel",
    "split_glob",
]

Rel = tuple[str, ...]  # path components under a walk's root

_GLOB_CHARS = re.compile(r"[*?\[]")


def has_magic(path: str) -> bool:
    """Whether `path` is a glob pattern."""
    return _GLOB_CHARS.search(path) is not None


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key putting `part-2` before `part-10`."""
    return tuple(int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", text))


def canonical_path(
    path: str, *, is_link: bool | None = None, real_dirs: dict[str, str] | None = None
) -> str:
    """One name for a local file however it is spelled: its real path (symbolic links, ``.``,
    ``..`` and doubled slashes resolved).

    With `is_link` False (known from a listing) and a `real_dirs` cache it costs one lookup
    per directory instead of one per path component.
    """
    if is_link is False and real_dirs is not None:
        parent, name = os.path.split(path)
        real = real_dirs.get(parent)
        if real is None:
            real = real_dirs[parent] = os.path.realpath(parent or ".")
        return os.path.join(real, name)
    return os.path.realpath(path)


HIDDEN_FOLDER = "hidden folder (starts with '.'); name it in the source to read it"


class LeftOut:
    """What folder listings did not take: every file's reason counted, the first `keep`
    named (a folder of 100,000 stray files stays small), and every manifest passed, and every
    converter journal or plan (`formats.unfinished`: a folder with one and no manifest is
    an unfinished conversion).

    Paths are as the listing names them (the walk's root joined with the components).
    """

    def __init__(self, keep: int = 100) -> None:
        self.keep = keep
        self.counts: Counter[str] = Counter()  # reason -> files and folders
        self.examples: list[tuple[str, str]] = []  # (path, reason), the first `keep`
        self.manifests: list[str] = []  # every manifest.json passed
        self.markers: list[str] = []  # every converter journal or plan passed

    def add(self, path: str, reason: str) -> None:
        self.counts[reason] += 1
        if len(self.examples) < self.keep:
            self.examples.append((path, reason))
        name = path.rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]
        if name == MANIFEST_NAME:
            self.manifests.append(path)
        elif name in MARKER_NAMES:
            self.markers.append(path)

    def __len__(self) -> int:
        return sum(self.counts.values())

    def extend(self, other: LeftOut) -> None:
        self.counts.update(other.counts)
        self.examples.extend(other.examples[: max(0, self.keep - len(self.examples))])
        self.manifests.extend(other.manifests)
        self.markers.extend(other.markers)

    def summary(self, *, limit: int = 5) -> str:
        """One line per reason: how many, and the first few paths."""
        lines = []
        for reason, count in self.counts.most_common():
            paths = [path for path, why in self.examples if why == reason][:limit]
            more = f" and {count - len(paths)} more" if count > len(paths) else ""
            lines.append(f"{count} x {reason}: {', '.join(map(repr, paths))}{more}")
        return "; ".join(lines)


def _component_matches(name: str, pattern: str) -> bool:
    if is_hidden(name) and not pattern.startswith("."):
        return False  # like the shell: wildcards do not match hidden names
    return fnmatchcase(name, pattern)


def _matches(parts: Rel, patterns: Rel) -> bool:
    if not patterns:
        return not parts
    if patterns[0] == "**":  # any number of components, none of them hidden
        for skip in range(len(parts) + 1):
            if _matches(parts[skip:], patterns[1:]):
                return True
            if skip < len(parts) and is_hidden(parts[skip]):
                return False
        return False
    return (
        bool(parts)
        and _component_matches(parts[0], patterns[0])
        and _matches(parts[1:], patterns[1:])
    )


class Pattern:
    """A glob's components below its fixed directory (None: a directory source, which names
    every record file below it)."""

    def __init__(self, parts: Sequence[str] | None) -> None:
        self.parts: Rel | None = None if parts is None else tuple(parts)
        self.recursive = self.parts is not None and "**" in self.parts
        spelled = () if self.parts is None else self.parts
        self._dotted = tuple(part for part in spelled if part.startswith("."))

    def matches(self, rel: Rel) -> bool:
        """Whether the file at `rel` (below the fixed directory) is named."""
        if self.parts is None:
            return not any(map(is_hidden, rel)) and is_record_name(rel[-1])
        if self.recursive:
            return _matches(rel, self.parts)
        size = len(self.parts)
        if len(rel) < size or not all(map(_component_matches, rel[:size], self.parts)):
            return False
        if len(rel) == size:
            return True
        inside = rel[size:]  # in a directory the pattern matched: its record files
        return not any(map(is_hidden, inside)) and is_record_name(inside[-1])

    def lists(self, rel: Rel) -> bool:
        """Whether `rel` lies where the source names every record file of a folder (a
        directory source, or inside a folder that a glob without ``**`` matched), so that
        a file there not taken was left out rather than not named."""
        if self.parts is None:
            return True
        if self.recursive:
            return False
        size = len(self.parts)
        return len(rel) > size and all(map(_component_matches, rel[:size], self.parts))

    def why_left_out(self, rel: Rel, *, folder: bool = False) -> str | None:
        """Why the file (or with `folder`, the folder) at `rel` is not taken, where the
        pattern `lists` its folder; None where it is taken or was never named."""
        if not self.lists(rel):
            return None
        base = len(self.parts) if self.parts is not None else 0
        if folder or any(map(is_hidden, rel[base:-1])):
            return HIDDEN_FOLDER if any(map(is_hidden, rel[base:])) else None
        return left_out_reason(rel[-1])

    def may_enter(self, rel: Rel) -> bool:
        """Whether the directory at `rel` can hold named files."""
        if self.parts is None:
            return not is_hidden(rel[-1])
        if self.recursive:
            fixed = self.parts[: self.parts.index("**")]
            if not all(map(_component_matches, rel[: len(fixed)], fixed)):
                return False
            return len(rel) <= len(fixed) or not is_hidden(rel[-1]) or any(
                fnmatchcase(rel[-1], dotted) for dotted in self._dotted
            )
        size = len(self.parts)
        if not all(map(_component_matches, rel[:size], self.parts)):
            return False
        return not any(map(is_hidden, rel[size:]))


def _entry_key(name: str, is_dir: bool) -> tuple[Any, ...]:
    # A directory sorts as "name/", which orders a tree exactly as a natural sort of full paths.
    return natural_key(name + "/" if is_dir else name)


class Walk:
    """The local files under `root` that `pattern` names, in natural order of their paths.

    `exclude` holds (device, inode) pairs of directories never entered (a conversion's output
    inside its input); the caller may add to it before walking. `left_out`, when given,
    collects what a walk from the start did not take (`Pattern.why_left_out`).
    """

    def __init__(
        self, root: str, pattern: Pattern, exclude: set[tuple[int, int]],
        left_out: LeftOut | None = None,
    ) -> None:
        self.root = root
        self.pattern = pattern
        self.exclude = exclude
        self.left_out = left_out

    def _leave_out(self, rel: Rel, *, folder: bool = False) -> None:
        if self.left_out is None:
            return
        reason = self.pattern.why_left_out(rel, folder=folder)
        if reason is not None:
            self.left_out.add(os.path.join(self.root, *rel), reason)

    def files(self, start: Rel | None = None) -> Iterator[Rel]:
        """Paths (as components) in natural order, from `start` (a path once yielded) on."""
        top = os.stat(self.root or ".")
        yield from self._walk((), start, {(top.st_dev, top.st_ino)})

    def _listing(self, rel: Rel) -> list[tuple[tuple[Any, ...], str, bool]]:
        directory = os.path.join(self.root, *rel) if (self.root or rel) else "."
        entries = []
        with os.scandir(directory or ".") as it:
            for entry in it:
                try:
                    is_dir = entry.is_dir()  # follows a symbolic link
                except OSError:
                    is_dir = False
                entries.append((_entry_key(entry.name, is_dir), entry.name, is_dir))
        entries.sort()
        return entries

    def _walk(self, rel: Rel, start: Rel | None, ancestors: set[tuple[int, int]]) -> Iterator[Rel]:
        for key, name, is_dir in self._listing(rel):
            child = (*rel, name)
            rest: Rel | None = None
            if start is not None:
                target = _entry_key(start[0], len(start) > 1)
                if key < target:
                    continue
                if key == target and name == start[0]:
                    rest = start[1:] or None
                start = None
            if is_dir:
                if not self.pattern.may_enter(child):
                    self._leave_out(child, folder=True)
                    continue
                info = os.stat(os.path.join(self.root, *child))
                ident = (info.st_dev, info.st_ino)
                if ident in ancestors or ident in self.exclude:
                    continue  # a symlink loop, or the output directory inside the input
                yield from self._walk(child, rest, ancestors | {ident})
            elif rest is None and self.pattern.matches(child):
                yield child
            elif rest is None:
                self._leave_out(child)


def split_glob(pattern: str) -> tuple[str, Rel]:
    """A glob's fixed directory (before its first wildcard) and its components after it."""
    parts = PurePath(pattern).parts
    static = 0
    while static < len(parts) - 1 and not has_magic(parts[static]):
        static += 1
    return (os.path.join(*parts[:static]) if static else ""), tuple(parts[static:])


def remote_rel(name: str, root: str) -> Rel:
    """The components of the remote file `name` under `root`."""
    return tuple(name[len(root.rstrip("/")) :].strip("/").split("/"))


def _split_remote_glob(path: str) -> tuple[str, Rel]:
    """A remote glob's fixed part and its components after it, split on "/" only (so
    ``http://host/d/*.json`` keeps its "//", which `split_glob`'s PurePath would collapse)."""
    parts = path.split("/")
    static = 0
    while static < len(parts) - 1 and not has_magic(parts[static]):
        static += 1
    return "/".join(parts[:static]), tuple(parts[static:])


def remote_is_folder(fs: Any, path: str, info: dict[str, Any]) -> bool:
    """Whether remote `path` (with fsspec `info`) is a folder; over HTTP a folder's URL is a
    "file", its listing page, which `fs.isdir` parses."""
    if info.get("type") == "directory":
        return True
    listing_page = info.get("mimetype") == "text/html" or path.endswith("/")
    return listing_page and fs.isdir(path)


def remote_record_files(
    fs: Any, path: str, glob: bool, left_out: LeftOut | None = None
) -> tuple[str, dict[str, dict]]:
    """(root, {name: fsspec info}) of the record files that the remote folder or glob `path`
    names on the fsspec filesystem `fs`, by the same `Pattern` as local walks (empty when
    nothing matches); `left_out` collects the files of named folders not taken."""
    if glob:
        root, parts = _split_remote_glob(path)
        pattern = Pattern(parts)
        found: dict[str, dict] = {}
        for name, info in fs.glob(path, detail=True).items():
            if info.get("type") == "directory":  # a matched directory: its record files
                if not pattern.recursive:
                    found.update(fs.find(name, detail=True))
            else:
                found[name] = info
    else:
        root, pattern = path.rstrip("/"), Pattern(None)
        found = fs.find(path, detail=True)
    taken = {}
    for name, info in found.items():
        if info.get("type") == "directory":
            continue
        rel = remote_rel(name, root)
        if pattern.matches(rel):
            taken[name] = info
        elif left_out is not None:
            reason = pattern.why_left_out(rel)
            if reason is not None:
                left_out.add(fs.unstrip_protocol(name), reason)
    return root, taken


def directory_walk(
    root: str, exclude: set[tuple[int, int]] | None = None, left_out: LeftOut | None = None
) -> Walk:
    """The record files below the local directory `root`."""
    return Walk(root, Pattern(None), set() if exclude is None else exclude, left_out)


def glob_walk(
    pattern: str, exclude: set[tuple[int, int]] | None = None, left_out: LeftOut | None = None
) -> Walk:
    """The local files the glob `pattern` names."""
    root, parts = split_glob(pattern)
    return Walk(root, Pattern(parts), set() if exclude is None else exclude, left_out)
