"""What the inputs were when a conversion began: each file's path, size and version.

A resumed or rerun conversion continues from positions inside its inputs, so it is right
only over the same files. `InputFiles` is every input file (input index, path under the
input) with its stored size and its version: the modification time in nanoseconds for a
local file, what the listing says for a remote one (ETag, checksum or modification time;
the size alone where it says nothing). It is written once, when a conversion begins, as
``.streamds-inputs.json`` in the output (hidden, so readers skip it); the journal and the
plan of parts hold its digest. A rerun lists and stats the inputs again and refuses a
different digest (`check_inputs`), naming the files that were added, removed or changed, so
an output never mixes records of two versions of its inputs. Stats run `threads` at a time:
on a mount they cost a round trip each.

A file's modification time ticks coarsely (a few milliseconds, seconds on some mounts), so
a rewrite at the same size within one tick keeps its stamp. As git does for its index, a
local file modified within `RACY_NS` of its stat is "racy": its xxh64 checksum is recorded
too (beside the digest, which stays a function of the files), and every later look at it (a
rerun, the checks during a conversion) checksums it again while its size and time still
match. Only files written just before a conversion pay that read.

During a conversion (`InputsWatch`) each JSON lines or tar file is checked again after it is
read, and every file before the manifest is written: a file rewritten meanwhile fails the
run (InputsChangedError naming it) with no manifest, and the rerun is refused as above, so
an output never holds records of two versions of a file.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import orjson

from streamds.formats.manifest import file_checksum

from .errors import ConversionError
from .sources import Leaf

__all__ = [
    "INPUTS_FORMAT",
    "INPUTS_NAME",
    "RACY_NS",
    "InputFiles",
    "InputsChangedError",
    "InputsWatch",
    "check_inputs",
    "check_part_files",
    "is_inputs_temporary",
]

INPUTS_NAME = ".streamds-inputs.json"
INPUTS_FORMAT = "streamds.convert-inputs/1"
SHOWN = 3  # files named per kind of difference in a message
RACY_NS = 2_000_000_000  # modified this close to its stat: the file may change in one tick
CHECKSUMS_KEY = "checksums"  # the racy files' checksums in the record of the inputs

Stamp = tuple[int | None, str | None]  # (stored size, version)


class InputsChangedError(ConversionError):
    """The inputs are not the files an earlier conversion into the same output read."""


def is_inputs_temporary(name: str) -> bool:
    """Whether `name` is the temporary file of a writer of `INPUTS_NAME`."""
    return name.startswith(f"{INPUTS_NAME}.") and name.endswith(".tmp")


Key = tuple[int, str]  # (input index, path under the input)


def _key(leaf: Leaf) -> Key:
    return leaf.input, "" if leaf.rel is None else "/".join(leaf.rel)


def _stamp(leaf: Leaf, before: Stamp | None, recorded_sum: str | None,
           now_ns: int) -> tuple[int | None, str | None, str | None]:
    """(size, version, checksum) of `leaf`. A local file's version is its modification
    time; its checksum is taken when it is racy (see the module), or when it was recorded
    (`recorded_sum`) with the same size and time (`before`); else None."""
    if leaf.fs is not None:
        return leaf.size, leaf.version, None
    try:
        info = os.stat(leaf.path)
    except OSError as err:
        why = (f"a broken symbolic link (to {os.readlink(leaf.path)})"
               if os.path.islink(leaf.path) else f"unreadable ({err.strerror})")
        raise ConversionError(
            f"{leaf.path}: the input file is {why}; fix or remove it, then rerun"
        ) from err
    size, version = info.st_size, str(info.st_mtime_ns)
    racy = info.st_mtime_ns >= now_ns - RACY_NS
    if racy or (recorded_sum is not None and before == (size, version)):
        return size, version, file_checksum(leaf.path)
    return size, version, None


@dataclass(frozen=True)
class InputFiles:
    """Every input file as ``(input index, path under the input, size, version)``, in input
    order; `checksums` the xxh64 of the racy ones (see the module), kept out of the digest
    (whether a file is racy depends on when it was looked at); `items` are the inputs as
    given, to name the files in messages."""

    files: tuple[tuple[int, str, int | None, str | None], ...]
    items: tuple[str, ...] = ()
    checksums: tuple[tuple[int, str, str], ...] = ()

    @classmethod
    def of(cls, items: Sequence[str], leaves: Sequence[Leaf], threads: int = 1,
           before: InputFiles | None = None) -> InputFiles:
        """The identity of `leaves` (of the inputs `items`): one stat per local file,
        `threads` at a time, and the checksum of the racy ones and of those `before` (the
        recorded identity) has a checksum for."""
        stamps_before = {} if before is None else before.stamps
        sums_before = {} if before is None else before.sums
        now_ns = time.time_ns()

        def stamp(leaf: Leaf) -> tuple[int | None, str | None, str | None]:
            key = _key(leaf)
            return _stamp(leaf, stamps_before.get(key), sums_before.get(key), now_ns)

        if threads > 1 and len(leaves) > threads:
            with ThreadPoolExecutor(threads, "streamds-stat") as pool:
                stamps = list(pool.map(stamp, leaves))
        else:
            stamps = [stamp(leaf) for leaf in leaves]
        files = tuple((*_key(leaf), size, version)
                      for leaf, (size, version, _) in zip(leaves, stamps, strict=True))
        sums = tuple((*_key(leaf), checksum)
                     for leaf, (_, _, checksum) in zip(leaves, stamps, strict=True) if checksum)
        return cls(files, tuple(items), sums)

    @property
    def stamps(self) -> dict[Key, Stamp]:
        """(input index, path under it) -> (size, version)."""
        return {(i, rel): (size, version) for i, rel, size, version in self.files}

    @property
    def sums(self) -> dict[Key, str]:
        """(input index, path under it) -> checksum, for the racy files."""
        return {(i, rel): checksum for i, rel, checksum in self.checksums}

    def changed(self, before: InputFiles) -> list[Key]:
        """These files that are not as `before` recorded them (or not recorded)."""
        then = before.stamps
        rewritten = set(self.rewritten(before))
        return [key for key, stamp in self.stamps.items()
                if then.get(key) != stamp or key in rewritten]

    def rewritten(self, before: InputFiles) -> list[Key]:
        """The files both checksummed, at one size and time, with other contents: rewritten
        within one tick of their clock."""
        then, stamps_then = before.sums, before.stamps
        return [key for key, checksum in self.sums.items()
                if key in then and then[key] != checksum
                and stamps_then.get(key) == self.stamps[key]]

    @property
    def digest(self) -> str:
        """sha256 of the files, sizes and versions: what a journal or plan records."""
        return hashlib.sha256(orjson.dumps([list(f) for f in self.files])).hexdigest()

    def write(self, directory: Path) -> None:
        """Write ``directory/.streamds-inputs.json`` atomically."""
        doc = {"format": INPUTS_FORMAT, "digest": self.digest,
               "files": [list(f) for f in self.files],
               CHECKSUMS_KEY: [list(c) for c in self.checksums]}
        path = directory / INPUTS_NAME
        tmp = directory / f"{INPUTS_NAME}.{socket.gethostname()}.{os.getpid()}.tmp"  # per writer
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(doc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def read(cls, directory: Path) -> InputFiles | None:
        """The identity recorded in `directory`, or None when there is none."""
        path = directory / INPUTS_NAME
        try:
            doc = orjson.loads(path.read_bytes())
            if doc["format"] != INPUTS_FORMAT:
                raise ValueError(f"format {doc['format']!r}, not {INPUTS_FORMAT!r}")
            return cls(tuple((int(i), str(rel), size, version)
                             for i, rel, size, version in doc["files"]), (),
                       # absent in a record written before racy files were checksummed
                       tuple((int(i), str(rel), str(checksum))
                             for i, rel, checksum in doc.get(CHECKSUMS_KEY, [])))
        except FileNotFoundError:
            return None
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ConversionError(
                f"{path}: the record of the inputs is damaged ({err!r}), so it cannot be told "
                "whether they changed; rerun with --overwrite to convert afresh (it deletes "
                "the earlier shards), or convert into a new directory"
            ) from err

    def name(self, input: int, rel: str) -> str:
        """How a message names the file `rel` of input `input`."""
        if input >= len(self.items):
            return f"input {input}: {rel}"
        root = self.items[input]
        if not rel:
            return root
        return f"{root.rstrip('/')}/{rel}"

    def differences(self, before: InputFiles) -> list[str]:
        """What changed from `before` to these files: changed, removed, added (a few named)."""
        now = {(i, rel): (size, version) for i, rel, size, version in self.files}
        then = {(i, rel): (size, version) for i, rel, size, version in before.files}
        changed = []
        for key in (k for k in now if k in then and now[k] != then[k]):
            size, old_size = now[key][0], then[key][0]
            what = (f"{old_size:,} -> {size:,} bytes"
                    if size != old_size and size is not None and old_size is not None
                    else "modified since")
            changed.append(f"{self.name(*key)} ({what})")
        changed += [f"{self.name(*key)} (same size and time, other contents)"
                    for key in self.rewritten(before)]
        removed = [self.name(*k) for k in then if k not in now]
        added = [self.name(*k) for k in now if k not in then]
        found = [f"{len(names):,} {label}: {', '.join(names[:SHOWN])}"
                 + (f" and {len(names) - SHOWN:,} more" if len(names) > SHOWN else "")
                 for names, label in ((changed, "changed"), (removed, "no longer there"),
                                      (added, "added")) if names]
        if not found and list(now) != list(then):
            found.append("the same files are listed in another order")
        return found


def check_inputs(directory: Path, files: InputFiles, *, fix: str) -> None:
    """Refuse when `directory` holds a conversion of other input files (InputsChangedError
    naming them and `fix`); nothing to check in a new directory."""
    before = InputFiles.read(directory)
    if before is None or (before.digest == files.digest and not files.rewritten(before)):
        return
    found = files.differences(before) or ["their sizes or versions differ"]
    raise InputsChangedError(
        f"{directory} holds a conversion of other input files: since it began, "
        f"{'; '.join(found)}. Its shards hold records of the earlier files, so it is not "
        f"resumed or reused; {fix}"
    )


def check_part_files(directory: Path, items: Sequence[str], leaves: Sequence[Leaf], *,
                     fix: str) -> None:
    """Refuse when a file of one part (`leaves`) is not as `directory`'s record of the
    inputs says: a task that starts after the plan was made (on another machine, later in a
    job array) sees the files it reads as they are now."""
    recorded = InputFiles.read(directory)
    if recorded is None:
        return
    now = InputFiles.of(items, leaves, before=recorded)
    changed = [now.name(*key) for key in now.changed(recorded)]
    if changed:
        more = f" and {len(changed) - SHOWN:,} more" if len(changed) > SHOWN else ""
        raise InputsChangedError(
            f"{directory}: input files changed since the conversion began ({len(changed):,} "
            f"of this part's: {', '.join(changed[:SHOWN])}{more}), so the part is not "
            f"converted: its records would mix with the earlier files' in the other parts; {fix}"
        )


class InputsWatch:
    """The checks during a conversion that its inputs stay as `files` (the identity recorded
    when it began) says: `check_file` after a file is read, `check_files` before the
    manifest. InputsChangedError naming the files (of the inputs `items`) that changed and
    `fix`."""

    def __init__(self, files: InputFiles, items: Sequence[str], *, fix: str,
                 threads: int = 1) -> None:
        self.files = InputFiles(files.files, tuple(items), files.checksums)  # items: names
        self.fix = fix
        self.threads = threads

    def check_file(self, leaf: Leaf) -> None:
        """After `leaf` is read: a JSON lines or tar file, read over time, must not have
        changed meanwhile (small .json files, read in one go, wait for `check_files`)."""
        if leaf.fs is None and leaf.kind != "json":
            self.check_files([leaf])

    def check_files(self, leaves: Sequence[Leaf]) -> None:
        """Every local file of `leaves` must be as recorded (remote files are not asked
        again: that would cost a request each)."""
        local = [leaf for leaf in leaves if leaf.fs is None]
        now = InputFiles.of(self.files.items, local, self.threads, before=self.files)
        changed = [now.name(*key) for key in now.changed(self.files)]
        if changed:
            more = f" and {len(changed) - SHOWN:,} more" if len(changed) > SHOWN else ""
            raise InputsChangedError(
                f"input files changed while they were converted ({', '.join(changed[:SHOWN])}"
                f"{more}): the shards may hold records of two versions of them, so no "
                f"manifest is written and the output is not read; once the inputs stay "
                f"unchanged, {self.fix}"
            )
