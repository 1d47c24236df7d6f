"""What a shard format is: the `Format` base class and the values its methods pass.

`streamds.formats.registry` states the protocol and holds the formats; this module has the
pieces they share, so a format module imports only this one (and the formats it settles
into), never storage: reading is handed an `Opener` by storage, resolving a `FileFacts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

__all__ = ["Block", "Cursor", "FileFacts", "Format", "LineChunk", "Opener", "Piece", "Settled"]

T = TypeVar("T")

# decoded bytes of a shard from an offset, meant to be read up to an end offset (None: all):
# opener(shard, offset, end=None) -> a binary file; storage gives it (ranges, retries, cache)
Opener = Callable[..., BinaryIO]

# the target size of one block of a file of `size` splittable units (the plan decides it)
Piece = Callable[[int], int]


@dataclass(frozen=True)
class Block:
    """Positions [start, end) of one shard, in its format's units; it owns the records that
    begin inside them.

    Units are the format's: decoded bytes for JSON lines (a block owns the lines that begin
    inside it), record ordinals for formats read whole (tar: 0, None). `end` is None for a
    block that runs to the end of its shard.
    """

    shard: int
    start: int = 0
    end: int | None = None


@dataclass(frozen=True)
class LineChunk:
    """Consecutive raw records of one block.

    `offsets[i]` is the position of `lines[i]` (a byte offset in the shard's decoded bytes
    for JSON lines; the record's ordinal for tar shards and JSON documents); `offsets[-1]` is
    the position of the record after the chunk. `labels` names tar members and document
    parts, for error messages. `lines` holds JSON text (bytes) for formats that parse, Python
    values for those that do not (`Format.parses`). `data`: JSON lines only, the decoded
    bytes the lines were cut from at each newline (the lines are its first pieces), so a
    search over every line (`streamds.formats.values.loads_many`) needs no copy.
    """

    block: int
    offsets: list[int]
    lines: Sequence[Any]  # a list, or `jsonl.CutLines` (cut from `data` when asked for)
    labels: list[str] | None = None
    data: bytes | None = None


class Cursor:
    """Where the next unread record of a block begins (None: not yet known, e.g. a line
    format not yet aligned to a line). A format's reader moves it as it hands chunks out, so
    a retry reopens exactly there."""

    def __init__(self, next_line: int | None) -> None:
        self.next_line = next_line


@dataclass(frozen=True)
class FileFacts:
    """What storage knows of a listed file when it resolves it, and a seam to read it.

    `read(fn)` opens the stored file, returns `fn(file)` and closes it; transient errors are
    retried by storage. `listed` is the entry of a streamds manifest beside the file that
    names it, with that manifest's format: (Format, `manifest.ShardEntry`), else None.
    `read_exact(start, end)`: stored bytes [start, end) in one ranged read, nothing read
    ahead (None where the file is read as one stream); `local`: the file is on this machine
    (reading all of it is a disk read, not a download).
    """

    name: str  # the base name, a URL's query cut off
    url: str  # as messages name it (credentials redacted)
    size: int | None
    codec: str | None
    on_error: str  # the dataset's policy: "raise" or "skip"
    read: Callable[[Callable[[BinaryIO], Any], str], Any]  # (fn, what) -> fn(stored file)
    listed: tuple[Format, Any] | None = None
    read_exact: Callable[[int, int], bytes] | None = None
    local: bool = False


@dataclass(frozen=True)
class Settled:
    """A file's format once resolved, and what it read for planning (kept on the `Shard`)."""

    format: Format
    frames: tuple | None = None  # seekable zstd frames
    frame_records: tuple[int, ...] | None = None  # records per frame, from a manifest
    checksum: str | None = None  # the manifest's digest of the stored file
    layout: Any = None  # anything else a format reads to cut blocks (row groups ...)


class Format:
    """One shard format. Subclasses set the class attributes and override what differs;
    `streamds.formats.registry` states what each member means."""

    name: str = ""
    suffixes: tuple[str, ...] = ()  # file names (codec suffix cut, lower case) it claims
    summary: str = ""  # one line for `streamds inspect`
    codec: str | None = None  # the codec every file of the format has (None: any or none)
    parses: bool = True  # records are JSON text for the parse stage (False: Python values)
    splits: bool = False  # a file may be cut into several blocks
    line_positions: bool = False  # records are the decoded bytes' lines, at byte offsets
    # a file's neighbouring blocks share decoding (a Parquet row group cut into row ranges):
    # the plan keeps a unit's blocks together, in file order, and deals in runs
    # (`storage.plan.decode_units`)
    shared_decoding: bool = False

    # -- resolving ---------------------------------------------------------------------

    def settle(self, facts: FileFacts) -> Settled:
        """The format this file is read in and what planning needs of it. The default: this
        format, nothing read."""
        return Settled(self)

    def check(self, shard: Any) -> None:
        """Refuse a shard whose fields contradict the format (ValueError)."""

    # -- planning ----------------------------------------------------------------------

    def split_size(self, shard: Any) -> int:
        """Units of `shard` the plan may cut into blocks (0: read whole)."""
        return 0

    def blocks(self, index: int, shard: Any, piece: Piece) -> list[Block]:
        """The blocks of shard number `index`, in order, tiling it."""
        return [Block(index)]

    def decode_unit(self, shard: Any, block: Block) -> int | None:
        """Which unit of its file `block` decodes whole (a row group), for formats with
        `shared_decoding`; None: the block alone."""
        return None

    def listed_records(self, shard: Any, block: Block) -> int | None:
        """Records of `block` known without reading (a manifest, a footer), else None."""
        return None

    def read_range(self, shard: Any, start: int, end: int | None, *, at_line: bool
                   ) -> tuple[int, int | None]:
        """Decoded bytes [first, end) a reader reads for a block from position `start` (a
        resume point where `at_line`), so read-ahead can fetch their stored bytes. The
        default: the whole file."""
        return 0, None

    # -- reading -----------------------------------------------------------------------

    def read_block(self, opener: Opener, shard: Any, block: Block, block_id: int,
                   cursor: Cursor, read_size: int) -> Iterator[LineChunk]:
        """Chunks of the records `block` owns, from `cursor.next_line` (None: its start),
        moving the cursor past each chunk before yielding it."""
        raise NotImplementedError(f"format {self.name!r} does not read blocks")

    def place(self, url: str, position: int) -> str | None:
        """Where the record at `position` is, in words; None where the position is a byte
        offset at which a line begins (the caller counts the line number)."""
        return f"{url}: record {position + 1} of the file"

    # -- identity ----------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"<format {self.name}>"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self) -> str:
        # a format pickles as its module's FORMAT: one object per process, compared by `is`
        return "FORMAT"
