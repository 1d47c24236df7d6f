"""Tests for streamds.formats.seekable: the zstd seekable format, written and read back."""

from __future__ import annotations

import io
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from streamds.formats.seekable import (
    Frame,
    FrameStats,
    SeekableWriter,
    SeekTableError,
    decompress_frames,
    read_seek_table,
)

# Literal values from the format spec, kept independent of the module's own constants.
SKIPPABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
FOOTER_SIZE = 9


def write(lines: list[bytes], **options: int | bool) -> tuple[bytes, list[FrameStats]]:
    buf = io.BytesIO()
    writer = SeekableWriter(buf, **options)
    writer.write_lines(lines)
    stats = writer.close()
    return buf.getvalue(), stats


def parse_table(blob: bytes) -> tuple[int, list[tuple[int, ...]]]:
    """Parse the trailing seek table by the spec: (descriptor, entries)."""
    num_frames, descriptor, magic = struct.unpack("<IBI", blob[-FOOTER_SIZE:])
    assert magic == SEEKABLE_MAGIC
    entry_size = 12 if descriptor & 0x80 else 8
    table_size = 8 + num_frames * entry_size + FOOTER_SIZE
    skippable_magic, frame_len = struct.unpack_from("<II", blob, len(blob) - table_size)
    assert skippable_magic == SKIPPABLE_MAGIC
    assert frame_len == table_size - 8
    start = len(blob) - table_size + 8
    raw = blob[start : start + num_frames * entry_size]
    entries = list(struct.iter_unpack("<III" if entry_size == 12 else "<II", raw))
    return descriptor, entries


def terminated(lines: list[bytes]) -> list[bytes]:
    return [line if line.endswith(b"\n") else line + b"\n" for line in lines]


class CountingReader(io.BytesIO):
    """A file that records the size of every read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.reads: list[int] = []

    def read(self, size: int | None = -1, /) -> bytes:
        self.reads.append(-1 if size is None else size)
        return super().read(size)


one_line = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b""))
# Some lines arrive with their terminator, most without.
lines_strategy = st.lists(
    st.tuples(one_line, st.booleans()).map(lambda t: t[0] + b"\n" if t[1] else t[0]),
    max_size=60,
)


@settings(deadline=None)
@given(
    lines=lines_strategy,
    frame_size=st.integers(min_value=1, max_value=300),
    checksums=st.booleans(),
)
def test_round_trip(lines: list[bytes], frame_size: int, checksums: bool) -> None:
    blob, stats = write(lines, frame_size=frame_size, checksums=checksums, level=1)
    expected = terminated(lines)

    frames = read_seek_table(io.BytesIO(blob), len(blob), name="t.jsonl.zst")
    assert frames is not None
    assert len(frames) == len(stats)
    entry_size = 12 if checksums else 8
    table_size = 8 + len(frames) * entry_size + FOOTER_SIZE
    compressed_offset = decompressed_offset = 0
    for frame, stat in zip(frames, stats, strict=True):
        assert frame.compressed_offset == compressed_offset
        assert frame.decompressed_offset == decompressed_offset
        assert (frame.compressed_size, frame.decompressed_size) == (
            stat.compressed_size,
            stat.decompressed_size,
        )
        compressed_offset += frame.compressed_size
        decompressed_offset += frame.decompressed_size
    assert compressed_offset + table_size == len(blob)
    assert decompressed_offset == sum(map(len, expected))
    assert sum(s.records for s in stats) == len(lines)

    chunks = list(decompress_frames(io.BytesIO(blob), frames))
    assert b"".join(chunks) == b"".join(expected)

    # Frames break only at line ends, and hold the records the stats say.
    position = 0
    for chunk, stat in zip(chunks, stats, strict=True):
        assert chunk.endswith(b"\n")
        assert chunk.count(b"\n") == stat.records
        assert chunk == b"".join(expected[position : position + stat.records])
        # Never over frame_size, unless the frame is one long line.
        assert len(chunk) <= frame_size or stat.records == 1
        position += stat.records

    # Frames are not cut early: each is full, or the next line would have overflowed it.
    position = 0
    for chunk, stat in zip(chunks[:-1], stats[:-1], strict=True):
        position += stat.records
        assert len(chunk) >= frame_size or len(chunk) + len(expected[position]) > frame_size


def test_empty_input_writes_only_a_seek_table() -> None:
    blob, stats = write([])
    assert stats == []
    assert len(blob) == 8 + FOOTER_SIZE
    assert read_seek_table(io.BytesIO(blob), len(blob)) == []


def test_long_line_gets_a_frame_of_its_own() -> None:
    lines = [b"a", b"x" * 100, b"b", b"c"]
    blob, stats = write(lines, frame_size=10)
    assert [s.records for s in stats] == [1, 1, 2]
    frames = read_seek_table(io.BytesIO(blob), len(blob))
    assert frames is not None
    chunks = list(decompress_frames(io.BytesIO(blob), frames))
    assert chunks == [b"a\n", b"x" * 100 + b"\n", b"b\nc\n"]


def test_frames_carry_content_size() -> None:
    blob, _ = write([b"abc", b"def"], frame_size=4)
    frames = read_seek_table(io.BytesIO(blob), len(blob))
    assert frames is not None
    for frame in frames:
        start = frame.compressed_offset
        header = blob[start : start + frame.compressed_size]
        assert zstandard.frame_content_size(header) == frame.decompressed_size


@pytest.mark.parametrize("checksums", [True, False])
def test_zstd_cli_decodes_the_file(tmp_path: Path, checksums: bool) -> None:
    zstd = shutil.which("zstd")
    if zstd is None:
        pytest.skip("the zstd command-line tool is not installed (apt install zstd)")
    lines = [f'{{"id": {i}, "text": "{"w" * (i % 37)}"}}'.encode() for i in range(500)]
    blob, stats = write(lines, frame_size=1000, checksums=checksums)
    assert len(stats) > 1
    path = tmp_path / "shard.jsonl.zst"
    path.write_bytes(blob)
    decoded = subprocess.run([zstd, "-dc", str(path)], check=True, capture_output=True).stdout
    assert decoded == b"".join(terminated(lines))


def test_zstd_cli_decodes_an_empty_file(tmp_path: Path) -> None:
    zstd = shutil.which("zstd")
    if zstd is None:
        pytest.skip("the zstd command-line tool is not installed (apt install zstd)")
    path = tmp_path / "empty.jsonl.zst"
    path.write_bytes(write([])[0])
    decoded = subprocess.run([zstd, "-dc", str(path)], check=True, capture_output=True).stdout
    assert decoded == b""


@pytest.mark.parametrize(
    "blob",
    [
        zstandard.ZstdCompressor().compress(b'{"a": 1}\n' * 100),
        zstandard.ZstdCompressor().compress(b"x") + zstandard.ZstdCompressor().compress(b"y"),
        b"",
        b"\xb1\xea\x92\x8f",  # the magic alone, shorter than a footer
    ],
    ids=["one-frame", "two-frames", "empty", "tiny"],
)
def test_foreign_zst_has_no_seek_table(blob: bytes) -> None:
    assert read_seek_table(io.BytesIO(blob), len(blob)) is None


def test_read_seek_table_costs_two_reads() -> None:
    blob, stats = write([b"line"] * 50, frame_size=20)
    f = CountingReader(blob)
    frames = read_seek_table(f, len(blob))
    assert frames is not None and len(frames) == len(stats)
    assert f.reads == [FOOTER_SIZE, 8 + 12 * len(stats)]


def test_decompress_frames_reads_one_frame_at_a_time() -> None:
    blob, _ = write([b"line %d" % i for i in range(50)], frame_size=30)
    frames = read_seek_table(io.BytesIO(blob), len(blob))
    assert frames is not None
    f = CountingReader(blob)
    chunks = decompress_frames(f, frames)
    next(chunks)
    assert f.reads == [frames[0].compressed_size]  # lazy: nothing read ahead
    list(chunks)
    assert f.reads == [frame.compressed_size for frame in frames]


def test_decompress_frames_from_the_middle() -> None:
    lines = [b"line %d" % i for i in range(50)]
    blob, _ = write(lines, frame_size=30)
    frames = read_seek_table(io.BytesIO(blob), len(blob))
    assert frames is not None and len(frames) > 3
    tail = frames[2:]
    decoded = b"".join(decompress_frames(io.BytesIO(blob), tail))
    expected = b"".join(terminated(lines))[tail[0].decompressed_offset :]
    assert decoded == expected
    # Frames need not be neighbours: each is sought.
    picked = [frames[3], frames[1]]
    chunks = list(decompress_frames(io.BytesIO(blob), picked))
    whole = b"".join(terminated(lines))
    assert chunks == [
        whole[fr.decompressed_offset : fr.decompressed_offset + fr.decompressed_size]
        for fr in picked
    ]


def test_empty_frame_entry_yields_empty_bytes() -> None:
    # A frame of size 0 in the table (e.g. a skippable frame written by another tool).
    skippable = struct.pack("<II", 0x184D2A50, 3) + b"abc"
    frame = Frame(
        compressed_offset=0,
        compressed_size=len(skippable),
        decompressed_offset=0,
        decompressed_size=0,
    )
    assert list(decompress_frames(io.BytesIO(skippable), [frame])) == [b""]


def seekable_blob() -> tuple[bytes, list[FrameStats]]:
    blob, stats = write([b'{"n": %d}' % i for i in range(200)], frame_size=100)
    assert len(stats) > 5
    return blob, stats


def test_stated_size_larger_than_file_raises() -> None:
    blob, _ = seekable_blob()
    truncated = blob[:-1]
    # A listing said the object has len(blob) bytes, but it arrived short.
    with pytest.raises(SeekTableError, match=r"^shard-7\.jsonl\.zst: offset \d+: .*truncated"):
        read_seek_table(io.BytesIO(truncated), len(blob), name="shard-7.jsonl.zst")


@pytest.mark.parametrize("cut", [1, 17, 200])
def test_missing_frame_bytes_raise(cut: int) -> None:
    blob, _ = seekable_blob()
    damaged = blob[cut:]  # the seek table is intact, some frame bytes are gone
    with pytest.raises(SeekTableError, match=r"^shard-7\.jsonl\.zst: offset \d+: .*add up"):
        read_seek_table(io.BytesIO(damaged), len(damaged), name="shard-7.jsonl.zst")


def test_only_the_footer_left_raises() -> None:
    blob, stats = seekable_blob()
    footer = blob[-FOOTER_SIZE:]
    with pytest.raises(SeekTableError, match=rf"^s\.zst: offset 0: .*{len(stats)} frames"):
        read_seek_table(io.BytesIO(footer), len(footer), name="s.zst")


def test_tail_truncation_is_indistinguishable_from_foreign() -> None:
    # Documented limit: without the magic in the last 4 bytes there is no seek table to judge.
    blob, _ = seekable_blob()
    truncated = blob[:-3]
    assert read_seek_table(io.BytesIO(truncated), len(truncated)) is None


def with_footer(blob: bytes, *, num_frames: int | None = None, descriptor: int | None = None):
    old_frames, old_descriptor, magic = struct.unpack("<IBI", blob[-FOOTER_SIZE:])
    footer = struct.pack(
        "<IBI",
        old_frames if num_frames is None else num_frames,
        old_descriptor if descriptor is None else descriptor,
        magic,
    )
    return blob[:-FOOTER_SIZE] + footer


@pytest.mark.parametrize("delta", [-1, 1, -3, 5, 1 << 20])
def test_wrong_frame_count_raises(delta: int) -> None:
    blob, stats = seekable_blob()
    damaged = with_footer(blob, num_frames=len(stats) + delta)
    with pytest.raises(SeekTableError, match=r"^bad\.zst: offset \d+: "):
        read_seek_table(io.BytesIO(damaged), len(damaged), name="bad.zst")


@pytest.mark.parametrize("descriptor", [0x00, 0x84, 0xC0, 0x04])
def test_wrong_descriptor_raises(descriptor: int) -> None:
    blob, _ = seekable_blob()  # written with checksums: descriptor 0x80
    damaged = with_footer(blob, descriptor=descriptor)
    with pytest.raises(SeekTableError, match=r"^bad\.zst: offset \d+: "):
        read_seek_table(io.BytesIO(damaged), len(damaged), name="bad.zst")


def test_unused_descriptor_bits_are_ignored() -> None:
    blob, stats = seekable_blob()
    relaxed = with_footer(blob, descriptor=0x83)  # bits 1-0 are "unused": not interpreted
    frames = read_seek_table(io.BytesIO(relaxed), len(relaxed))
    assert frames is not None and len(frames) == len(stats)


def test_wrong_table_entry_raises() -> None:
    blob, stats = seekable_blob()
    frames = read_seek_table(io.BytesIO(blob), len(blob))
    assert frames is not None
    table_start = len(blob) - (8 + 12 * len(stats) + FOOTER_SIZE)
    entry = table_start + 8 + 12 * 2  # the third frame's Compressed_Size
    size = struct.unpack_from("<I", blob, entry)[0]
    damaged = blob[:entry] + struct.pack("<I", size + 1) + blob[entry + 4 :]
    with pytest.raises(SeekTableError, match=rf"^bad\.zst: offset {table_start}: .*add up"):
        read_seek_table(io.BytesIO(damaged), len(damaged), name="bad.zst")


def test_corrupt_frame_raises_on_decompress() -> None:
    blob, _ = seekable_blob()
    frames = read_seek_table(io.BytesIO(blob), len(blob))
    assert frames is not None
    target = frames[3]
    middle = target.compressed_offset + target.compressed_size // 2
    damaged = blob[:middle] + bytes([blob[middle] ^ 0xFF]) + blob[middle + 1 :]
    chunks = decompress_frames(io.BytesIO(damaged), frames, name="bad.zst")
    for _ in range(3):
        next(chunks)
    with pytest.raises(SeekTableError, match=rf"^bad\.zst: offset {target.compressed_offset}: "):
        next(chunks)


def test_decompressed_size_disagreeing_with_table_raises() -> None:
    blob, _ = seekable_blob()
    frames = read_seek_table(io.BytesIO(blob), len(blob))
    assert frames is not None
    lying = Frame(
        frames[0].compressed_offset,
        frames[0].compressed_size,
        frames[0].decompressed_offset,
        frames[0].decompressed_size - 1,
    )
    with pytest.raises(SeekTableError, match=r"^bad\.zst: offset 0: .*says"):
        list(decompress_frames(io.BytesIO(blob), [lying], name="bad.zst"))


def test_short_frame_read_raises() -> None:
    blob, _ = seekable_blob()
    frames = read_seek_table(io.BytesIO(blob), len(blob))
    assert frames is not None
    short = blob[: frames[1].compressed_offset + 3]
    with pytest.raises(SeekTableError, match=rf"^bad\.zst: offset {frames[1].compressed_offset}"):
        list(decompress_frames(io.BytesIO(short), frames, name="bad.zst"))


@settings(deadline=None, max_examples=30)
@given(lines=lines_strategy, frame_size=st.integers(min_value=1, max_value=200))
def test_output_is_deterministic(lines: list[bytes], frame_size: int) -> None:
    first, _ = write(lines, frame_size=frame_size)
    buf = io.BytesIO()
    with SeekableWriter(buf, frame_size=frame_size) as writer:
        for line in lines:
            writer.write_line(line)
    assert buf.getvalue() == first


def test_options_change_the_output() -> None:
    lines = [b"some text %d" % i for i in range(300)]
    base, _ = write(lines)
    assert write(lines, level=19)[0] != base
    assert write(lines, frame_size=100)[0] != base
    assert write(lines, checksums=False)[0] != base


@settings(deadline=None, max_examples=30)
@given(lines=lines_strategy, frame_size=st.integers(min_value=1, max_value=200))
def test_checksums_are_xxh64_low_bits(lines: list[bytes], frame_size: int) -> None:
    blob, _ = write(lines, frame_size=frame_size)
    descriptor, entries = parse_table(blob)
    assert descriptor == 0x80
    frames = read_seek_table(io.BytesIO(blob), len(blob))
    assert frames is not None
    chunks = decompress_frames(io.BytesIO(blob), frames)
    for (_, _, checksum), chunk in zip(entries, chunks, strict=True):
        assert checksum == xxhash.xxh64_intdigest(chunk) & 0xFFFFFFFF


def test_no_checksums_when_disabled() -> None:
    blob, stats = write([b"a", b"b"], frame_size=2, checksums=False)
    descriptor, entries = parse_table(blob)
    assert descriptor == 0
    assert entries == [(s.compressed_size, s.decompressed_size) for s in stats]


def test_no_checksums_without_xxhash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash now raises ImportError
    blob, stats = write([b"a", b"b"], frame_size=2, checksums=True)
    descriptor, entries = parse_table(blob)
    assert descriptor == 0
    assert len(entries) == len(stats) == 2


def test_context_manager_writes_table_on_success() -> None:
    buf = io.BytesIO()
    with SeekableWriter(buf) as writer:
        writer.write_line(b"x")
    assert buf.closed is False  # the caller's file stays open
    assert read_seek_table(buf, len(buf.getvalue())) is not None


def test_context_manager_writes_no_table_on_error() -> None:
    buf = io.BytesIO()
    with pytest.raises(RuntimeError), SeekableWriter(buf, frame_size=4) as writer:
        writer.write_lines([b"abc", b"def"])
        raise RuntimeError("source failed")
    assert buf.getvalue()  # the finished frames were written...
    assert read_seek_table(buf, len(buf.getvalue())) is None  # ...but no table claims them


def test_close_is_idempotent() -> None:
    buf = io.BytesIO()
    writer = SeekableWriter(buf)
    writer.write_line(b"x")
    first = writer.close()
    size = len(buf.getvalue())
    assert writer.close() == first
    assert len(buf.getvalue()) == size


def test_write_after_close_raises() -> None:
    writer = SeekableWriter(io.BytesIO())
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write_line(b"x")


def test_embedded_newline_is_refused() -> None:
    writer = SeekableWriter(io.BytesIO())
    with pytest.raises(ValueError, match="newline at byte 1 of 4"):
        writer.write_line(b"a\nb\n")
    writer.write_line(b"ab\n")  # a trailing newline is fine
    assert writer.close()[0].records == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"frame_size": 0}, "frame_size must be in"),
        ({"frame_size": (1 << 30) + 1}, "frame_size must be in"),
        ({"level": 23}, "level must be <= 22"),
    ],
)
def test_bad_arguments_fail_in_the_constructor(options: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SeekableWriter(io.BytesIO(), **options)


def test_seek_table_error_is_a_value_error() -> None:
    assert issubclass(SeekTableError, ValueError)


def test_full_frame_is_written_at_once() -> None:
    buf = io.BytesIO()
    writer = SeekableWriter(buf, frame_size=10)
    writer.write_line(b"x" * 20)  # fills a frame: compressed now, not held until the next line
    assert len(buf.getvalue()) > 0
    writer.write_line(b"y")  # the open frame stays in memory
    size = len(buf.getvalue())
    writer.close()
    assert len(buf.getvalue()) > size


def test_docstring_example() -> None:
    import doctest

    import streamds.formats.seekable

    result = doctest.testmod(streamds.formats.seekable)
    assert result.attempted > 0 and result.failed == 0
