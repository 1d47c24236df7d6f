"""Guarantee 6: peak memory depends on buffer_size and block size, never on corpus size.

End to end, each format streams a corpus of CORPUS_MB decoded megabytes through a shuffle
buffer of 1000 records in a fresh interpreter, which reports its peak RSS before and after;
the growth must stay far below the corpus size. The corpus repeats a few hundred distinct
lines, so it is written in a blink and compresses thousands of times over: the hard case for
a decoder. In process, tracemalloc checks the two places where memory used to follow the
data: the zstd decoder (whatever the ratio) and the tar reader (whatever the member count).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
import zstandard

from streamds import StreamingJsonl
from streamds.formats.codecs import READ_SIZE, decode
from streamds.formats.seekable import SeekableWriter

CORPUS_MB = 100
GROWTH_LIMIT_MB = 50  # half the corpus: holding it would show as >= CORPUS_MB
REPO = Path(__file__).resolve().parents[1]

STREAM = """
import resource, sys
from streamds import StreamingJsonl

def peak_mb():
    # this process's own high-water mark: ru_maxrss survives exec, so a child of a large
    # pytest process would report pytest's peak
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

ds = StreamingJsonl(sys.argv[1], shuffle=True, buffer_size=1000)
baseline = peak_mb()
count = sum(1 for _ in ds)
print(count, baseline, peak_mb())
"""


def distinct_lines(count: int = 300) -> list[bytes]:
    return [
        orjson.dumps({"id": i, "text": " ".join(f"word{(i * 7 + k) % 97}" for k in range(30))})
        for i in range(count)
    ]


def write_plain(path: Path, lines: list[bytes], repeats: int) -> None:
    block = b"\n".join(lines) + b"\n"
    with path.open("wb") as f:
        for _ in range(repeats):
            f.write(block)


def write_seekable(path: Path, lines: list[bytes], repeats: int) -> None:
    with path.open("wb") as f, SeekableWriter(f, level=1) as writer:  # 4 MiB frames
        for _ in range(repeats):
            writer.write_lines(lines)


def write_foreign(path: Path, lines: list[bytes], repeats: int) -> None:
    block = b"\n".join(lines) + b"\n"
    with path.open("wb") as f, zstandard.ZstdCompressor(level=1).stream_writer(f) as writer:
        for _ in range(repeats):
            writer.write(block)


@pytest.fixture
def big_corpus(tmp_path) -> Iterator[Callable[[str, Callable], tuple[Path, int]]]:
    written: list[Path] = []

    def make(name: str, writer: Callable[[Path, list[bytes], int], None]) -> tuple[Path, int]:
        lines = distinct_lines()
        repeats = (CORPUS_MB << 20) // (sum(map(len, lines)) + len(lines))
        path = tmp_path / name
        writer(path, lines, repeats)
        written.append(path)
        return path, repeats * len(lines)

    yield make
    for path in written:
        path.unlink()


@pytest.mark.parametrize(
    ("name", "writer"),
    [
        ("big.jsonl", write_plain),
        ("big.jsonl.zst", write_seekable),
        ("foreign.jsonl.zst", write_foreign),
    ],
)
def test_peak_memory_does_not_grow_with_the_corpus(big_corpus, name, writer):
    path, count = big_corpus(name, writer)
    result = subprocess.run(
        [sys.executable, "-c", STREAM, str(path)],
        capture_output=True, text=True, check=True, cwd=REPO, timeout=120,
    )
    records, baseline, peak = result.stdout.split()
    assert int(records) == count
    assert float(peak) - float(baseline) < GROWTH_LIMIT_MB, result.stdout


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
    for count in (6000, 16000):  # tars over one 4 MiB request
        path = tmp_path / f"members-{count}.tar"
        path.write_bytes(tar_of_members(count))
        ds = StreamingJsonl(path, readahead=0)  # the tar reader alone (read-ahead: below)
        tracemalloc.start()
        try:
            assert sum(1 for _ in ds) == count
            peaks[count] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # a member header kept per record would add ~4 MiB for the 10000 more
    assert peaks[16000] - peaks[6000] < 1 << 20, peaks


@pytest.mark.parametrize("budget_mb", [1, 4])
def test_read_ahead_holds_about_its_budget_whatever_the_file_size(tmp_path, budget_mb):
    line = orjson.dumps({"text": "x" * 1000}) + b"\n"
    peaks = {}
    for mb in (8, 24):
        path = tmp_path / f"{mb}.jsonl"
        path.write_bytes(line * (mb * 1000))
        ds = StreamingJsonl(path, readahead=budget_mb << 20)
        tracemalloc.start()
        try:
            assert sum(1 for _ in ds) == mb * 1000
            peaks[mb] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # the budget, one piece being read and a decoded read or two: not the file
    assert peaks[8] < (budget_mb + 3) << 20, peaks
    assert peaks[24] < (budget_mb + 3) << 20, peaks
