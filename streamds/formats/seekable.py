"""The zstd seekable format: independent frames of whole lines, then a seek table.

Layout (facebook/zstd, contrib/seekable_format/zstd_seekable_compression_format.md, v0.1.0;
all integers little-endian)::

    zstd frame 0 | zstd frame 1 | ... | seek table frame

    seek table frame = Skippable_Magic_Number 0x184D2A5E (u32) | Frame_Size (u32)
                       | entries | footer
    entry            = Compressed_Size (u32) | Decompressed_Size (u32) | [Checksum (u32)]
    footer           = Number_Of_Frames (u32) | Seek_Table_Descriptor (u8)
                       | Seekable_Magic_Number 0x8F92EAB1 (u32)

`Frame_Size` counts the entries and the footer. Descriptor bit 7 says entries carry a
checksum: the low 32 bits of XXH64 (seed 0) of the frame's decoded bytes. Bits 6-2 are
reserved and must be 0. Frame 0 starts at byte 0; frame i+1 starts where frame i ends.
Decoders skip skippable frames, so `zstd -d` decodes the file as one stream.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO

import zstandard

__all__ = [
    "MAX_FRAME_SIZE",
    "Frame",
    "FrameStats",
    "SeekTableError",
    "SeekableWriter",
    "decompress_frames",
    "read_seek_table",
]

_SKIPPABLE_MAGIC = 0x184D2A5E
_SEEKABLE_MAGIC = 0x8F92EAB1
_CHECKSUM_FLAG = 0x80
_RESERVED_BITS = 0x7C
# The reference C implementation refuses frames that decode to more than 1 GiB.
MAX_FRAME_SIZE = 1 << 30

_SKIPPABLE_HEADER = struct.Struct("<II")  # magic, Frame_Size
_FOOTER = struct.Struct("<IBI")  # Number_Of_Frames, Seek_Table_Descriptor, magic
_ENTRY = struct.Struct("<II")  # Compressed_Size, Decompressed_Size
_ENTRY_WITH_CHECKSUM = struct.Struct("<III")  # ... , Checksum


@dataclass(frozen=True)
class Frame:
    """Where one zstd frame lies in the file and in the decoded stream."""

    compressed_offset: int
    compressed_size: int
    decompressed_offset: int
    decompressed_size: int


@dataclass
class FrameStats:
    """What SeekableWriter put in one frame; `records` feeds the manifest."""

    records: int
    decompressed_size: int
    compressed_size: int


class SeekTableError(ValueError):
    """A seekable zstd file whose seek table disagrees with the file.

    The message names the file and the byte offset of the damage.
    """


def read_seek_table(f: BinaryIO, file_size: int, *, name: str = "<stream>") -> list[Frame] | None:
    """Return the frames of a seekable zstd file, or None when it has no seek table.

    None means the last 4 bytes are not the seekable magic: a foreign .zst, or a seekable
    file that lost its tail (the two cannot be told apart). Costs two small reads through
    `f.seek`/`f.read`: the 9-byte footer, then the table (8 + 12 bytes per frame).
    Checksums in the table are not returned.

    Raises SeekTableError when the footer magic is present but the table is inconsistent:
    reserved descriptor bits set, a table larger than the file, a bad skippable header, frame
    sizes not adding up to the file size minus the table frame, or a short read (the file
    is shorter than `file_size`).
    """
    if file_size < _FOOTER.size:
        return None
    footer_offset = file_size - _FOOTER.size
    num_frames, descriptor, magic = _FOOTER.unpack(
        _read_exact(f, footer_offset, _FOOTER.size, name)
    )
    if magic != _SEEKABLE_MAGIC:
        return None
    if descriptor & _RESERVED_BITS:
        raise SeekTableError(
            f"{name}: offset {footer_offset + 4}: seek table descriptor 0x{descriptor:02x} "
            f"sets reserved bits (mask 0x{_RESERVED_BITS:02x}); unknown format version or damage"
        )
    entry = _ENTRY_WITH_CHECKSUM if descriptor & _CHECKSUM_FLAG else _ENTRY
    table_size = _SKIPPABLE_HEADER.size + num_frames * entry.size + _FOOTER.size
    table_offset = file_size - table_size
    if table_offset < 0:
        raise SeekTableError(
            f"{name}: offset {footer_offset}: footer declares {num_frames} frames, a "
            f"{table_size}-byte seek table, but the file has {file_size} bytes; truncated"
        )
    head = _read_exact(f, table_offset, table_size - _FOOTER.size, name)
    skippable_magic, frame_len = _SKIPPABLE_HEADER.unpack_from(head)
    if skippable_magic != _SKIPPABLE_MAGIC:
        raise SeekTableError(
            f"{name}: offset {table_offset}: expected skippable magic 0x{_SKIPPABLE_MAGIC:08X} "
            f"for a table of {num_frames} frames, found 0x{skippable_magic:08X}"
        )
    if frame_len != table_size - _SKIPPABLE_HEADER.size:
        raise SeekTableError(
            f"{name}: offset {table_offset + 4}: seek table frame size is {frame_len}, "
            f"but {num_frames} frames need {table_size - _SKIPPABLE_HEADER.size}"
        )
    frames = []
    compressed_offset = decompressed_offset = 0
    for fields in entry.iter_unpack(memoryview(head)[_SKIPPABLE_HEADER.size :]):
        compressed_size, decompressed_size = fields[0], fields[1]
        frames.append(
            Frame(compressed_offset, compressed_size, decompressed_offset, decompressed_size)
        )
        compressed_offset += compressed_size
        decompressed_offset += decompressed_size
    if compressed_offset != table_offset:
        raise SeekTableError(
            f"{name}: offset {table_offset}: the {num_frames} frames in the seek table add up "
            f"to {compressed_offset} bytes, but the seek table starts at byte {table_offset}; "
            f"the file was truncated or edited"
        )
    return frames


def decompress_frames(
    f: BinaryIO, frames: Sequence[Frame], *, name: str = "<stream>"
) -> Iterator[bytes]:
    """Yield the decoded bytes of each frame in `frames`, in order.

    Seeks to each frame's offset (a no-op between neighbours on a buffered file) and reads
    one frame's compressed bytes at a time, so memory is one compressed plus one decoded
    frame. An empty frame (decompressed_size 0, e.g. a skippable frame) yields b"".
    Raises SeekTableError, naming the file and offset, on a short read, a frame that does
    not decode, or a decoded size that disagrees with the table.
    """
    decompressor = zstandard.ZstdDecompressor()
    for frame in frames:
        data = _read_exact(f, frame.compressed_offset, frame.compressed_size, name)
        if frame.decompressed_size == 0:
            yield b""
            continue
        try:
            out = decompressor.decompress(
                data, max_output_size=frame.decompressed_size, allow_extra_data=False
            )
        except zstandard.ZstdError as err:
            raise SeekTableError(
                f"{name}: offset {frame.compressed_offset}: frame does not decode: {err}"
            ) from err
        if len(out) != frame.decompressed_size:
            raise SeekTableError(
                f"{name}: offset {frame.compressed_offset}: frame decodes to {len(out)} bytes, "
                f"the seek table says {frame.decompressed_size}"
            )
        yield out


class SeekableWriter:
    """Writes whole lines into independent zstd frames, then the seek table on close().

    A frame holds about `frame_size` decoded bytes and never splits a line: a frame is cut
    before a line that would overflow it, and a line longer than `frame_size` gets a frame
    of its own. Memory is one frame of lines plus its compressed bytes. Each frame carries
    its content size and a zstd content checksum in its header; output is byte-identical
    for the same lines and options. `fileobj` must write all it is given in one call (any
    buffered file, io.BytesIO, fsspec files); it is never closed here.

    Used as a context manager, the seek table is written only when the block exits without
    an exception, so a failed write leaves a file with no seek table (read_seek_table gives
    None) rather than one whose table looks complete.

    >>> import io
    >>> buf = io.BytesIO()
    >>> with SeekableWriter(buf, frame_size=8) as w:
    ...     w.write_lines([b"{}", b'{"a": 1}'])
    >>> [f.decompressed_size for f in read_seek_table(buf, len(buf.getvalue()))]
    [3, 9]
    """

    def __init__(
        self,
        fileobj: BinaryIO,
        *,
        level: int = 3,
        frame_size: int = 4 << 20,
        checksums: bool = True,
    ) -> None:
        if not 1 <= frame_size <= MAX_FRAME_SIZE:
            raise ValueError(
                f"frame_size must be in 1..{MAX_FRAME_SIZE} bytes, got "
                f"{frame_size}; a few MiB (the default, 4 MiB) suits most corpora"
            )
        if level > zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(
                f"level must be <= {zstandard.MAX_COMPRESSION_LEVEL}, got {level}; "
                f"use 3 (the default) for speed, 19 for size"
            )
        self._fileobj = fileobj
        self._frame_size = frame_size
        self._compressor = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=True
        )
        self._xxh64 = _load_xxh64() if checksums else None
        self._lines: list[bytes] = []  # the open frame: lines and their b"\n" terminators
        self._buffered = 0  # decoded bytes in the open frame
        self._records = 0  # lines in the open frame
        self._stats: list[FrameStats] = []
        self._checksums: list[int] = []
        self._closed = False

    def write_line(self, line: bytes) -> None:
        """Add one record; appends b"\\n" when `line` lacks it. Compresses a frame when full.

        Raises ValueError for a line with a newline before its end (that is two records)
        or one longer than 1 GiB.
        """
        if self._closed:
            raise ValueError("write_line() on a closed SeekableWriter")
        newline = line.find(b"\n")
        size = len(line) if newline >= 0 else len(line) + 1
        if 0 <= newline < size - 1:
            raise ValueError(
                f"line has a newline at byte {newline} of {len(line)}; one record is one "
                f"line, so split it or escape the newline"
            )
        if size > MAX_FRAME_SIZE:
            raise ValueError(
                f"line of {size} bytes exceeds the {MAX_FRAME_SIZE}-byte limit "
                f"of one seekable frame"
            )
        if self._buffered and self._buffered + size > self._frame_size:
            self._flush()
        self._lines.append(line)
        if newline < 0:
            self._lines.append(b"\n")  # cheaper than line + b"\n", which copies the line
        self._buffered += size
        self._records += 1
        if self._buffered >= self._frame_size:
            self._flush()

    def write_lines(self, lines: Iterable[bytes]) -> None:
        """Add each line as by write_line()."""
        for line in lines:
            self.write_line(line)

    def close(self) -> list[FrameStats]:
        """Compress the last frame, write the seek table, and return per-frame stats.

        Does not close `fileobj`. A second call writes nothing and returns the same stats.
        """
        if not self._closed:
            if self._lines:
                self._flush()
            checksums = self._checksums if self._xxh64 is not None else None
            self._fileobj.write(_encode_seek_table(self._stats, checksums))
            self._closed = True
        return list(self._stats)

    def __enter__(self) -> SeekableWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()

    def _flush(self) -> None:
        data = b"".join(self._lines)
        frame = self._compressor.compress(data)
        self._fileobj.write(frame)
        self._stats.append(FrameStats(self._records, len(data), len(frame)))
        if self._xxh64 is not None:
            self._checksums.append(self._xxh64(data) & 0xFFFFFFFF)
        self._lines = []
        self._buffered = 0
        self._records = 0


def _load_xxh64() -> Callable[[bytes], int] | None:
    # zstandard does not expose XXH64. xxhash is a declared dependency; where it is missing
    # all the same (this module copied on its own) the seek table is written with no
    # checksums (Checksum_Flag 0), which the format allows.
    # Frames still carry zstd's own content checksum, which every decoder verifies.
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh64_intdigest


def _encode_seek_table(stats: Sequence[FrameStats], checksums: Sequence[int] | None) -> bytes:
    if checksums is None:
        descriptor = 0
        entries = b"".join(_ENTRY.pack(s.compressed_size, s.decompressed_size) for s in stats)
    else:
        descriptor = _CHECKSUM_FLAG
        entries = b"".join(
            _ENTRY_WITH_CHECKSUM.pack(s.compressed_size, s.decompressed_size, checksum)
            for s, checksum in zip(stats, checksums, strict=True)
        )
    footer = _FOOTER.pack(len(stats), descriptor, _SEEKABLE_MAGIC)
    header = _SKIPPABLE_HEADER.pack(_SKIPPABLE_MAGIC, len(entries) + len(footer))
    return header + entries + footer


def _read_exact(f: BinaryIO, offset: int, size: int, name: str) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise SeekTableError(
            f"{name}: offset {offset}: expected {size} bytes, read {len(data)}; "
            f"the file is truncated or shorter than its stated size"
        )
    return data
