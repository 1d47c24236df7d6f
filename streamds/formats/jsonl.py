"""JSON lines, plain or compressed (.gz, .bz2, .xz, a .zst without a seek table).

Blocks: line-aligned byte ranges of a plain file of known size; a compressed file is one
block, decoded from its start. A block [start, end) owns the lines that begin inside it:
reading starts at the first line beginning at or after `start` and stops after the line
that crosses `end`. Positions are byte offsets in the decoded bytes. `line_chunks` is the
line reading every format of JSON lines shares (`jsonl_zst`, `json_file`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from contextlib import closing
from typing import Any, BinaryIO

import numpy as np

from .protocol import Block, Cursor, Format, LineChunk, Opener, Piece

__all__ = ["FORMAT", "CutLines", "Jsonl", "LazyLines", "byte_ranges", "line_chunks"]

_PROBE = 64 << 10  # bytes read past a block's end (or before its start) to find a newline
_FEW_LINES = 64  # lines a read buffer may hold to be found one by one (more: numpy finds them)
_NEWLINE = 0x0A


class LazyLines(Sequence[bytes]):
    """Lines held in some other form, cut out into a list (`_list`) only when first asked
    for as a sequence; equal to the list they stand for."""

    __slots__ = ()

    def _list(self) -> list[bytes]:
        raise NotImplementedError

    def __getitem__(self, index: Any) -> Any:
        return self._list()[index]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        return self._list() == (list(other) if isinstance(other, LazyLines) else other)

    __hash__ = None  # type: ignore[assignment]  # like the list it stands for


class CutLines(LazyLines):
    """The lines of a read buffer, as a list that is cut out of it only when first asked for,
    so a parser that reads them in place (`ends`, through a memoryview) never copies them.
    Line i is ``data[ends[i - 1] + 1 : ends[i]]`` (the first from 0)."""

    __slots__ = ("_lines", "data", "ends")

    def __init__(self, data: bytes, ends: list[int]) -> None:
        self.data = data
        self.ends = ends  # where each line ends in `data` (its newline, or the data's end)
        self._lines: list[bytes] | None = None

    @property
    def cut(self) -> bool:
        """Whether the lines were cut out (asked for) already."""
        return self._lines is not None

    def _list(self) -> list[bytes]:
        if self._lines is None:
            self._lines = self.data.split(b"\n", len(self.ends))[: len(self.ends)]
        return self._lines

    def __len__(self) -> int:
        return len(self.ends)

    def __repr__(self) -> str:
        return f"CutLines({self._list()!r})"


def _line_ends(buffer: bytes) -> list[int] | None:
    """Where each newline of `buffer` is, when it holds at most `_FEW_LINES` (None: more; a
    search of the whole buffer is then cheaper than finding them one by one)."""
    ends: list[int] = []
    find = buffer.find
    at = find(b"\n")
    while at >= 0:
        if len(ends) == _FEW_LINES or (len(ends) == 8 and at * _FEW_LINES < 8 * len(buffer)):
            return None  # more lines, or the first 8 shorter than the buffer's 64th part
        ends.append(at)
        at = find(b"\n", at + 1)
    return ends


def byte_ranges(index: int, size: int, piece: Piece) -> list[Block]:
    """Blocks of `piece(size)` bytes tiling `size` decoded bytes (the last runs to the end)."""
    if size == 0:
        return [Block(index, 0, None)]
    step = piece(size)
    starts = range(0, size, step)
    return [Block(index, start, min(start + step, size)) for start in starts[:-1]] + [
        Block(index, starts[-1], None)
    ]


def _align(stream: BinaryIO, start: int, end: int | None, read_size: int) -> tuple[int, bytes]:
    """Skip through the first newline at or after `start - 1` (the stream is there).

    Returns where the first owned line begins and the bytes already read past it; the
    position is at or beyond `end` when no line begins inside the block.
    """
    pos = start - 1
    while True:
        data = stream.read(min(read_size, _PROBE))
        if not data:
            return pos, b""
        newline = data.find(b"\n")
        if newline >= 0:
            return pos + newline + 1, data[newline + 1 :]
        pos += len(data)
        if end is not None and pos >= end:
            return pos, b""


def line_chunks(
    opener: Opener, shard: Any, block: Block, block_id: int, cursor: Cursor, read_size: int
) -> Iterator[LineChunk]:
    """Chunks of the lines `block` owns, from `cursor.next_line` (a line start) when set."""
    end = block.end
    if cursor.next_line is None and block.start > 0 and shard.frames_end_lines:
        cursor.next_line = block.start  # a frame boundary of a converted shard: a line starts
    if cursor.next_line is None and block.start > 0:
        stream = opener(shard, block.start - 1, end)
        pos, tail = _align(stream, block.start, end, read_size)
    else:
        pos = block.start if cursor.next_line is None else cursor.next_line
        stream, tail = opener(shard, pos, end), b""
    cursor.next_line = pos
    with closing(stream):
        pending = [tail] if tail else []  # bytes from `pos` on that hold no full line yet
        read_to = pos + len(tail)  # decoded offset up to which the stream has been read
        while end is None or pos < end:
            # never read far past the block: up to its end, then small probes for the
            # newline that ends the line crossing it
            size = read_size if end is None else min(read_size, max(end - read_to, 0) + _PROBE)
            data = stream.read(size)
            read_to += len(data)
            at_eof = not data
            if not at_eof and data.find(b"\n") < 0:
                pending.append(data)
                continue
            pending.append(data)
            buffer = b"".join(pending)
            # the lines are found in place and cut out only if asked for
            ends = _line_ends(buffer)
            if ends is None:  # many lines: every newline at once, at C speed
                found = np.flatnonzero(np.frombuffer(buffer, np.uint8) == _NEWLINE)
                ends = found.tolist()
                offsets = [pos, *(found + (pos + 1)).tolist()]
            else:
                offsets = [pos, *(pos + end + 1 for end in ends)]
            tail = buffer[ends[-1] + 1 if ends else 0 :]
            if at_eof and tail:  # a final line without a newline is a record
                ends.append(len(buffer))
                offsets.append(pos + len(buffer) + 1)
            lines = CutLines(buffer, ends)
            if not lines:
                return
            pending = [] if at_eof or not tail else [tail]
            if at_eof and tail:
                offsets[-1] -= 1  # no newline after the last line
            if end is not None and offsets[-1] > end:
                owned = bisect_left(offsets, end, hi=len(lines))
                if owned < len(lines):
                    cursor.next_line = offsets[owned]
                    if owned:
                        kept = CutLines(buffer, ends[:owned])
                        yield LineChunk(block_id, offsets[: owned + 1], kept, data=buffer)
                    return
            pos = cursor.next_line = offsets[-1]
            yield LineChunk(block_id, offsets, lines, data=buffer)
            if at_eof:
                return


class Jsonl(Format):
    """JSON lines: a plain file of known size splits into byte ranges; a compressed one is
    read whole (a ``.zst`` with a seek table is `jsonl_zst`)."""

    name = "jsonl"
    suffixes = (".jsonl", ".ndjson", ".jsonlines", ".ldjson")
    summary = "JSON lines"
    splits = True
    line_positions = True

    def check(self, shard: Any) -> None:
        if shard.frames is not None:
            raise ValueError(
                f"{shard.url}: a 'jsonl' shard has no frames; a seekable zstd shard (one with "
                "frames) is format 'jsonl.zst'"
            )

    def split_size(self, shard: Any) -> int:
        return shard.size if shard.codec is None and shard.size is not None else 0

    def blocks(self, index: int, shard: Any, piece: Piece) -> list[Block]:
        if shard.codec is None and shard.size is not None:
            return byte_ranges(index, shard.size, piece)
        return [Block(index)]

    def read_range(self, shard: Any, start: int, end: int | None, *, at_line: bool
                   ) -> tuple[int, int | None]:
        if not at_line and start > 0 and not shard.frames_end_lines:
            start -= 1  # the reader looks for the newline before the block's start first
        return start, end

    def read_block(self, opener: Opener, shard: Any, block: Block, block_id: int,
                   cursor: Cursor, read_size: int) -> Iterator[LineChunk]:
        return line_chunks(opener, shard, block, block_id, cursor, read_size)

    def place(self, url: str, position: int) -> str | None:
        return None


FORMAT = Jsonl()
