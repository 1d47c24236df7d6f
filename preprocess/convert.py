"""Convert JSONL files, small-file trees and tar shards into seekable zstd (or tar) shards.

The pipeline, one stage per line::

    Inputs(items).records(start)      # RawRecord(bytes, file, offset, line), input order
      -> orjson.loads                 # malformed: ConversionError (file, line) or counted "bad"
      -> transform(record)            # optional; None drops the record (counted "dropped")
      -> orjson.dumps                 # one compact line per record
      -> cut by --shard-size          # a shard closes before the line that would overflow it
      -> ZstdShard / TarShard         # temp file -> fsync -> rename; entry with checksum
      -> journal                      # per finished shard: entry, where the next one starts

Output is a function of the inputs and options only: ``--workers`` changes how many shards
compress at once (in threads: zstd releases the GIL) and how many ``.json`` files are read
ahead, never the bytes. After a crash (even ``kill -9``), the same command verifies the
shards the journal lists, deletes anything else, and continues from the input position the
journal recorded after the last good shard, so every record lands exactly once and finished
shards are not rewritten. The manifest is written last, atomically.

Library use::

    from preprocess.convert import convert
    result = convert(["data/train.txt"], "shards/", shard_size=64 << 20, workers=2)
    result.manifest.totals["records"]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from streamds.errors import CorruptShardError
from streamds.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    file_checksum,
    write_manifest,
)
from streamds.spec import load_function
from streamds.units import human_bytes, parse_size

from .sources import Inputs, Leaf, Meter, Position, RawRecord, SourceError
from .writers import FORMATS, BackgroundShard, ShardFile, open_shard, tar_member_size

__all__ = [
    "JOURNAL_NAME",
    "ConversionError",
    "ConvertResult",
    "Counts",
    "Progress",
    "convert",
    "main",
]

JOURNAL_NAME = ".streamds-convert.json"
JOURNAL_FORMAT = "streamds.convert-journal/1"
DEFAULT_SHARD_SIZE = 256 * 10**6
DEFAULT_FRAME_SIZE = 4 << 20
ON_ERROR = ("raise", "skip")
_PROGRESS_EVERY = 1024  # records between progress callbacks

log = logging.getLogger(__name__)


class ConversionError(ValueError):
    """Bad input or an output directory that cannot be used; the message says where and why."""


@dataclass
class Counts:
    """What happened to the input records. records_in = records_out + dropped + bad."""

    records_in: int = 0
    records_out: int = 0
    dropped: int = 0
    bad: int = 0
    input_bytes: int = 0  # bytes of JSON text read (decoded), blank lines excluded


@dataclass(frozen=True)
class Progress:
    """A snapshot for progress displays. Bytes are stored (possibly compressed) input bytes."""

    files: int
    records: int
    stored_bytes: int  # read in this run
    resumed_bytes: int  # read by earlier runs up to where this one resumed (approximate)
    shards: int


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


# -- transforms --------------------------------------------------------------------------

def _transform_name(transform: str | Callable[[Any], Any] | None) -> str | None:
    if transform is None or isinstance(transform, str):
        return transform
    module = getattr(transform, "__module__", None) or type(transform).__module__
    name = getattr(transform, "__qualname__", None) or repr(transform)
    return f"{module}:{name}"


# -- the journal -------------------------------------------------------------------------


class _Journal:
    """Finished shards and where the input continues after each; rewritten atomically.

    ``{"format", "fingerprint": {inputs, options}, "shards": [{"shard": entry,
    "next": position | None, "counts": {...}, "stored_bytes": n}], "end": counts | None}``
    """

    def __init__(self, directory: Path, fingerprint: dict[str, Any]) -> None:
        self.path = directory / JOURNAL_NAME
        self.fingerprint = fingerprint
        self.shards: list[dict[str, Any]] = []
        self.end: dict[str, int] | None = None

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
            raise ConversionError(
                f"{self.path.parent} holds a conversion made with other inputs or options "
                f"({'; '.join(diff)}); rerun the same command to resume it, or convert into "
                "an empty directory"
            )
        self.shards = list(doc["shards"])
        self.end = doc["end"]
        return True

    @property
    def complete(self) -> bool:
        return self.end is not None

    def add(self, entry: ShardEntry, next_position: Position | None, counts: Counts,
            stored_bytes: int) -> None:
        self.shards.append({
            "shard": entry.to_json(),
            "next": None if next_position is None else next_position.to_json(),
            "counts": asdict(counts),
            "stored_bytes": stored_bytes,
        })

    def write(self) -> None:
        doc = {"format": JOURNAL_FORMAT, "fingerprint": self.fingerprint,
               "shards": self.shards, "end": self.end}
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(doc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _intact(directory: Path, entry: ShardEntry) -> bool:
    path = directory / entry.name
    try:
        if path.stat().st_size != entry.bytes:
            return False
    except FileNotFoundError:
        return False
    return file_checksum(path) == entry.checksum


def _prepare(output: Path, journal: _Journal, extension: str) -> int:
    """Load and verify the journal, clean the directory; return the number of reused shards."""
    output.mkdir(parents=True, exist_ok=True)
    if not journal.load():
        leftovers = sorted(os.listdir(output))
        if leftovers:
            shown = ", ".join(leftovers[:3]) + (", ..." if len(leftovers) > 3 else "")
            raise ConversionError(
                f"{output} is not empty ({shown})"
                f" and holds no conversion journal ({JOURNAL_NAME}); convert into an empty or "
                "new directory"
            )
        return 0
    good = 0
    for item in journal.shards:
        if not _intact(output, ShardEntry.from_json(item["shard"], where=str(journal.path))):
            break
        good += 1
    if good < len(journal.shards):
        log.warning("%s: shard %s is damaged or missing; converting again from there",
                    output, journal.shards[good]["shard"]["name"])
        journal.shards = journal.shards[:good]
        journal.end = None
        journal.write()
    if journal.end is None and journal.shards and journal.shards[-1]["next"] is None:
        journal.end = journal.shards[-1]["counts"]  # killed between the last two writes
    keep = {item["shard"]["name"] for item in journal.shards}
    for name in os.listdir(output):
        stale_shard = name.startswith("shard-") and name.endswith(extension) and name not in keep
        temporary = name.startswith(".") and name.endswith(".tmp")
        stale_manifest = name == MANIFEST_NAME and not journal.complete
        if stale_shard or temporary or stale_manifest:
            (output / name).unlink()
    return good


# -- the conversion ----------------------------------------------------------------------


class _Pending:
    """Shards closed but not yet journaled, oldest first; journaled strictly in order.

    A background shard is journaled as soon as it and every older shard are renamed, by
    whichever pool thread finishes last, so a kill loses only shards still being written.
    The main thread waits here while `limit` shards are in flight.
    """

    def __init__(self, journal: _Journal, limit: int) -> None:
        self.journal = journal
        self._limit = limit
        self._queue: deque[tuple[ShardEntry | Future[ShardEntry | None], Position | None,
                                 Counts, int]] = deque()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.written = 0

    def add(self, result: ShardEntry | Future[ShardEntry | None], next_position: Position | None,
            counts: Counts, stored_bytes: int) -> None:
        with self._lock:
            self._queue.append((result, next_position, counts, stored_bytes))
        if isinstance(result, Future):
            result.add_done_callback(self._on_done)
        self.commit(wait_until=self._limit - 1)

    def _on_done(self, _: Future[ShardEntry | None]) -> None:
        try:
            self._journal_finished()
        except BaseException as err:  # raised in the main thread by the next commit()
            self._error = err

    def _journal_finished(self) -> None:
        """Journal the finished shards at the head of the queue; never waits for a shard."""
        with self._lock:
            while self._queue:
                result, next_position, counts, stored_bytes = self._queue[0]
                if isinstance(result, Future):
                    if not result.done() or result.exception() is not None:
                        return
                    entry = result.result()
                    assert entry is not None
                else:
                    entry = result
                self._queue.popleft()
                self.journal.add(entry, next_position, counts, stored_bytes)
                self.journal.write()
                self.written += 1

    def commit(self, wait_until: int = 0) -> None:
        """Journal finished shards; wait until at most `wait_until` remain unjournaled.

        Raises the error of a shard that failed to write.
        """
        while True:
            self._journal_finished()
            if self._error is not None:
                raise self._error
            with self._lock:
                if len(self._queue) <= wait_until:
                    return
                head = self._queue[0][0]
            if isinstance(head, Future):
                head.result()

    def abandon(self) -> None:
        """After a failure: journal what finishes cleanly, in order; drop the rest."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                head = self._queue[0][0]
            if isinstance(head, Future) and head.exception() is not None:  # waits for it
                with self._lock:
                    self._queue.clear()
                return
            self._journal_finished()


def _check_options(shard_size: int, fmt: str, level: int, frame_size: int, on_error: str,
                   workers: int) -> None:
    def integer(name: str, value: Any, low: int, high: int, fix: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer in {low}..{high}, got {value!r}; {fix}")

    integer("shard_size", shard_size, 1, 1 << 50, "e.g. 256MB (the default)")
    integer("level", level, -7, 22, "3 (the default) for speed, 19 for size")
    integer("frame_size", frame_size, 1, 1 << 30, "a few MiB (the default, 4 MiB)")
    integer("workers", workers, 1, 256, "about the number of CPU cores")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {tuple(FORMATS)}, got {fmt!r}")
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


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
    progress: Callable[[Progress], None] | None = None,
) -> ConvertResult:
    """Convert `inputs` into shards in `output`; resume there if a conversion was interrupted.

    `shard_size` counts uncompressed bytes (JSONL bytes, or tar bytes); a shard closes before
    the record that would overflow it. `transform` is a callable or a ``module:function``
    spec applied to each record (None drops it). `on_error="skip"` skips and counts
    malformed records and unreadable compressed or tar files instead of raising
    ConversionError. `workers` > 1 compresses that many shards at once in threads and reads
    ``.json`` files ahead; the output does not depend on it. Memory: one frame per shard in
    flight plus ~16 MiB of queued lines per background shard.
    """
    _check_options(shard_size, format, level, frame_size, on_error, workers)
    started = time.perf_counter()
    out = Path(output)
    items = [os.fspath(item) for item in inputs]
    source = Inputs(items)
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
    journal = _Journal(out, {"inputs": items, "options": options})
    reused = _prepare(out, journal, FORMATS[format])
    source.exclude(out)
    meter = Meter()
    pending = _Pending(journal, workers)
    if not journal.complete:
        last = journal.shards[-1] if journal.shards else None
        run = _Run(
            source, out, format=format, level=level, frame_size=frame_size, shard_size=shard_size,
            apply=apply, skip_errors=on_error == "skip", workers=workers, pending=pending,
            meter=meter, progress=progress,
        )
        run.run(
            start=None if last is None else Position.from_json(last["next"]),
            counts=Counts() if last is None else Counts(**last["counts"]),
            index=len(journal.shards),
            resumed_bytes=0 if last is None else last["stored_bytes"],
        )
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
        shards_written=pending.written,
        stored_bytes=meter.stored_bytes,
        seconds=time.perf_counter() - started,
    )


class _Run:
    """One pass over the inputs from a start position; see `convert`.

    State: the open shard, its decoded bytes so far, the next shard number, and `counts`
    (records in/out/dropped/bad up to the record being handled).
    """

    def __init__(self, source: Inputs, output: Path, *, format: str, level: int,
                 frame_size: int, shard_size: int, apply: Callable[[Any], Any] | None,
                 skip_errors: bool, workers: int, pending: _Pending, meter: Meter,
                 progress: Callable[[Progress], None] | None) -> None:
        self.source = source
        self.output = output
        self.format = format
        self.level = level
        self.frame_size = frame_size
        self.shard_size = shard_size
        self.apply = apply
        self.skip_errors = skip_errors
        self.workers = workers
        self.pending = pending
        self.meter = meter
        self.progress = progress
        self.journal = pending.journal
        self.shard: ShardFile | BackgroundShard | None = None
        self.shard_bytes = 0
        self.index = 0
        self.counts = Counts()
        self.resumed_bytes = 0

    def run(self, *, start: Position | None, counts: Counts, index: int,
            resumed_bytes: int) -> None:
        self.counts, self.index, self.resumed_bytes = counts, index, resumed_bytes
        pool = ThreadPoolExecutor(self.workers, "streamds-shard") if self.workers > 1 else None
        records = self.source.records(
            start,
            meter=self.meter,
            prefetch=4 * self.workers if self.workers > 1 else 0,
            on_corrupt=self._count_corrupt if self.skip_errors else None,
        )
        try:
            try:
                self._loop(records, pool)
            except (CorruptShardError, SourceError) as err:
                hint = "; or pass --on-error skip to skip it" if not self.skip_errors else ""
                raise ConversionError(f"{err}{hint}") from err
            if self.shard is not None:
                self._close(None)
            self.pending.commit()
            self.journal.end = asdict(self.counts)
            self.journal.write()
        except BaseException:
            if self.shard is not None:
                self.shard.discard()
                self.shard = None
            self.pending.abandon()
            raise
        finally:
            records.close()
            if pool is not None:
                pool.shutdown(wait=True)

    def _count_corrupt(self, leaf: Leaf, err: CorruptShardError) -> None:
        log.warning("skipping the rest of %s: %s", leaf.path, err)
        self.counts.records_in += 1  # the unreadable rest of a file counts as one bad record
        self.counts.bad += 1

    def _open(self, pool: ThreadPoolExecutor | None) -> None:
        shard = open_shard(
            self.output, self.index, self.format, level=self.level, frame_size=self.frame_size,
            first_record=self.counts.records_out,
        )
        self.shard = shard if pool is None else BackgroundShard(shard, pool)
        self.shard_bytes = 0
        self.index += 1

    def _close(self, next_position: Position | None) -> None:
        assert self.shard is not None
        result = self.shard.finish()
        self.shard = None
        stored = self.resumed_bytes + self.meter.stored_bytes
        self.pending.add(result, next_position, Counts(**asdict(self.counts)), stored)

    def _loop(self, records: Iterator[RawRecord], pool: ThreadPoolExecutor | None) -> None:
        loads, dumps, decode_error = orjson.loads, orjson.dumps, orjson.JSONDecodeError
        apply, shard_size, tar = self.apply, self.shard_size, self.format == "tar"
        counts = self.counts
        seen = 0
        for raw in records:
            seen += 1
            if self.progress is not None and seen % _PROGRESS_EVERY == 0:
                self._report()
            data = raw.data
            read_bytes = len(data) + (raw.leaf.kind == "jsonl")
            try:
                record = loads(data)
            except decode_error as err:
                if not self.skip_errors:
                    raise ConversionError(
                        f"{raw.where}: invalid JSON ({err}): {bytes(data[:80])!r}; fix or "
                        "remove it, or pass --on-error skip to skip and count bad records"
                    ) from err
                counts.records_in += 1
                counts.bad += 1
                counts.input_bytes += read_bytes
                continue
            if apply is not None:
                try:
                    record = apply(record)
                except Exception as err:
                    raise ConversionError(f"{raw.where}: the transform failed: {err!r}") from err
                if record is None:
                    counts.records_in += 1
                    counts.dropped += 1
                    counts.input_bytes += read_bytes
                    continue
            try:
                line = dumps(record)
            except TypeError as err:
                raise ConversionError(
                    f"{raw.where}: the transformed record is not JSON-serialisable: {err}"
                ) from err
            size = tar_member_size(len(line)) if tar else len(line) + 1
            if self.shard is not None and self.shard_bytes + size > shard_size:
                self._close(raw.position)  # this record starts the next shard
            if self.shard is None:
                self._open(pool)
            self.shard.write(line)  # type: ignore[union-attr]
            self.shard_bytes += size
            counts.records_in += 1
            counts.records_out += 1
            counts.input_bytes += read_bytes
        if self.progress is not None:
            self._report()

    def _report(self) -> None:
        assert self.progress is not None
        self.progress(Progress(
            files=self.meter.files,
            records=self.counts.records_in,
            stored_bytes=self.meter.stored_bytes,
            resumed_bytes=self.resumed_bytes,
            shards=len(self.journal.shards),
        ))


# -- command line ------------------------------------------------------------------------


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def build_parser(prog: str = "python -m preprocess") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert JSONL files, trees of small .json files and tar shards into "
        "seekable .jsonl.zst (or webdataset .tar) shards with a manifest. Rerun the same "
        "command after an interruption to resume.",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="JSONL file (.jsonl/.txt, plain or .zst/.gz/.bz2/.xz), directory "
                        "or glob of .json files (any depth), or tar shard")
    parser.add_argument("--output", "-o", required=True, metavar="DIR")
    parser.add_argument("--shard-size", type=_size, default=DEFAULT_SHARD_SIZE, metavar="SIZE",
                        help="uncompressed bytes per shard (default 256MB)")
    parser.add_argument("--format", choices=tuple(FORMATS), default="jsonl.zst")
    parser.add_argument("--workers", type=int, default=1,
                        help="shards compressed at once; output does not depend on it")
    parser.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    parser.add_argument("--frame-size", type=_size, default=DEFAULT_FRAME_SIZE, metavar="SIZE",
                        help="decoded bytes per seekable frame (default 4MiB)")
    parser.add_argument("--transform", metavar="MODULE:FUNCTION",
                        help="record -> record or None, e.g. preprocess.text:to_summarisation "
                        "or 'preprocess.text:summarisation(max_words=512)'")
    parser.add_argument("--on-error", choices=ON_ERROR, default="raise",
                        help="malformed records and damaged files: stop (default) or skip "
                        "and count them")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return parser


def summary(result: ConvertResult) -> str:
    """The lines the CLI prints after a conversion."""
    m, c = result.manifest, result.counts
    totals = m.totals
    reused = f", {result.shards_reused} reused after verification" if result.shards_reused else ""
    ratio = totals["decoded_bytes"] / totals["bytes"] if totals["bytes"] else 0.0
    speed = result.stored_bytes / result.seconds / 1e6 if result.seconds else 0.0
    return "\n".join([
        f"wrote {totals['shards']} {m.shard_format} shards to {result.output} "
        f"({result.shards_written} this run{reused})",
        f"  records  in {c.records_in:,}  out {c.records_out:,}  dropped {c.dropped:,}  "
        f"bad {c.bad:,}",
        f"  bytes    in {human_bytes(c.input_bytes)}  out {human_bytes(totals['bytes'])}  "
        f"(decoded {human_bytes(totals['decoded_bytes'])}, ratio {ratio:.2f}x)",
        f"  time     {result.seconds:.1f} s  ({speed:.1f} MB/s of stored input this run)",
    ])


def main(argv: Sequence[str] | None = None, prog: str = "python -m preprocess") -> int:
    """The conversion command line; exit 0, or 2 with the reason on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["convert"]:
        argv = argv[1:]
    args = build_parser(prog).parse_args(argv)
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        try:
            files, total = Inputs(args.inputs).stored_size()
        except (OSError, ValueError):
            files, total = 0, 0
        bar = tqdm(total=total or None, unit="B", unit_scale=True, desc="converting",
                   file=sys.stderr, dynamic_ncols=True, smoothing=0.1)

        def show(p: Progress) -> None:
            bar.update(p.resumed_bytes + p.stored_bytes - bar.n)
            bar.set_postfix_str(f"files {p.files:,}/{files:,} records {p.records:,} "
                                f"shards {p.shards}", refresh=False)
    try:
        result = convert(
            args.inputs, args.output, shard_size=args.shard_size, format=args.format,
            level=args.level, frame_size=args.frame_size, transform=args.transform,
            on_error=args.on_error, workers=args.workers,
            progress=show if bar is not None else None,
        )
    except (ConversionError, ValueError, FileNotFoundError) as err:
        if bar is not None:
            bar.close()
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print(f"{prog}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    if bar is not None:
        bar.close()
    print(summary(result))
    return 0
