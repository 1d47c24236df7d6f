"""Convert JSONL files, small-file trees and tar shards into seekable zstd (or tar) shards.

The pipeline, one stage per line::

    check the options, load the transform       # here
      -> Journal + prepare_output               # journal.py, recovery.py: verify, clean up
      -> ConversionRun.run()                    # run.py: records -> shards, in input order
           -> CommitQueue -> Journal            # commit.py: each shard journaled in order
      -> write_manifest                         # last, atomically

Output is a function of the inputs and options only: ``--workers`` changes how many shards
compress at once (in threads: zstd releases the GIL), ``--read-ahead`` how many ``.json``
files are opened at once (`preprocess.readahead`), never the bytes. Inputs may be fsspec URLs
(``https://``, ``s3://``, ``memory://``), listed and ordered by the same rule as local ones.
After a crash (even ``kill -9``), the same command verifies the shards the journal lists,
deletes anything else, and continues from the input position the journal recorded after the
last good shard, so every record lands exactly once and finished shards are not rewritten.
The manifest is written last, atomically.

Library use::

    from preprocess.convert import convert
    result = convert(["data/train.txt"], "shards/", shard_size=64 << 20, workers=2)
    result.manifest.totals["records"]
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamds.checks import check_choice, check_int
from streamds.formats.manifest import Manifest, ShardEntry, write_manifest
from streamds.formats.seekable import MAX_FRAME_SIZE
from streamds.parse import ON_ERROR
from streamds.retry import DEFAULT_RETRY, RetryPolicy
from streamds.shards import source_items
from streamds.tools.spec import load_function

from .commit import CommitQueue
from .counts import Counts, Progress
from .errors import ConversionError
from .journal import JOURNAL_NAME, Journal
from .recovery import prepare_output
from .run import ConversionRun
from .sources import DEFAULT_READ_AHEAD, DEFAULT_READ_AHEAD_BYTES, Inputs, Meter
from .writers import FORMATS

__all__ = [
    "DEFAULT_FRAME_SIZE",
    "DEFAULT_READ_AHEAD",
    "DEFAULT_READ_AHEAD_BYTES",
    "DEFAULT_SHARD_SIZE",
    "JOURNAL_NAME",
    "ConversionError",
    "ConvertResult",
    "Counts",
    "Progress",
    "convert",
]

DEFAULT_SHARD_SIZE = 256 * 10**6
DEFAULT_FRAME_SIZE = 4 << 20


@dataclass(frozen=True)
class ConvertResult:
    """A finished conversion: the manifest, plus what this run did (not in the manifest)."""

    output: Path
    manifest: Manifest
    shards_reused: int  # verified shards kept from an interrupted run
    shards_written: int
    stored_bytes: int  # input bytes read by this run
    seconds: float

    @property
    def counts(self) -> Counts:
        return Counts(**self.manifest.counts)


def _transform_name(transform: str | Callable[[Any], Any] | None) -> str | None:
    if transform is None or isinstance(transform, str):
        return transform
    module = getattr(transform, "__module__", None) or type(transform).__module__
    name = getattr(transform, "__qualname__", None) or repr(transform)
    return f"{module}:{name}"


def _check_options(shard_size: int, fmt: str, level: int, frame_size: int, on_error: str,
                   workers: int, read_ahead: int, read_ahead_bytes: int) -> None:
    check_int("shard_size", shard_size, 1, "e.g. 256MB (the default)", maximum=1 << 50)
    check_int("level", level, -7, "3 (the default) for speed, 19 for size", maximum=22)
    check_int("frame_size", frame_size, 1, "a few MiB (the default, 4 MiB)",
              maximum=MAX_FRAME_SIZE)
    check_int("workers", workers, 1, "about the number of CPU cores", maximum=256)
    check_int("read_ahead", read_ahead, 0,
              f"{DEFAULT_READ_AHEAD} (the default) for a mount or URL, 0 for one file at a time",
              maximum=1024)
    check_int("read_ahead_bytes", read_ahead_bytes, 0,
              f"e.g. {DEFAULT_READ_AHEAD_BYTES >> 20} MiB (the default)", maximum=1 << 40)
    check_choice("format", fmt, tuple(FORMATS))
    check_choice("on_error", on_error, ON_ERROR)


def convert(
    inputs: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    format: str = "jsonl.zst",
    level: int = 3,
    frame_size: int = DEFAULT_FRAME_SIZE,
    transform: str | Callable[[Any], Any] | None = None,
    on_error: str = "raise",
    workers: int = 1,
    read_ahead: int = DEFAULT_READ_AHEAD,
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
    progress: Callable[[Progress], None] | None = None,
) -> ConvertResult:
    """Convert `inputs` into shards in `output`; resume there if a conversion was interrupted.

    `shard_size` counts uncompressed bytes (JSONL bytes, or tar bytes); a shard closes before
    the record that would overflow it. `transform` is a callable or a ``module:function``
    spec applied to each record (None drops it). `on_error="skip"` skips and counts
    malformed records and unreadable compressed or tar files instead of raising
    ConversionError. `workers` > 1 compresses that many shards at once in threads.
    `read_ahead` ``.json`` files open at once (and local folders list at once; 0: one at a
    time), spread over folders, with up to `read_ahead_bytes` read beyond the next
    `read_ahead` files: what makes a tree of small files on a mount or behind a URL fast.
    `storage_options` go to fsspec for URL inputs (they are not recorded anywhere);
    `retry` says how transient read errors are retried. The output depends on none of these.
    Memory: one frame per shard in flight, ~16 MiB of queued lines per background shard,
    `read_ahead_bytes` plus one file per read-ahead thread, and the list of input files.
    """
    _check_options(shard_size, format, level, frame_size, on_error, workers, read_ahead,
                   read_ahead_bytes)
    started = time.perf_counter()
    out = Path(output)
    items = source_items(inputs, name="inputs")
    source = Inputs(items, storage_options=storage_options, read_ahead=read_ahead,
                    read_ahead_bytes=read_ahead_bytes, retry=retry)
    apply = load_function(transform) if isinstance(transform, str) else transform
    if apply is not None and not callable(apply):
        raise ValueError(f"transform must be callable or 'module:function', got {transform!r}")
    options = {
        "format": format,
        "shard_size": shard_size,
        "level": level if format == "jsonl.zst" else None,
        "frame_size": frame_size if format == "jsonl.zst" else None,
        "transform": _transform_name(transform),
        "on_error": on_error,
    }
    journal = Journal(out, {"inputs": items, "options": options})
    reused = prepare_output(out, journal, format)
    source.exclude(out)
    meter = Meter()
    commits = CommitQueue(journal, workers)
    if not journal.complete:
        ConversionRun(
            source, out, format=format, level=level, frame_size=frame_size, shard_size=shard_size,
            apply=apply, skip_errors=on_error == "skip", workers=workers, commits=commits,
            meter=meter, progress=progress,
        ).run()
    manifest = Manifest(
        shard_format=format,
        shards=tuple(ShardEntry.from_json(item["shard"]) for item in journal.shards),
        counts=dict(journal.end or {}),
        options=options,
        inputs=tuple(items),
    )
    write_manifest(out, manifest)
    return ConvertResult(
        output=out,
        manifest=manifest,
        shards_reused=reused,
        shards_written=commits.written,
        stored_bytes=meter.stored_bytes,
        seconds=time.perf_counter() - started,
    )
