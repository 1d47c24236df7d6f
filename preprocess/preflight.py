"""Checks before a conversion touches its output: where the output goes, what the inputs hold.

::

    check_output_path(out)               # a directory or nothing yet, never a file
    check_output_outside(source, out)    # not inside an input folder that is walked
    check_listing(source, leaves)        # each folder or glob names files, none of them
                                         #   inside an earlier converter's output

Each refusal is a ConversionError that names the paths and what to do, raised before the
output directory is made.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from streamds.formats.manifest import MANIFEST_NAME
from streamds.formats.trees import Rel

from .errors import ConversionError
from .journal import JOURNAL_NAME
from .listing import ListingWalk
from .parts_plan import PLAN_NAME
from .sources import Inputs, Leaf
from .writers import FORMATS, is_shard_name

__all__ = [
    "OUTPUT_MARKERS",
    "RECORD_FILES",
    "check_listing",
    "check_output_outside",
    "check_output_path",
]

# a folder holding one of these was written by the converter (the manifest counts only
# beside shards: a tree of .json files may hold its own manifest.json)
OUTPUT_MARKERS = frozenset({JOURNAL_NAME, PLAN_NAME, MANIFEST_NAME})
RECORD_FILES = (
    "record files end in .json, .jsonl, .ndjson, .tar or .tgz, plain or compressed (.gz, "
    ".zst, .bz2, .xz), at any depth, hidden names and manifest.json skipped"
)


def check_output_path(out: Path) -> None:
    """`out` must be a directory or not exist yet."""
    if out.exists() and not out.is_dir():
        raise ConversionError(
            f"--output {out} is a file, not a directory: the converter writes its shards and "
            f"manifest.json into a directory; name a new or empty directory (e.g. "
            f"{out.with_name(out.name + '.shards')})"
        )


def check_output_outside(source: Inputs, out: Path) -> None:
    """`out` must not lie inside a local input folder (or a glob's folder the glob enters):
    its shards would be records of the input on the next run."""
    real_out = Path(os.path.realpath(out))
    for item, plan in zip(source.items, source.plans, strict=True):
        if not isinstance(plan, ListingWalk):
            continue
        root = Path(os.path.realpath(plan.root or "."))
        if real_out != root and root not in real_out.parents:
            continue
        rel = real_out.relative_to(root).parts
        if all(plan.pattern.may_enter(rel[:k]) for k in range(1, len(rel) + 1)):
            raise ConversionError(
                f"the output {out} lies inside the input {item}, so its shards would be read "
                "as input by a later run; choose an output outside it (e.g. "
                f"{root.parent / (root.name + '-shards')})"
            )


def check_listing(source: Inputs, leaves: Sequence[Leaf]) -> None:
    """Every folder or glob input names at least one file, and none lies inside an earlier
    output of the converter (unless the input is that output: converting it again)."""
    by_input: dict[int, list[Leaf]] = {}
    for leaf in leaves:
        by_input.setdefault(leaf.input, []).append(leaf)
    for index, (item, plan) in enumerate(zip(source.items, source.plans, strict=True)):
        if not isinstance(plan, ListingWalk):
            continue
        found = by_input.get(index, [])
        if not found:
            raise ConversionError(_nothing_named(item, plan))
        nested = _earlier_output(plan, found)
        if nested is not None:
            folder, markers = nested
            path = os.path.join(plan.root, *folder)
            raise ConversionError(
                f"the input {item} holds an earlier output of the converter, {path} (it holds "
                f"{', '.join(markers)}): its shards would be read as records a second time. "
                f"Move {path} out of {item}, or name the inputs without it (files or a glob); "
                f"to convert that output again, name {path} as the input"
            )


def _nothing_named(item: str, walk: ListingWalk) -> str:
    glob = walk.pattern.parts is not None
    folder = walk.root or "."
    if walk.files_seen == 0:
        what = f"no files match {item!r}" if glob else f"the folder {item} holds no files"
    else:
        shown = ", ".join("/".join(rel) for rel in walk.some_files)
        more = ", ..." if walk.files_seen > len(walk.some_files) else ""
        held = f"{walk.files_seen:,} files ({shown}{more})"
        what = (f"no files match {item!r} (its folder {folder} holds {held})" if glob else
                f"the folder {item} holds {held}, none of them a record file")
    return (
        f"nothing to convert: {what} ({RECORD_FILES}). Name other files of JSON lines "
        f"(such as .txt) one by one or with a glob (e.g. '{folder}/*.txt')"
    )


def _earlier_output(walk: ListingWalk, leaves: Sequence[Leaf]
                    ) -> tuple[Rel, tuple[str, ...]] | None:
    """The topmost folder below the walk's root that is an earlier output and holds some of
    `leaves`; None when the root is one (the input is an output) or there is none."""
    shard_folders = {leaf.rel[:-1] for leaf in leaves if leaf.rel is not None
                     and any(is_shard_name(leaf.rel[-1], fmt) for fmt in FORMATS)}
    outputs = {
        rel: markers for rel, markers in walk.marked.items()
        if set(markers) - {MANIFEST_NAME} or rel in shard_folders
    }
    if () in outputs:
        return None
    for leaf in leaves:
        rel = leaf.rel or ()
        for depth in range(1, len(rel)):
            if rel[:depth] in outputs:
                return rel[:depth], outputs[rel[:depth]]
    return None
