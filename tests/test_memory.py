"""Guarantee 6: peak memory depends on buffer_size and block size, never on corpus size.

End to end, each format streams two corpora through a shuffle buffer of 1000 records, one
twice the other, and the peak of the second may not exceed the first's by more than
GROWTH_LIMIT: the million-record corpora of a real run would show a leak of a few bytes per
record, so these two, 65536 records apart, must show one of 8 bytes (a list slot). The
peak is tracemalloc's, which counts every Python allocation exactly (where per-record state
would live), so the limit can be tight on a busy machine where RSS is noisy. Every line has
16 bytes and every 256 KiB block the same number of lines, so both corpora run through the
same buffers (a read, a decoded piece, the shuffle buffer, a read-ahead budget of 1 MiB). In
process, tracemalloc also checks the two places where memory used to follow the data: the
zstd decoder (whatever the ratio) and the tar reader (whatever the member count).
"""

from __future__ import annotations

import io
import tarfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import zstandard

from streamds import Storage, StreamingJsonl
from streamds.formats.codecs import READ_SIZE, decode
from streamds.formats.seekable import SeekableWriter

BLOCK = 256 << 10
LINES_PER_BLOCK = BLOCK // 16
# records of the two corpora; SMALL past the one-frame zstd decoder's warm-up (its first MiB)
SMALL, LARGE = 4 * LINES_PER_BLOCK, 8 * LINES_PER_BLOCK
GROWTH_LIMIT = 512 << 10  # bytes: 8 bytes a record for the 65536 records more


def lines_of(count: int) -> list[bytes]:
    """`count` distinct JSON lines of 15 bytes (16 with the newline)."""
    return [b'{"id":%d}' % (10_000_000 + i) for i in range(count)]


def write_plain(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


def write_seekable(path: Path, lines: list[bytes]) -> None:
    with path.open("wb") as f, SeekableWriter(f, level=1, frame_size=BLOCK) as writer:
        writer.write_lines(lines)


def write_foreign(path: Path, lines: list[bytes]) -> None:
    """One zstd frame, as the zstd command line writes: one block for the whole file."""
    path.write_bytes(zstandard.ZstdCompressor(level=1).compress(b"\n".join(lines) + b"\n"))


def peak_while_streaming(path: Path) -> int:
    ds = StreamingJsonl(path, shuffle=True, buffer_size=1000,
                        storage=Storage(block_size=BLOCK, readahead=1 << 20))
    tracemalloc.start()
    try:
        count = sum(1 for _ in ds)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == int(path.name.split(".")[0])
    return peak


@pytest.mark.parametrize(
    ("suffix", "writer"),
    [("jsonl", write_plain), ("jsonl.zst", write_seekable), ("jsonl.zst", write_foreign)],
    ids=["plain", "seekable-zst", "foreign-zst"],
)
def test_peak_memory_does_not_grow_with_the_corpus(
    tmp_path: Path, suffix: str, writer: Callable[[Path, list[bytes]], None]
) -> None:
    peaks = []
    for records in (SMALL, LARGE):
        path = tmp_path / f"{records}.{suffix}"
        writer(path, lines_of(records))
        peaks.append(peak_while_streaming(path))
    grown = peaks[1] - peaks[0]
    assert grown < GROWTH_LIMIT, (
        f"peak {peaks[0] >> 10} KiB for {SMALL} records, {peaks[1] >> 10} KiB for {LARGE}: "
        f"{grown / (LARGE - SMALL):.1f} bytes more per record")


def frames_of_one_line(frames: int, frame_size: int = 4 << 20) -> tuple[bytes, int]:
    """`frames` zstd frames, each `frame_size` bytes of one repeated line: ~1000:1 or more."""
    line = b'{"id": 1, "text": "the same line, again and again"}\n'
    data = line * (frame_size // len(line))
    frame = zstandard.ZstdCompressor(level=3).compress(data)
    return frame * frames, len(data) * frames


@pytest.mark.parametrize("layout", ["many frames", "one frame"])
def test_zstd_decoder_holds_about_one_read_whatever_the_ratio(layout):
    if layout == "many frames":
        blob, size = frames_of_one_line(frames=24)
    else:
        blob, size = frames_of_one_line(frames=1, frame_size=96 << 20)
    assert len(blob) < READ_SIZE  # one storage read holds the whole file
    stream = decode(io.BytesIO(blob), "zst", "memory://lines.jsonl.zst")
    tracemalloc.start()
    try:
        decoded = 0
        while chunk := stream.read(READ_SIZE):
            decoded += len(chunk)
            del chunk
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert decoded == size
    assert peak < 32 << 20, f"peak {peak >> 20} MiB while decoding {size >> 20} MiB"


def tar_of_members(count: int) -> bytes:
    """A tar of `count` one-record `.json` members, built header by header (fast)."""
    parts = []
    for index in range(count):
        body = b'{"id": %d}' % index
        info = tarfile.TarInfo(f"sample{index:07d}.json")
        info.size = len(body)
        parts += [info.tobuf(format=tarfile.USTAR_FORMAT), body, b"\0" * (-len(body) % 512)]
    return b"".join([*parts, b"\0" * 1024])


def test_tar_memory_does_not_grow_with_its_members(tmp_path):
    peaks = {}
    for count in (6000, 11000):  # tars over one 4 MiB request
        path = tmp_path / f"members-{count}.tar"
        path.write_bytes(tar_of_members(count))
        # the tar reader alone (read-ahead: below)
        ds = StreamingJsonl(path, storage=Storage(readahead=0))
        tracemalloc.start()
        try:
            assert sum(1 for _ in ds) == count
            peaks[count] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # a member header kept per record would add ~2 MiB for the 5000 more
    assert peaks[11000] - peaks[6000] < 1 << 20, peaks


@pytest.mark.parametrize("budget_mb", [1, 4])
def test_read_ahead_holds_about_its_budget_whatever_the_file_size(tmp_path, budget_mb):
    line = orjson.dumps({"text": "x" * 1000}) + b"\n"
    peaks = {}
    for mb in (8, 24):
        path = tmp_path / f"{mb}.jsonl"
        path.write_bytes(line * (mb * 1000))
        ds = StreamingJsonl(path, storage=Storage(readahead=budget_mb << 20))
        tracemalloc.start()
        try:
            assert sum(1 for _ in ds) == mb * 1000
            peaks[mb] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # the budget, one piece being read and a decoded read or two: not the file
    assert peaks[8] < (budget_mb + 3) << 20, peaks
    assert peaks[24] < (budget_mb + 3) << 20, peaks
