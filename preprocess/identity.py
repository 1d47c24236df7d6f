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
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import orjson

from .errors import ConversionError
from .sources import Leaf

__all__ = [
    "INPUTS_FORMAT",
    "INPUTS_NAME",
    "InputFiles",
    "InputsChangedError",
    "check_inputs",
    "check_part_files",
    "is_inputs_temporary",
]

INPUTS_NAME = ".streamds-inputs.json"
INPUTS_FORMAT = "streamds.convert-inputs/1"
SHOWN = 3  # files named per kind of difference in a message

Stamp = tuple[int | None, str | None]  # (stored size, version)


class InputsChangedError(ConversionError):
    """The inputs are not the files an earlier conversion into the same output read."""


def is_inputs_temporary(name: str) -> bool:
    """Whether `name` is the temporary file of a writer of `INPUTS_NAME`."""
    return name.startswith(f"{INPUTS_NAME}.") and name.endswith(".tmp")


def _stamp(leaf: Leaf) -> Stamp:
    if leaf.fs is not None:
        return leaf.size, leaf.version
    try:
        info = os.stat(leaf.path)
    except OSError as err:
        why = (f"a broken symbolic link (to {os.readlink(leaf.path)})"
               if os.path.islink(leaf.path) else f"unreadable ({err.strerror})")
        raise ConversionError(
            f"{leaf.path}: the input file is {why}; fix or remove it, then rerun"
        ) from err
    return info.st_size, str(info.st_mtime_ns)


@dataclass(frozen=True)
class InputFiles:
    """Every input file as ``(input index, path under the input, size, version)``, in input
    order; `items` are the inputs as given, to name the files in messages."""

    files: tuple[tuple[int, str, int | None, str | None], ...]
    items: tuple[str, ...] = ()

    @classmethod
    def of(cls, items: Sequence[str], leaves: Sequence[Leaf], threads: int = 1) -> InputFiles:
        """The identity of `leaves` (of the inputs `items`): one stat per local file,
        `threads` at a time."""
        if threads > 1 and len(leaves) > threads:
            with ThreadPoolExecutor(threads, "streamds-stat") as pool:
                stamps = list(pool.map(_stamp, leaves))
        else:
            stamps = [_stamp(leaf) for leaf in leaves]
        files = tuple(
            (leaf.input, "" if leaf.rel is None else "/".join(leaf.rel), size, version)
            for leaf, (size, version) in zip(leaves, stamps, strict=True)
        )
        return cls(files, tuple(items))

    @property
    def digest(self) -> str:
        """sha256 of the files, sizes and versions: what a journal or plan records."""
        return hashlib.sha256(orjson.dumps([list(f) for f in self.files])).hexdigest()

    def write(self, directory: Path) -> None:
        """Write ``directory/.streamds-inputs.json`` atomically."""
        doc = {"format": INPUTS_FORMAT, "digest": self.digest,
               "files": [list(f) for f in self.files]}
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
                             for i, rel, size, version in doc["files"]))
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
    if before is None or before.digest == files.digest:
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
    now = InputFiles.of(items, leaves)
    then = {(i, rel): (size, version) for i, rel, size, version in recorded.files}
    changed = [now.name(i, rel) for i, rel, size, version in now.files
               if then.get((i, rel)) != (size, version)]
    if changed:
        more = f" and {len(changed) - SHOWN:,} more" if len(changed) > SHOWN else ""
        raise InputsChangedError(
            f"{directory}: input files changed since the conversion began ({len(changed):,} "
            f"of this part's: {', '.join(changed[:SHOWN])}{more}), so the part is not "
            f"converted: its records would mix with the earlier files' in the other parts; {fix}"
        )
