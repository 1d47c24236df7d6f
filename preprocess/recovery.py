"""Resuming an interrupted conversion: verify what the journal lists, delete everything else.

`prepare_output` runs before any record is read. In a new or empty directory (or one holding
only the converter's own temporary files, left by a run killed while writing its first file)
it writes an empty journal at once, so a run killed before its first shard is resumed, not
refused. In one holding a journal it keeps the journaled shards whose size and xxh64
checksum still match (up to the first that does not), rewinds the journal to them, and
deletes unjournaled shards, temporary files and a manifest of an unfinished conversion, so
the run continues from the input position recorded after the last good shard.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from streamds.formats.manifest import MANIFEST_NAME, ShardEntry, file_checksum

from .errors import ConversionError
from .identity import INPUTS_NAME, InputFiles, is_inputs_temporary
from .journal import JOURNAL_NAME, SKIPPED_KEY, Journal
from .lock import LOCK_NAME
from .parts_plan import PLAN_NAME
from .writers import FORMATS, is_shard_name

__all__ = ["clear_output", "is_temporary", "prepare_output", "shard_intact"]

PART_FOLDER = re.compile(r"part-\d{5}")  # plan.Part.folder

log = logging.getLogger(__name__)


def shard_intact(directory: Path, entry: ShardEntry) -> bool:
    """Whether the shard `entry` names is in `directory` with its size and checksum."""
    path = directory / entry.name
    try:
        if path.stat().st_size != entry.bytes:
            return False
    except FileNotFoundError:
        return False
    return file_checksum(path) == entry.checksum


def is_temporary(name: str, fmt: str) -> bool:
    """Whether `name` is a temporary file the converter writes (a shard, the journal, the
    manifest, the record of the inputs) before renaming it."""
    if is_inputs_temporary(name):
        return True
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    final = name[1:-len(".tmp")]
    return is_shard_name(final, fmt) or final in (JOURNAL_NAME[1:], MANIFEST_NAME)


def _converter_file(name: str) -> bool:
    """Whether `name` is a file the converter writes into an output or part folder."""
    return (name in (JOURNAL_NAME, MANIFEST_NAME, PLAN_NAME, INPUTS_NAME, LOCK_NAME)
            or any(is_shard_name(name, fmt) or is_temporary(name, fmt) for fmt in FORMATS)
            or (name.startswith(f".{PLAN_NAME}.") and name.endswith(".tmp")))


def _part_folder(path: Path) -> bool:
    return bool(PART_FOLDER.fullmatch(path.name)) and path.is_dir() and not path.is_symlink()


def clear_output(output: Path) -> int:
    """Delete an earlier conversion in `output` (``--overwrite``): its shards, journal,
    manifest, plan and part folders; other files stay (the conversion then refuses them).
    Returns the number of files deleted. ConversionError when `output` holds files but no
    conversion: nothing is deleted that the converter did not write."""
    try:
        names = sorted(name for name in os.listdir(output) if name != LOCK_NAME)  # held
    except FileNotFoundError:
        return 0
    ours = {JOURNAL_NAME, PLAN_NAME} & set(names) or all(
        _part_folder(output / name) and all(map(_converter_file, os.listdir(output / name)))
        for name in names
    )  # a conversion, or what an earlier --overwrite left: part folders of other files
    if not ours:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConversionError(
            f"{output} holds no earlier conversion ({JOURNAL_NAME} or {PLAN_NAME}) but other "
            f"files ({shown}); --overwrite deletes only what the converter wrote: convert into "
            "an empty or new directory"
        )
    deleted = 0
    for name in names:
        path = output / name
        if _part_folder(path):
            for inner in os.listdir(path):
                if _converter_file(inner) and inner != LOCK_NAME:
                    (path / inner).unlink()
                    deleted += 1
            if not os.listdir(path):
                path.rmdir()
        elif _converter_file(name):
            path.unlink()
            deleted += 1
    log.info("%s: deleted %d files of an earlier conversion (--overwrite)", output, deleted)
    return deleted


def prepare_output(output: Path, journal: Journal, fmt: str,
                   files: InputFiles | None = None) -> int:
    """Load and verify the journal, clean the directory; return the number of reused shards.

    `files`: the inputs' identity, recorded when the conversion begins here (None: a part,
    whose plan recorded it)."""
    output.mkdir(parents=True, exist_ok=True)
    if not journal.load():
        leftovers = []
        for name in sorted(os.listdir(output)):
            if name == LOCK_NAME:  # this run's lock
                continue
            if is_temporary(name, fmt) or name == INPUTS_NAME:  # a run killed while
                (output / name).unlink()                         # writing its first file
            else:
                leftovers.append(name)
        if leftovers:
            shown = ", ".join(leftovers[:3]) + (", ..." if len(leftovers) > 3 else "")
            raise ConversionError(
                f"{output} is not empty ({shown})"
                f" and holds no conversion journal ({JOURNAL_NAME}); convert into an empty or "
                "new directory"
            )
        if files is not None:
            files.write(output)  # before the journal: a journal always has its inputs' record
        journal.write()  # claims the directory: a kill before the first shard is resumable
        return 0
    good = 0
    for item in journal.shards:
        if not shard_intact(output, ShardEntry.from_json(item["shard"], where=str(journal.path))):
            break
        good += 1
    if good < len(journal.shards):
        log.warning("%s: shard %s is damaged or missing; converting again from there",
                    output, journal.shards[good]["shard"]["name"])
        journal.shards = journal.shards[:good]
        journal.end = None
        journal.skipped = []
        journal.write()
    if journal.end is None and journal.shards and journal.shards[-1]["next"] is None:
        journal.end = journal.shards[-1]["counts"]  # killed between the last two writes
        journal.skipped = journal.shards[-1][SKIPPED_KEY]
        journal.write()  # on disk too: a part is finished only when its journal says so
    keep = {item["shard"]["name"] for item in journal.shards}
    for name in os.listdir(output):
        stale_shard = is_shard_name(name, fmt) and name not in keep
        temporary = name.startswith(".") and name.endswith(".tmp")
        stale_manifest = name == MANIFEST_NAME and not journal.complete
        if stale_shard or temporary or stale_manifest:
            (output / name).unlink()
    return good
