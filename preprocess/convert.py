"""Convert JSONL files, small-file trees, tar shards, Parquet and Arrow files into seekable
zstd (or tar) shards.

The pipeline, one stage per line::

    Job: check the options, load the transform  # job.py
      -> prepare: the plan of parts             # parts.py, parts_plan.py: _plan.json (or one part)
      -> one part: convert_directory(out)       # job.py: journal, run, manifest
         parts: run_plan(executor)              # parts.py: a task per part, then the merge

Output is a function of the inputs and options only (`parts` included): ``--workers``
changes how many shards compress at once (in threads: zstd releases the GIL), ``--read-ahead``
how many ``.json`` files are opened at once (`files_ahead`), the executor where the
parts run, never the bytes. Inputs may be fsspec URLs (``https://``, ``s3://``,
``memory://``), listed and ordered by the same rule as local ones. After a crash (even
``kill -9``), the same command verifies the shards the journal lists, deletes anything else,
and continues from the input position the journal recorded after the last good shard, so
every record lands exactly once and finished shards are not rewritten; in parts, finished
parts are skipped. The manifest is written last, atomically.

Library use::

    from streamds.preprocess.convert import convert
    result = convert(["data/train.txt"], "shards/", shard_size=64 << 20, workers=2)
    result.manifest.totals["records"]

    from distributed import Client            # the same conversion on a Dask cluster
    convert(["big.jsonl"], "shards/", parts=64, executor=Client("tcp://host:8786").get_executor())
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from streamds.checks import check_int
from streamds.retry import DEFAULT_RETRY, RetryPolicy
from streamds.storage.shards import source_items

from .conversion_counts import Counts, Progress
from .errors import ConversionError
from .identity import InputFiles, InputsChangedError, InputsWatch, check_inputs
from .job import (
    DEFAULT_FRAME_SIZE,
    DEFAULT_SHARD_SIZE,
    ConvertResult,
    Job,
    convert_directory,
    job_fingerprint,
)
from .journal import JOURNAL_NAME
from .lock import output_lock
from .parts import PARTS_FIX, PartTask, merge, prepare, run_part, run_plan
from .parts_plan import MAX_PARTS, Plan
from .preflight import check_listing, check_output_outside, check_output_path
from .recovery import clear_output
from .sources import DEFAULT_READ_AHEAD, DEFAULT_READ_AHEAD_BYTES, Inputs

__all__ = [
    "DEFAULT_FRAME_SIZE",
    "DEFAULT_READ_AHEAD",
    "DEFAULT_READ_AHEAD_BYTES",
    "DEFAULT_SHARD_SIZE",
    "JOURNAL_NAME",
    "ConversionError",
    "ConvertResult",
    "Counts",
    "InputsChangedError",
    "Progress",
    "convert",
    "convert_part",
    "merge_parts",
]


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
    parts: int | None = None,
    executor: Executor | None = None,
    progress: Callable[[Progress], None] | None = None,
    overwrite: bool = False,
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

    `parts` cuts the input into that many parts of similar size (`parts_plan`; None:
    one per GiB, or what `output` was started with), each converted into its own folder by
    a task that `executor` runs (any `concurrent.futures.Executor`: a process pool, a Dask
    cluster's ``Client.get_executor()``; None: here, one after another); the output depends
    on `parts`, never on the executor. One part writes straight into `output`.

    A rerun resumes or reuses `output` only over the same input files (names, sizes,
    modification times: `preprocess.identity`); other files are refused (InputsChangedError
    naming them) unless `overwrite`, which deletes the earlier conversion first and converts
    afresh. Converting nothing is an error: an input folder or glob that names no files, or
    a conversion that writes no record (all dropped by the transform, all bad).

    Memory per task: one frame per shard in flight, ~16 MiB of queued lines per background
    shard, `read_ahead_bytes` plus one file per read-ahead thread, and its list of files.
    """
    job = Job(tuple(source_items(inputs, name="inputs")), format=format, shard_size=shard_size,
              level=level, frame_size=frame_size, transform=transform, on_error=on_error,
              workers=workers, read_ahead=read_ahead, read_ahead_bytes=read_ahead_bytes,
              storage_options=storage_options, retry=retry)
    job.check_writer()
    ready = _prepared(job, output, parts, overwrite=overwrite, fix=_FIX)
    if ready.plan is not None:
        return run_plan(job, Path(output), ready.plan, executor, progress, ready.source)
    return convert_directory(job, Path(output), source=ready.source, apply=ready.apply,
                             fingerprint=job_fingerprint(job, ready.files), files=ready.files,
                             progress=progress, watch=ready.watch(job, _FIX))


def convert_part(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, part: int, *,
                 parts: int | None = None,
                 progress: Callable[[Progress], None] | None = None,
                 **options: Any) -> ConvertResult:
    """Convert part `part` of the conversion `convert(inputs, output, parts=parts,
    **options)` would run (the whole of it when it has one part); for launchers that start
    one process per part, such as a Slurm job array. Skips a finished part. Makes and
    writes the plan if no task has yet, so every task may start at once. `progress` hears
    how far this part has read, out of its planned bytes (`bytes_total`)."""
    job = Job(tuple(source_items(inputs, name="inputs")), **options)
    job.check_writer()
    ready = _prepared(job, output, parts, fix=PARTS_FIX.format(output=output))
    plan = ready.plan
    if plan is None:
        if part != 0:
            raise ConversionError(
                f"the conversion into {output} has 1 part; part {part} does not exist"
            )
        return convert_directory(job, Path(output), source=ready.source, apply=ready.apply,
                                 fingerprint=job_fingerprint(job, ready.files),
                                 files=ready.files, progress=progress,
                                 watch=ready.watch(job, _FIX))
    if not 0 <= part < len(plan.parts):
        raise ConversionError(
            f"the conversion into {output} has {len(plan.parts)} parts, 0 to "
            f"{len(plan.parts) - 1}; part {part} does not exist"
        )
    planned = plan.parts[part]
    task = PartTask(job, str(output), planned, plan.fingerprint)
    if progress is None:
        return run_part(task, ready.source)
    # the reads of a part know no total of their own: the plan's bytes for the part are it
    return run_part(task, ready.source, lambda p: progress(replace(p, bytes_total=planned.bytes)))


def merge_parts(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *,
                parts: int | None = None, **options: Any) -> ConvertResult:
    """Write the manifest of a conversion whose parts `convert_part` ran; ConversionError
    naming the parts that are not finished. A conversion in one part is already merged."""
    job = Job(tuple(source_items(inputs, name="inputs")), **options)
    out = Path(output)
    plan = _prepared(job, output, parts, fix=PARTS_FIX.format(output=output)).plan
    if plan is None:
        if (out / JOURNAL_NAME).exists():
            return convert_part(inputs, output, 0, parts=parts, **options)  # finished: reread
        raise ConversionError(f"{out} holds no plan of parts; run the parts (--part K) first")
    return ConvertResult(out, merge(job, out, plan), 0, 0, 0, 0.0)


_FIX = ("rerun with --overwrite to convert afresh (it deletes the earlier shards), or "
        "convert into a new directory")


@dataclass(frozen=True)
class _Ready:
    plan: Plan | None  # None: a conversion in one part
    source: Inputs  # listed
    apply: Callable[[Any], Any] | None  # the loaded transform
    files: InputFiles  # the identity of the inputs

    def watch(self, job: Job, fix: str) -> InputsWatch:
        """The checks that the inputs do not change while they are converted."""
        return InputsWatch(self.files, job.inputs, fix=fix, threads=job.read_ahead)


def _prepared(job: Job, output: str | os.PathLike, parts: int | None, *,
              overwrite: bool = False, fix: str) -> _Ready:
    """Check the options, the output and the inputs, list them, and find or make the plan.

    Everything that can be refused is checked before `output` is made or changed:
    ConversionError for an output that is a file or lies inside an input, an input that
    names no files or holds an earlier output, and (naming the files and `fix`) an output
    that holds a conversion of other input files. `overwrite` first deletes an earlier
    conversion in `output`.
    """
    if parts is not None:
        check_int("parts", parts, 1, "about 1 per GiB of input (the default)",
                  maximum=MAX_PARTS)
    apply = job.load_transform()
    out = Path(output)
    check_output_path(out)
    source = job.source()
    if out.is_dir():
        source.exclude(out)
    check_output_outside(source, out)
    leaves = list(source.leaves())  # listed once, here, for every check and the plan
    check_listing(source, leaves)
    before = None if overwrite or not out.is_dir() else InputFiles.read(out)
    files = InputFiles.of(job.inputs, leaves, threads=job.read_ahead, before=before)
    if not overwrite:
        check_inputs(out, files, fix=fix)
    elif out.is_dir():
        with output_lock(out):  # never under a run converting into it now
            clear_output(out)
    out.mkdir(parents=True, exist_ok=True)
    return _Ready(prepare(job, out, parts, source, files), source, apply, files)
