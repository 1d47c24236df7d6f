"""Line runs: a batch of JSON lines held as runs of consecutive lines of the read buffers they
came from, for a DataLoader worker to hand over without cutting the lines out and joining
them again.

A worker that leaves its lines for the main process to parse (`streamds.stages.parse_later`)
only copies them: into its payload, then into the shared-memory ring. Lines read in order lie
in their read buffer already as the payload holds them (one after another, a "\\n" between),
so the in-order records stage (`Records.batches_with_positions`) keeps each batch as slices
of those buffers, and the payload is written from the slices: one copy of each byte in the
worker, not three (cut, join, write). Lines that are not consecutive in a buffer (a shuffle's,
lines around a blank one) are kept as a list and joined, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..formats.jsonl import LazyLines
from .chunks import Chunk

__all__ = ["LineRuns"]

_NEWLINE = 0x0A


class LineRuns(LazyLines):
    """The lines of a batch, in order: a list of runs, each either a slice ``(data, start,
    stop, count)`` of a read buffer holding `count` consecutive lines (``data[start:stop]``
    is the lines joined with "\\n"), or a list of loose lines. Cut into a list of bytes only
    where asked for as a sequence (`pieces` does not)."""

    __slots__ = ("_lines", "count", "nbytes", "runs")

    def __init__(self) -> None:
        self.runs: list[tuple[bytes, int, int, int] | list[bytes]] = []
        self.count = 0
        self.nbytes = 0  # bytes of the lines, their newlines not counted
        self._lines: list[bytes] | None = None

    @classmethod
    def of(cls, lines: Sequence[bytes]) -> LineRuns:
        """`lines` as runs (loose lines: one run)."""
        if isinstance(lines, LineRuns):
            return lines
        runs = cls()
        runs.add_lines(lines)
        return runs

    def add_chunk(self, chunk: Chunk, start: int, end: int) -> None:
        """Lines `start` to `end` of a clean chunk of raw lines: a slice of its read buffer
        where it has one (`Chunk.data`: its lines are cut from it, the first at its start),
        else its lines."""
        data = chunk.data
        if data is None:
            self.add_lines(chunk.items[start:end])
            return
        at, base = chunk.offsets, chunk.offsets[0]
        begin, stop = at[start] - base, at[end] - base
        if data[stop - 1] == _NEWLINE:  # (not after the last line of a file without one)
            stop -= 1
        count = end - start
        self.count += count
        self.nbytes += stop - begin - (count - 1)
        self._lines = None
        if self.runs:
            last = self.runs[-1]
            if isinstance(last, tuple) and last[0] is data and last[2] + 1 == begin:
                self.runs[-1] = (data, last[1], stop, last[3] + count)  # continues it
                return
        self.runs.append((data, begin, stop, count))

    def add_lines(self, lines: Sequence[bytes]) -> None:
        """Loose lines (bytes), after those held."""
        if not lines:
            return
        self.count += len(lines)
        self.nbytes += sum(map(len, lines))
        self._lines = None
        if self.runs and isinstance(self.runs[-1], list):
            self.runs[-1] += lines
        else:
            self.runs.append(list(lines))  # a copy: the caller's list stays as it is

    def __iadd__(self, other: Sequence[bytes]) -> LineRuns:
        if isinstance(other, LineRuns):
            for run in other.runs:
                if isinstance(run, list):
                    self.add_lines(run)
                else:
                    self._add_run(run)
        else:
            self.add_lines(other)
        return self

    def _add_run(self, run: tuple[bytes, int, int, int]) -> None:
        data, begin, stop, count = run
        self.count += count
        self.nbytes += stop - begin - (count - 1)
        self._lines = None
        last = self.runs[-1] if self.runs else None
        if isinstance(last, tuple) and last[0] is data and last[2] + 1 == begin:
            self.runs[-1] = (data, last[1], stop, last[3] + count)
        else:
            self.runs.append(run)

    def pieces(self, offsets: Sequence[int]) -> tuple[list[bytes | memoryview], np.ndarray]:
        """The lines joined with "\\n", as pieces to write one after another (slices of the
        read buffers, views: nothing copied; loose lines joined), and where each line ends in
        them. `offsets`: each line's offset in its file (a run's lines lie as far apart in its
        buffer as in the file)."""
        pieces: list[bytes | memoryview] = []
        ends = np.empty(self.count, np.int64)
        at: np.ndarray | None = None
        line = written = 0  # lines and bytes before the run
        for run in self.runs:
            if pieces:
                pieces.append(b"\n")
            if isinstance(run, list):
                count, piece = len(run), b"\n".join(run)
                lengths = np.fromiter(map(len, run), np.int64, count)
                np.cumsum(lengths + 1, out=ends[line : line + count])
                ends[line : line + count] += written - 1
            else:
                data, begin, stop, count = run
                piece = memoryview(data)[begin:stop]
                if at is None:
                    at = np.array(offsets, np.int64)
                # a line ends where the next begins, less its newline; the last at the slice's end
                np.subtract(at[line + 1 : line + count], at[line] + 1 - written,
                            out=ends[line : line + count - 1])
                ends[line + count - 1] = written + stop - begin
            pieces.append(piece)
            written += len(piece) + 1
            line += count
        return pieces, ends

    def _list(self) -> list[bytes]:
        if self._lines is None:
            lines: list[bytes] = []
            for run in self.runs:
                if isinstance(run, list):
                    lines += run
                else:
                    data, begin, stop, count = run
                    lines += data[begin:stop].split(b"\n", count - 1)
            self._lines = lines
        return self._lines

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"LineRuns({len(self.runs)} runs, {self.count} lines)"

