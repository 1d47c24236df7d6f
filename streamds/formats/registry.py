"""The shard formats streamds reads, by name and by file name.

Each format is one module of `streamds.formats` with a module-level ``FORMAT``, an instance of
a `protocol.Format` subclass, registered here with one line. Nothing outside `formats/`
compares a format's name (`tests/test_formats_registry.py` fails if it does): storage, the
stages and the tools ask the format object. A `Shard` holds its format object; states,
fingerprints and manifests store its `name`, and a format pickles as its module's ``FORMAT``.

The protocol (defaults in `protocol.Format`):

- ``name``: the stable name kept in states and manifests ("jsonl", "jsonl.zst", ...);
  ``suffixes``: the file names it claims (codec suffix cut, lower case), ``codec``: the one
  codec its files have (None: any); ``summary``: a line for ``streamds inspect``.
- ``parses``: records are JSON text that the parse stage turns into values (False: the
  reader yields Python values already, as a columnar format does; nothing is parsed and
  every item is a record).
- ``splits``: a file may be cut into several blocks; ``line_positions``: records are the
  lines of the decoded bytes and a position is the byte offset where a line begins (so line
  numbers can be counted, the first lines sampled, and lines handed to the main process to
  parse); otherwise a position is whatever the format says, usually a record ordinal.
- ``settle(facts)`` -> `Settled`: when storage resolves a file: the format it is read in
  (a ``.zst`` without a seek table is plain JSON lines, a large ``.json`` of lines is JSON
  lines) and what planning needs (frames, records per frame, a checksum, or any ``layout``
  such as row groups). `FileFacts.read(fn, what)` is the seam to the stored bytes.
  ``check(shard)`` refuses a shard whose fields contradict the format.
- ``split_size(shard)``: units the plan may cut (0: read whole); ``blocks(index, shard,
  piece)``: the `Block`s tiling the file, where ``piece(size)`` is the plan's target block
  size. A block's ``start``/``end`` are positions in the format's own units: decoded bytes,
  or record ordinals (a row group's rows [first_row, end_row)); the plan never looks inside.
- ``listed_records(shard, block)``: records of a block known without reading (a manifest,
  a footer), else None: the block is counted by reading it.
- ``read_range(shard, start, end, at_line=)``: the decoded bytes a reader reads for a block
  from position ``start``, so read-ahead fetches them (the default: the whole file).
- ``read_block(opener, shard, block, block_id, cursor, read_size)``: `LineChunk`s of the
  records the block owns, from ``cursor.next_line`` (a position inside the block: a line's
  byte offset, a record index); the reader moves the cursor past each chunk before it yields
  it, so a retry or a resume restarts exactly there. ``opener(shard, offset, end)`` is
  storage's seam: the decoded bytes from ``offset`` (ranges, retries, read-ahead, cache).
- ``place(url, position)``: a position in words for messages (None: a line's byte offset,
  whose line number the caller counts).

Adding a format is one module beside this one, its name in the import below and one
`register` line at the bottom (`docs/architecture.md`, "How to add a format").
"""

from __future__ import annotations

from . import arrow, json_file, jsonl, jsonl_zst, parquet, tar
from .codecs import strip_codec
from .filenames import format_of
from .protocol import Format

__all__ = ["formats", "named", "of_file", "register"]

_BY_NAME: dict[str, Format] = {}
_DEFAULT_SUFFIX = ".jsonl"  # a file of any other name is JSON lines


def register(fmt: Format) -> Format:
    """Add `fmt`; a second format of the same name, or claiming a suffix and codec another
    format claims, is refused (ValueError)."""
    if not fmt.name:
        raise ValueError(f"{type(fmt).__name__} has no name; set the class attribute `name`")
    if fmt.name in _BY_NAME:
        raise ValueError(f"Duplicate format registration: {fmt.name!r} ({type(fmt).__name__} "
                         f"and {type(_BY_NAME[fmt.name]).__name__})")
    for other in _BY_NAME.values():
        shared = set(fmt.suffixes) & set(other.suffixes)
        if shared and fmt.codec == other.codec:
            raise ValueError(f"Duplicate format registration: {fmt.name!r} and {other.name!r} "
                             f"both claim {sorted(shared)} with codec {fmt.codec!r}")
    _BY_NAME[fmt.name] = fmt
    return fmt


def named(name: str) -> Format:
    """The format called `name` (ValueError naming the known ones otherwise)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown shard format {name!r}; streamds reads "
                         f"{', '.join(map(repr, _BY_NAME))}") from None


def formats() -> tuple[Format, ...]:
    """Every registered format, in registration order."""
    return tuple(_BY_NAME.values())


def of_file(name: str) -> tuple[Format, str | None]:
    """(format, codec) the file name `name` says, before the file is read (`Format.settle`
    may still change the format): the format claiming its longest suffix, one claiming its
    codec before one for any codec; a name no format claims is JSON lines.

    >>> [(f.name, c) for f, c in map(of_file, ["a.jsonl", "b.jsonl.zst", "c.tgz", "d.json"])]
    [('jsonl', None), ('jsonl.zst', 'zst'), ('tar', 'gz'), ('json', None)]
    """
    codec = format_of(name)[1]
    lowered, base = name.lower(), strip_codec(name).lower()

    def claim(fmt: Format, text: str) -> int:
        suffix = max((s for s in fmt.suffixes if text.endswith(s)), key=len, default="")
        return len(suffix) if fmt.codec in (None, codec) else 0

    for text in (base, lowered, base + _DEFAULT_SUFFIX):
        found = max(formats(), key=lambda fmt: (claim(fmt, text), fmt.codec == codec))
        if claim(found, text):
            return found, codec
    raise ValueError(f"no format claims {_DEFAULT_SUFFIX!r}")  # pragma: no cover


# -- the formats: one line each ----------------------------------------------------------
register(jsonl.FORMAT)  # JSON lines, plain or compressed: byte ranges
register(jsonl_zst.FORMAT)  # seekable zstd JSON lines: runs of frames
register(json_file.FORMAT)  # a .json file read whole: a document or JSON lines
register(tar.FORMAT)  # tar shards of JSON members (webdataset)
register(parquet.FORMAT)  # Parquet: row ranges of row groups, rows as Python values
register(arrow.FORMAT)  # Arrow IPC, stream and file format: row ranges of record batches
