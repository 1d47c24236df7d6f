"""The plan of parts: the inputs cut into parts of similar size, fixed before any work.

::

    Inputs.leaves()                  # every input file, in input order (listed once, checked)
      -> leaf_weights                # stored bytes; files of unknown size weigh the mean of
                                     #   a fixed sample of them (a few stats, not one per file)
      -> cut at k * total / parts    # inside a plain JSONL file: the next line beginning;
                                     #   inside a seekable zstd file: the next frame boundary
                                     #   after a newline; elsewhere: the nearest file boundary
      -> Plan                        # parts [begin, end), written as ``_plan.json``

The plan depends only on the inputs (their listing and sizes) and the number of parts, so
every task that makes it makes the same one; it is written atomically under a unique
temporary name, so tasks starting at once (a Slurm array) may all write it. Parts may be
empty (more parts than files). A tree of small files is cut by ranges of its sorted listing;
one big file spreads over many parts. ``_plan.json`` starts with ``_``, so readers of the
output skip it.
"""

from __future__ import annotations

import bisect
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from streamds.formats.seekable import SeekTableError, decompress_frames, read_seek_table
from streamds.formats.unfinished import PLAN_NAME as UNFINISHED_PLAN

from .errors import ConversionError
from .sources import READ_SIZE, Cut, Inputs, Leaf, Span

__all__ = [
    "DEFAULT_PART_BYTES",
    "MAX_PARTS",
    "PLAN_FORMAT",
    "PLAN_NAME",
    "Part",
    "Plan",
    "default_parts",
    "make_plan",
    "read_plan",
    "write_plan",
]

PLAN_NAME = UNFINISHED_PLAN  # one name for the converter and the readers that refuse it
PLAN_FORMAT = "streamds.convert-plan/1"
DEFAULT_PART_BYTES = 1 << 30  # --parts by default: one part per GiB of stored input
MAX_PARTS = 99_999  # part folders are named part-00000 .. part-99999
SAMPLE_SIZES = 64  # files of unknown size stat'ed to estimate their mean size


@dataclass(frozen=True)
class Part:
    """Part `index` of a plan: the records from `begin` up to `end` (None: the input's end),
    `bytes` of stored input by the plan's weights. `begin` None: an empty part at the end."""

    index: int
    begin: Cut | None
    end: Cut | None
    bytes: int

    @property
    def folder(self) -> str:
        """``part-00003``: the folder its shards, journal and manifest go to."""
        return f"part-{self.index:05d}"

    @property
    def span(self) -> Span:
        return Span(self.begin, self.end)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "begin": None if self.begin is None else self.begin.to_json(),
            "end": None if self.end is None else self.end.to_json(),
            "bytes": self.bytes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Part:
        begin, end = data["begin"], data["end"]
        return cls(data["index"], None if begin is None else Cut.from_json(begin),
                   None if end is None else Cut.from_json(end), data["bytes"])


@dataclass(frozen=True)
class Plan:
    """The parts of one conversion, made from `fingerprint` (its inputs and options)."""

    fingerprint: dict[str, Any]
    parts: tuple[Part, ...]

    @property
    def bytes(self) -> int:
        return sum(part.bytes for part in self.parts)

    def to_bytes(self) -> bytes:
        """The file's bytes: a header, then one part per line."""
        head = orjson.dumps({"format": PLAN_FORMAT, "fingerprint": self.fingerprint})
        rows = b",\n".join(b"  " + orjson.dumps(part.to_json()) for part in self.parts)
        return head[:-1] + b',"parts":[\n' + rows + b"\n]}\n"


def read_plan(directory: Path) -> Plan | None:
    """The plan in `directory`, or None when there is none."""
    path = directory / PLAN_NAME
    try:
        doc = orjson.loads(path.read_bytes())
        if doc["format"] != PLAN_FORMAT:
            raise ConversionError(f"{path}: not a {PLAN_FORMAT} plan; convert into a new directory")
        return Plan(doc["fingerprint"], tuple(Part.from_json(part) for part in doc["parts"]))
    except FileNotFoundError:
        return None
    except (orjson.JSONDecodeError, KeyError, TypeError) as err:
        raise ConversionError(
            f"{path}: the plan of parts is damaged ({err!r}); delete it and rerun (it is made "
            "again from the inputs)"
        ) from err


def write_plan(directory: Path, plan: Plan) -> None:
    """Write `directory/_plan.json` atomically; concurrent writers of one plan are safe."""
    path = directory / PLAN_NAME
    tmp = directory / f".{PLAN_NAME}.{socket.gethostname()}.{os.getpid()}.tmp"  # per writer
    with open(tmp, "wb") as f:
        f.write(plan.to_bytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def default_parts(total_bytes: int) -> int:
    """The number of parts when none is given: one per `DEFAULT_PART_BYTES` of input."""
    return max(1, min(MAX_PARTS, -(-total_bytes // DEFAULT_PART_BYTES)))


def leaf_weights(leaves: Sequence[Leaf]) -> list[int]:
    """Stored bytes of each leaf. Sizes a listing did not give are stat'ed for JSONL and tar
    files (few and large); ``.json`` files (many and small) weigh the mean size of up to
    `SAMPLE_SIZES` of them, evenly spaced, so a tree of small files costs a few stats."""
    sizes = [leaf.size if leaf.size is not None or leaf.kind == "json" else _stat_size(leaf)
             for leaf in leaves]
    unknown = [i for i, size in enumerate(sizes) if size is None]
    mean = 0
    if unknown:
        step = max(1, len(unknown) // SAMPLE_SIZES)
        sample = [_stat_size(leaves[i]) for i in unknown[::step][:SAMPLE_SIZES]]
        mean = sum(sample) // len(sample)
    return [mean if size is None else size for size in sizes]


def _stat_size(leaf: Leaf) -> int:
    try:
        if leaf.fs is not None:
            return int(leaf.fs.size(leaf.fs_path) or 0)
        return os.stat(leaf.path).st_size
    except OSError:
        return 0  # gone or unreadable: the task reading it reports that


def make_plan(source: Inputs, parts: int | None, fingerprint: dict[str, Any]) -> Plan:
    """Cut the inputs into `parts` parts (None: `default_parts`) of similar stored size."""
    leaves = list(source.leaves())
    weights = leaf_weights(leaves)
    starts = [0]
    for weight in weights:
        starts.append(starts[-1] + weight)
    total = starts[-1]
    count = default_parts(total) if parts is None else parts
    cuts: list[tuple[int, int, int]] = [(0, 0, 0)]  # (leaf ordinal, decoded, stored offset)
    for k in range(1, count):
        cut = _cut_at(leaves, weights, starts, total * k // count)
        cuts.append(max(cut, cuts[-1]))
    cuts.append((len(leaves), 0, 0))
    found = []
    for k in range(count):
        (a, _, a_stored), (b, _, b_stored) = cuts[k], cuts[k + 1]
        size = starts[b] + b_stored - starts[a] - a_stored  # decoded offsets differ for zstd
        found.append(Part(k, _as_cut(leaves, cuts[k]), _as_cut(leaves, cuts[k + 1]), size))
    return Plan({**fingerprint, "options": {**fingerprint["options"], "parts": count}},
                tuple(found))


def _as_cut(leaves: Sequence[Leaf], cut: tuple[int, int, int]) -> Cut | None:
    ordinal, offset, stored = cut
    if ordinal == len(leaves):
        return None
    leaf = leaves[ordinal]
    return Cut(leaf.input, leaf.rel, offset, stored)


def _cut_at(leaves: Sequence[Leaf], weights: Sequence[int], starts: Sequence[int],
            target: int) -> tuple[int, int, int]:
    """The cut for stored byte `target` of the whole input."""
    ordinal = bisect.bisect_right(starts, target) - 1
    if ordinal >= len(leaves):
        return len(leaves), 0, 0
    leaf, at = leaves[ordinal], target - starts[ordinal]
    if at == 0:
        return ordinal, 0, 0
    inside = None
    if leaf.kind == "jsonl" and leaf.codec is None:
        inside = _line_start(leaf, at)
    elif leaf.kind == "jsonl" and leaf.codec == "zst":
        inside = _frame_start(leaf, at, weights[ordinal])
    if inside is not None:
        return ordinal, *inside
    # not cut inside (no line or frame boundary after `at`, or a file read whole): at the
    # file's start if nearer, else at its end
    return (ordinal, 0, 0) if at * 2 < weights[ordinal] else (ordinal + 1, 0, 0)


def _line_start(leaf: Leaf, at: int) -> tuple[int, int] | None:
    """(offset, offset) of the first line beginning at or after byte `at` of a plain file,
    None when no line begins after it."""
    with leaf.open() as f:
        f.seek(at - 1)
        pos = at - 1
        while data := f.read(READ_SIZE):
            newline = data.find(b"\n")
            if newline >= 0:
                start = pos + newline + 1
                more = newline + 1 < len(data) or f.read(1)
                return (start, start) if more else None
            pos += len(data)
    return None


def _frame_start(leaf: Leaf, at: int, size: int) -> tuple[int, int] | None:
    """(decoded, stored) offset of the first frame boundary at or after stored byte `at` of
    a seekable zstd file where the previous frame ends a line; None when there is none or
    the file has no seek table (it is then cut at a file boundary)."""
    with leaf.open() as f:
        try:
            frames = read_seek_table(f, size, name=leaf.path)
        except SeekTableError:
            return None
        if not frames:
            return None
        first = next((j for j, fr in enumerate(frames) if fr.compressed_offset >= at), None)
        if first is None:
            return None
        for j in range(max(first, 1), len(frames)):
            previous = next(iter(decompress_frames(f, [frames[j - 1]], name=leaf.path)))
            if previous.endswith(b"\n"):
                return frames[j].decompressed_offset, frames[j].compressed_offset
    return None
