"""What a conversion counts: records in, out, dropped and bad, and progress snapshots."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Counts", "Progress"]


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
    files_total: int | None = None  # files the inputs hold, once listed
    bytes_total: int | None = None  # their stored bytes, when known without a request per file
    parts: int = 0  # a conversion in parts: parts finished
    parts_total: int | None = None  # and planned (None: one part, reported as it goes)
