"""A conversion described by value (`Job`), and converting records into one directory.

A `Job` holds the inputs (paths and URLs) and every option: it is what a task carries to
another process or machine, never records. `convert_directory` is one conversion into one
directory, the whole input or one part of it::

    Journal + prepare_output                # journal.py, recovery.py: verify, clean up
      -> ConversionRun.run()                # run.py: records -> shards, in input order
           -> CommitQueue -> Journal        # commit.py: each shard journaled in order
      -> write_manifest                     # last, atomically
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamds.checks import check_choice, check_int
from streamds.formats.manifest import Manifest, ShardEntry, write_manifest
from streamds.formats.seekable import MAX_FRAME_SIZE
from streamds.redact import redact
from streamds.retry import DEFAULT_RETRY, RetryPolicy
from streamds.spec import load_function
from streamds.stages.parse import ON_ERROR

from .commit import CommitQueue
from .counts import Counts, Progress
from .errors import ConversionError
from .identity import InputFiles, InputsWatch
from .journal import Journal
from .lock import output_lock
from .preflight import OUTPUT_MARKERS
from .recovery import prepare_output
from .run import ConversionRun
from .sources import DEFAULT_READ_AHEAD, DEFAULT_READ_AHEAD_BYTES, Inputs, Meter, Span
from .writers import FORMATS, check_tar_writer

__all__ = [
    "DEFAULT_FRAME_SIZE",
    "DEFAULT_SHARD_SIZE",
    "FILES_KEY",
    "ConvertResult",
    "Job",
    "check_converted",
    "convert_directory",
    "job_fingerprint",
]

DEFAULT_SHARD_SIZE = 256 * 10**6
DEFAULT_FRAME_SIZE = 4 << 20
FILES_KEY = "files"  # fingerprint key: the digest of the input files (`identity.InputFiles`)


@dataclass(frozen=True)
class ConvertResult:
    """A finished conversion: the manifest, plus what this run did (not in the manifest)."""

    output: Path
    manifest: Manifest
    shards_reused: int  # verified shards kept from an interrupted run
    shards_written: int
    stored_bytes: int  # input bytes read by this run
    seconds: float
    skipped: tuple[str, ...] = ()  # where the first bad records skipped were (--on-error skip)

    @property
    def counts(self) -> Counts:
        return Counts(**self.manifest.counts)


def _transform_name(transform: str | Callable[[Any], Any] | None) -> str | None:
    if transform is None or isinstance(transform, str):
        return transform
    module = getattr(transform, "__module__", None) or type(transform).__module__
    name = getattr(transform, "__qualname__", None) or repr(transform)
    return f"{module}:{name}"


@dataclass(frozen=True)
class Job:
    """The inputs and options of a conversion; checked when made, picklable.

    `options` are the ones that shape the output (recorded in the journal and manifest);
    `workers`, `read_ahead`, `read_ahead_bytes`, `storage_options` and `retry` only change
    how fast it goes.
    """

    inputs: tuple[str, ...] = field(repr=False)  # URLs may hold credentials: see recorded_inputs
    format: str = "jsonl.zst"
    shard_size: int = DEFAULT_SHARD_SIZE
    level: int = 3
    frame_size: int = DEFAULT_FRAME_SIZE
    transform: str | Callable[[Any], Any] | None = None
    on_error: str = "raise"
    workers: int = 1
    read_ahead: int = DEFAULT_READ_AHEAD
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES
    storage_options: dict[str, Any] | None = field(default=None, repr=False)  # may hold keys
    retry: RetryPolicy = DEFAULT_RETRY

    def __post_init__(self) -> None:
        check_int("shard_size", self.shard_size, 1, "e.g. 256MB (the default)", maximum=1 << 50)
        check_int("level", self.level, -7, "3 (the default) for speed, 19 for size", maximum=22)
        check_int("frame_size", self.frame_size, 1, "a few MiB (the default, 4 MiB)",
                  maximum=MAX_FRAME_SIZE)
        check_int("workers", self.workers, 1, "about the number of CPU cores", maximum=256)
        check_int("read_ahead", self.read_ahead, 0,
                  f"{DEFAULT_READ_AHEAD} (the default) for a mount or URL, 0 for one file at a "
                  "time", maximum=1024)
        check_int("read_ahead_bytes", self.read_ahead_bytes, 0,
                  f"e.g. {DEFAULT_READ_AHEAD_BYTES >> 20} MiB (the default)", maximum=1 << 40)
        check_choice("format", self.format, tuple(FORMATS))
        check_choice("on_error", self.on_error, ON_ERROR)

    def check_writer(self) -> None:
        """Refuse now, before any output is made, what the shard writer would refuse later:
        tar output without webdataset (the 'tar' extra). A merge writes no shard: not there."""
        if self.format == "tar":
            check_tar_writer()

    @property
    def recorded_inputs(self) -> tuple[str, ...]:
        """The inputs as the journal, the plan and the manifest record them: credentials
        redacted (`streamds.redact`), so nothing written to disk holds one; a rerun passes
        them again, and a URL signed anew still matches."""
        return tuple(redact(item) for item in self.inputs)

    @property
    def options(self) -> dict[str, Any]:
        """The options that shape the output, as the journal and manifest record them."""
        zstd = self.format == "jsonl.zst"
        return {
            "format": self.format,
            "shard_size": self.shard_size,
            "level": self.level if zstd else None,
            "frame_size": self.frame_size if zstd else None,
            "transform": _transform_name(self.transform),
            "on_error": self.on_error,
        }

    def source(self) -> Inputs:
        """The inputs to read (FileNotFoundError for one that does not exist); their local
        folders note the files that mark a converter's output (`preflight`)."""
        return Inputs(list(self.inputs), storage_options=self.storage_options,
                      read_ahead=self.read_ahead, read_ahead_bytes=self.read_ahead_bytes,
                      retry=self.retry, markers=OUTPUT_MARKERS)

    def load_transform(self) -> Callable[[Any], Any] | None:
        """The transform as a callable (loading a ``module:function`` spec), or None."""
        transform = self.transform
        apply = load_function(transform) if isinstance(transform, str) else transform
        if apply is not None and not callable(apply):
            raise ValueError(f"transform must be callable or 'module:function', got {transform!r}")
        return apply


def job_fingerprint(job: Job, files: InputFiles) -> dict[str, Any]:
    """What an output's journal (or plan) must match to be resumed or reused: the inputs as
    given, the options that shape the output, and the digest of the input files."""
    return {"inputs": list(job.recorded_inputs), "options": job.options,
            FILES_KEY: files.digest}


def convert_directory(
    job: Job,
    out: Path,
    *,
    source: Inputs,
    apply: Callable[[Any], Any] | None,
    fingerprint: dict[str, Any],
    files: InputFiles | None = None,
    span: Span | None = None,
    tar_prefix: str = "",
    progress: Callable[[Progress], None] | None = None,
    watch: InputsWatch | None = None,
) -> ConvertResult:
    """Convert `source` (or its part `span`) into shards in `out`, resuming there.

    `fingerprint` (inputs, options, input files, the part) is what the journal must match
    to resume; `files`, the identity of the inputs, is recorded in a new `out` (None: a part,
    whose plan recorded it); `tar_prefix` starts every tar member key (a part's number:
    keys stay unique); `watch` checks that the input files do not change while they are read
    and before the manifest is written.
    """
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    with output_lock(out):  # one run at a time: a second would delete this one's shards
        journal = Journal(out, fingerprint)
        reused = prepare_output(out, journal, job.format, files)
        meter = Meter()
        commits = CommitQueue(journal, job.workers)
        if not journal.complete:
            ConversionRun(
                source, out, format=job.format, level=job.level, frame_size=job.frame_size,
                shard_size=job.shard_size, apply=apply, skip_errors=job.on_error == "skip",
                workers=job.workers, commits=commits, meter=meter, progress=progress,
                span=span, tar_prefix=tar_prefix,
                check_file=None if watch is None else watch.check_file,
            ).run()
        counts = Counts(**(journal.end or {}))
        if span is None:
            check_converted(job, counts, journal.skipped)
        if watch is not None:  # a file changed after it was read: its records may be mixed
            watch.check_files(list(source.leaves()) if span is None
                              else source.span_leaves(span))
        manifest = Manifest(
            shard_format=job.format,
            shards=tuple(ShardEntry.from_json(item["shard"]) for item in journal.shards),
            counts=dict(journal.end or {}),
            options=fingerprint["options"],
            inputs=job.recorded_inputs,
        )
        write_manifest(out, manifest)
    return ConvertResult(
        output=out,
        manifest=manifest,
        shards_reused=reused,
        shards_written=commits.written,
        stored_bytes=meter.stored_bytes,
        seconds=time.perf_counter() - started,
        skipped=tuple(journal.skipped),
    )


def check_converted(job: Job, counts: Counts, skipped: list[str]) -> None:
    """Refuse a whole conversion that wrote no record (ConversionError saying why): its
    output would read as a valid, empty corpus. Checked before the manifest is written."""
    if counts.records_out:
        return
    fix = ("; fix that, then rerun with --overwrite (a rerun of the same command refuses "
           "again)")
    if counts.records_in == 0:
        raise ConversionError(
            f"nothing to convert: the inputs ({', '.join(job.recorded_inputs)}) hold no "
            f"records (empty files or only blank lines){fix}"
        )
    if counts.dropped:
        raise ConversionError(
            f"the transform {_transform_name(job.transform)} dropped every record: "
            f"{counts.records_in:,} went in ({counts.dropped:,} dropped, {counts.bad:,} bad), "
            f"none came out, so no shard was written; a transform returns None to drop a "
            f"record{fix}"
        )
    first = f"; the first: {skipped[0]}" if skipped else ""
    raise ConversionError(
        f"every record was bad: {counts.bad:,} skipped (--on-error skip), none written{first}"
        f"{fix}"
    )
