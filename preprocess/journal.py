"""The conversion journal: finished shards and where the input continues after each.

It lives in the output directory as ``.streamds-convert.json`` (hidden, so readers skip it)
and is rewritten atomically (temporary file, fsync, rename) after every shard. Its shape::

    {"format": "streamds.convert-journal/1",
     "fingerprint": {"inputs": [...], "options": {...}},
     "shards": [{"shard": entry, "next": position | None, "counts": {...},
                 "stored_bytes": n, "skipped": [place, ...]}, ...],
     "end": counts | None, "skipped": [place, ...]}

``next`` is the input position the shard after this one starts at (None: the input ended);
``end`` is set once every record is in a shard. ``skipped`` names where the first bad
records skipped under ``--on-error skip`` were (file and line), up to that shard or the end.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from streamds.formats.manifest import ShardEntry
from streamds.formats.unfinished import JOURNAL_NAME as UNFINISHED_JOURNAL

from .counts import Counts
from .errors import ConversionError
from .sources import Position

__all__ = ["JOURNAL_FORMAT", "JOURNAL_NAME", "SKIPPED_KEY", "Journal"]

JOURNAL_NAME = UNFINISHED_JOURNAL  # one name for the converter and the readers that refuse it
JOURNAL_FORMAT = "streamds.convert-journal/1"
SKIPPED_KEY = "skipped"


class Journal:
    """The journal of the conversion into `directory`, made by `fingerprint` (inputs, options)."""

    def __init__(self, directory: Path, fingerprint: dict[str, Any]) -> None:
        self.path = directory / JOURNAL_NAME
        self.fingerprint = fingerprint
        self.shards: list[dict[str, Any]] = []
        self.end: dict[str, int] | None = None
        self.skipped: list[str] = []  # set with `end`

    def load(self) -> bool:
        """Read the journal if there is one; refuse one made by other inputs or options."""
        try:
            doc = orjson.loads(self.path.read_bytes())
        except FileNotFoundError:
            return False
        except orjson.JSONDecodeError as err:
            raise ConversionError(
                f"{self.path}: the conversion journal is damaged ({err}); convert into an "
                "empty directory"
            ) from err
        if doc.get("format") != JOURNAL_FORMAT:
            raise ConversionError(f"{self.path}: not a {JOURNAL_FORMAT} journal")
        if doc["fingerprint"] != self.fingerprint:
            theirs, ours = doc["fingerprint"], self.fingerprint
            diff = [
                f"{key}: {theirs['options'].get(key)!r} -> {value!r}"
                for key, value in ours["options"].items()
                if theirs["options"].get(key) != value
            ]
            if theirs["inputs"] != ours["inputs"]:
                diff.append(f"inputs: {theirs['inputs']} -> {ours['inputs']}")
            if theirs.get("part") != ours.get("part"):
                diff.append("the plan of parts (the inputs changed since it was made?)")
            if theirs.get("files") != ours.get("files"):
                diff.append("the input files (names, sizes or modification times)")
            raise ConversionError(
                f"{self.path.parent} holds a conversion made with other inputs or options "
                f"({'; '.join(diff)}); rerun the same command to resume it, rerun with "
                "--overwrite to convert afresh (it deletes the earlier shards), or convert "
                "into an empty directory"
            )
        self.shards = list(doc["shards"])
        self.end = doc["end"]
        self.skipped = list(doc[SKIPPED_KEY])
        return True

    @staticmethod
    def read_skipped(directory: Path) -> list[str]:
        """The skipped places a finished conversion's journal in `directory` names."""
        return list(orjson.loads((directory / JOURNAL_NAME).read_bytes())[SKIPPED_KEY])

    @property
    def complete(self) -> bool:
        return self.end is not None

    def add(self, entry: ShardEntry, next_position: Position | None, counts: Counts,
            stored_bytes: int, skipped: tuple[str, ...] = ()) -> None:
        self.shards.append({
            "shard": entry.to_json(),
            "next": None if next_position is None else next_position.to_json(),
            "counts": asdict(counts),
            "stored_bytes": stored_bytes,
            SKIPPED_KEY: list(skipped),
        })

    def write(self) -> None:
        doc = {"format": JOURNAL_FORMAT, "fingerprint": self.fingerprint,
               "shards": self.shards, "end": self.end, SKIPPED_KEY: self.skipped}
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(doc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
