"""One conversion pass: raw records -> parsed -> transformed -> cut into shards -> journaled.

::

    Inputs.records(start)             # RawRecord(bytes, file, offset, line), input order
      -> values.loads                 # (a Parquet or Arrow row comes as its record and its
                                      # JSON text: nothing to parse or write again)
                                      # exact; malformed or not an object: ConversionError
                                      # (file, line, what the file looks like) or counted "bad"
      -> transform(record)            # optional; None drops the record (counted "dropped")
      -> values.dumps                 # one compact line per record, read back exactly
      -> cut by shard_size            # a shard closes before the line that would overflow it
      -> ZstdShard / TarShard         # temp file -> fsync -> rename; entry with checksum
      -> CommitQueue -> Journal       # per finished shard: entry, where the next one starts
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from streamds.errors import CorruptShardError
from streamds.formats import values
from streamds.stages.parse import describe_bad

from .commit import CommitQueue
from .conversion_counts import Counts, Progress
from .errors import ConversionError
from .journal import SKIPPED_KEY
from .sources import Inputs, Leaf, Meter, Position, RawRecord, SourceError, Span
from .writers import BackgroundShard, ShardFile, open_shard, tar_member_size

__all__ = ["PROGRESS_BYTES", "PROGRESS_EVERY", "SKIPPED_SHOWN", "ConversionRun"]

PROGRESS_EVERY = 1024  # records between progress callbacks, at most
PROGRESS_BYTES = 1 << 20  # stored bytes read between progress callbacks, at most
SKIPPED_SHOWN = 10  # skipped records named (log, journal, summary); the rest are counted

log = logging.getLogger(__name__)


class ConversionRun:
    """One pass over the inputs, from where the journal says the last good shard ended.

    State: the open shard, its decoded bytes so far, the next shard number, `counts`
    (records in/out/dropped/bad up to the record being handled) and `skipped` (where the
    first `SKIPPED_SHOWN` bad records were, journaled with each shard). Progress is
    reported every `PROGRESS_EVERY` records or `PROGRESS_BYTES` stored bytes read.
    """

    def __init__(self, source: Inputs, output: Path, *, format: str, level: int,
                 frame_size: int, shard_size: int, apply: Callable[[Any], Any] | None,
                 skip_errors: bool, workers: int, commits: CommitQueue, meter: Meter,
                 progress: Callable[[Progress], None] | None, span: Span | None = None,
                 tar_prefix: str = "", check_file: Callable[[Leaf], None] | None = None
                 ) -> None:
        self.source = source
        self.output = output
        self.format = format
        self.level = level
        self.frame_size = frame_size
        self.shard_size = shard_size
        self.apply = apply
        self.skip_errors = skip_errors
        self.workers = workers
        self.commits = commits
        self.meter = meter
        self.progress = progress
        self.span = span  # one part of the input (None: all of it)
        self.tar_prefix = tar_prefix
        self.check_file = check_file  # after each file is read: it must not have changed
        self.journal = commits.journal
        self.shard: ShardFile | BackgroundShard | None = None
        self.shard_bytes = 0
        self.index = 0
        self.counts = Counts()
        self.skipped: list[str] = []  # where the first SKIPPED_SHOWN bad records were
        self.reported_bytes = 0
        self.resumed_bytes = 0
        self.files_total: int | None = None
        self.bytes_total: int | None = None

    def run(self) -> None:
        """Convert the rest of the input, journaling each shard; end the journal."""
        last = self.journal.shards[-1] if self.journal.shards else None
        start = None if last is None else Position.from_json(last["next"])
        self.counts = Counts() if last is None else Counts(**last["counts"])
        self.skipped = [] if last is None else list(last[SKIPPED_KEY])
        self.index = len(self.journal.shards)
        self.resumed_bytes = 0 if last is None else last["stored_bytes"]
        pool = ThreadPoolExecutor(self.workers, "streamds-shard") if self.workers > 1 else None
        records = self.source.records(
            start, span=self.span, meter=self.meter,
            on_corrupt=self._count_corrupt if self.skip_errors else None,
            after_file=self.check_file,
        )
        try:
            if self.progress is not None and self.span is None:
                self.files_total, self.bytes_total = self.source.totals()
                self._report()
            try:
                self._loop(records, pool)
            except (CorruptShardError, SourceError) as err:
                hint = "; or pass --on-error skip to skip it" if not self.skip_errors else ""
                raise ConversionError(f"{err}{hint}") from err
            if self.shard is not None:
                self._close(None)
            self.commits.commit()
            self.journal.end = asdict(self.counts)
            self.journal.skipped = list(self.skipped)
            self.journal.write()
            if self.counts.bad > len(self.skipped):
                log.warning("skipped %d bad records in all (the first %d named above)",
                            self.counts.bad, len(self.skipped))
        except BaseException:
            if self.shard is not None:
                self.shard.discard()
                self.shard = None
            self.commits.abandon()
            raise
        finally:
            records.close()
            if pool is not None:
                pool.shutdown(wait=True)

    def _count_corrupt(self, leaf: Leaf, err: CorruptShardError) -> None:
        self._skip(f"{leaf.path}: the rest of the file is unreadable: {err}")
        self.counts.records_in += 1  # the unreadable rest of a file counts as one bad record
        self.counts.bad += 1

    def _skip(self, place: str) -> None:
        """Note a skipped bad record (--on-error skip): the first few are named."""
        if len(self.skipped) < SKIPPED_SHOWN:
            self.skipped.append(place)
            log.warning("skipped (--on-error skip): %s", place)

    def _open(self, pool: ThreadPoolExecutor | None) -> None:
        shard = open_shard(
            self.output, self.index, self.format, level=self.level, frame_size=self.frame_size,
            first_record=self.counts.records_out, key_prefix=self.tar_prefix,
        )
        self.shard = shard if pool is None else BackgroundShard(shard, pool)
        self.shard_bytes = 0
        self.index += 1

    def _close(self, next_position: Position | None) -> None:
        assert self.shard is not None
        result = self.shard.finish()
        self.shard = None
        stored = self.resumed_bytes + self.meter.stored_bytes
        self.commits.add(result, next_position, Counts(**asdict(self.counts)), stored,
                         tuple(self.skipped))

    def _loop(self, records: Iterator[RawRecord], pool: ThreadPoolExecutor | None) -> None:
        loads, dumps, decode_error = values.loads, values.dumps, orjson.JSONDecodeError
        apply, shard_size, tar = self.apply, self.shard_size, self.format == "tar"
        counts = self.counts
        seen = 0
        for raw in records:
            seen += 1
            if self.progress is not None and (
                seen % PROGRESS_EVERY == 0
                or self.meter.stored_bytes - self.reported_bytes >= PROGRESS_BYTES
            ):
                self._report()
            data = raw.data
            read_bytes = len(data) + (raw.leaf.kind == "jsonl")
            error: Exception | None = None
            if raw.value is not None:  # a Parquet or Arrow row: a record already
                record = raw.value
            else:
                try:
                    record = loads(data)
                except decode_error as err:
                    error, record = err, None
            if error is not None or type(record) is not dict:  # a record is a JSON object
                if not self.skip_errors:
                    raise ConversionError(
                        f"{raw.where}: {_what(raw, record, error)}; fix or remove it, or pass "
                        "--on-error skip to skip and count bad records"
                    ) from error
                self._skip(f"{raw.where}: {_what(raw, record, error)}")
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
                if type(record) is not dict:
                    raise ConversionError(
                        f"{raw.where}: the transform returned {type(record).__name__}, not a "
                        "dict: a record is a JSON object (return None to drop a record)")
            try:
                line = data if raw.value is not None and apply is None else dumps(record)
            except (TypeError, ValueError) as err:
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
        self.reported_bytes = self.meter.stored_bytes
        self.progress(Progress(
            files=self.meter.files,
            records=self.counts.records_in,
            stored_bytes=self.meter.stored_bytes,
            resumed_bytes=self.resumed_bytes,
            shards=len(self.journal.shards),
            files_total=self.files_total,
            bytes_total=self.bytes_total,
        ))


def _what(raw: RawRecord, record: Any, error: Exception | None) -> str:
    """Why `raw` is no record, with what its file looks like where that is recognised."""
    lines = raw.leaf.kind == "jsonl" and raw.member is None and raw.element is None
    return describe_bad(bytes(raw.data), record, error, offset=raw.offset if lines else None,
                        file_start=lines and raw.offset == 0)
