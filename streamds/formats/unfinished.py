"""Unfinished conversions: a folder with the converter's journal or plan and no manifest.

`streamds convert` claims its output with a journal (``.streamds-convert.json``, or in
parts a plan, ``_plan.json``, beside a journal per part folder) and writes ``manifest.json``
last. A folder holding a journal or a plan without a manifest is a conversion that stopped
(killed, a part failed, two runs got in each other's way): its shards hold some of the
records, so reading it would silently lose the rest. Folder listings refuse it
(`check_finished`), naming the command that finishes it, as rebuilt from what the journal
or plan recorded (inputs as given, credentials already redacted; the options).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Iterable
from typing import Any

import orjson

__all__ = [
    "JOURNAL_NAME",
    "MARKER_NAMES",
    "PLAN_NAME",
    "UnfinishedConversionError",
    "check_finished",
    "finish_command",
]

JOURNAL_NAME = ".streamds-convert.json"  # the converter's journal (preprocess.journal)
PLAN_NAME = "_plan.json"  # the plan of a conversion in parts (preprocess.parts_plan)
MARKER_NAMES = (JOURNAL_NAME, PLAN_NAME)
_PART = re.compile(r"part-\d{5}")  # a part's folder (preprocess.parts_plan.Part.folder)

# command-line flag of each recorded option (preprocess.command)
_FLAGS = (("format", "--format"), ("shard_size", "--shard-size"), ("level", "--level"),
          ("frame_size", "--frame-size"), ("transform", "--transform"),
          ("on_error", "--on-error"), ("parts", "--parts"))


class UnfinishedConversionError(FileNotFoundError):
    """A folder whose conversion did not finish: its manifest is missing, so its shards hold
    only part of the records."""


def _split(path: str) -> tuple[str, str]:
    """(folder, name) of a path as a listing names it (a local path or a URL)."""
    cut = max(path.rfind("/"), path.rfind(os.sep))
    return path[:cut], path[cut + 1:]


def finish_command(doc: dict[str, Any], output: str) -> str:
    """``streamds convert ...`` as the journal or plan `doc` of the conversion into `output`
    recorded it (fields it lacks are left out)."""
    fingerprint = doc.get("fingerprint") or {}
    words = ["streamds", "convert", *map(str, fingerprint.get("inputs") or ["INPUT..."]),
             "--output", output]
    options = fingerprint.get("options") or {}
    for key, flag in _FLAGS:
        if options.get(key) is not None:
            words += [flag, str(options[key])]
    return shlex.join(words)


def check_finished(markers: Iterable[str], manifests: Iterable[str],
                   read: Callable[[str], bytes], shown: Callable[[str], str]) -> None:
    """Raise UnfinishedConversionError when a folder holds one of `markers` (journals and
    plans a listing passed) but none of `manifests`; `read` reads a marker, `shown` names a
    folder in messages. The outermost such folder is named (a conversion in parts has its
    plan above the parts' journals)."""
    finished = {_split(path)[0] for path in manifests}

    def done(folder: str) -> bool:  # a part folder is covered by its merged conversion's
        parent, name = _split(folder)
        return folder in finished or (bool(_PART.fullmatch(name)) and parent in finished)

    stopped = sorted((_split(path) for path in markers if not done(_split(path)[0])),
                     key=lambda found: (len(found[0]), found[1] != PLAN_NAME))
    if not stopped:
        return
    folder, name = stopped[0]
    where = shown(folder)
    try:
        doc = orjson.loads(read(f"{folder}/{name}"))
    except (OSError, orjson.JSONDecodeError):
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    fingerprint = doc.get("fingerprint") or {}
    if name == PLAN_NAME:
        fix = (f"rerun the command that made it ({finish_command(doc, where)}), which redoes "
               "only the unfinished parts; or, where the parts run one by one (--part K), run "
               "the unfinished ones, then the same command with --merge")
    elif isinstance(fingerprint, dict) and "part" in fingerprint:
        parent = shown(_split(folder)[0])
        fix = (f"it is one part of the conversion into {parent}: rerun that conversion "
               f"({finish_command(doc, parent)}), then read {parent}")
    else:
        fix = (f"rerun the command that made it ({finish_command(doc, where)}): it resumes "
               "where it stopped and writes the manifest")
    raise UnfinishedConversionError(
        f"{where} holds an unfinished conversion: its {name} is there but not its manifest.json "
        "(the conversion was stopped, or a part of it failed), so its shards hold only some "
        f"of the records and reading them would silently lose the rest; {fix}"
    )
