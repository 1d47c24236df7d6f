"""JSON documents and JSON lines: one rule, decided per file, for the reader and the converter.

A file named ``*.json`` (plain or compressed) is read as one JSON *document* when the first
line of its text (after a byte-order mark and blank space) does not hold a whole JSON value,
because the document spans lines as ``json.dump(obj, f, indent=2)`` writes it, or when that
line is all the file holds; a document that is an array yields its elements, in order, and
any other document is one record. Every other file is JSON lines: a ``*.json`` file of
several values, one per line (what ``datasets.Dataset.to_json`` writes), and a file of any
other name, whatever it holds.

The rule looks only at the start of a file (up to the end of its first line and the next
non-blank byte), so deciding costs one short read. `streamds.storage.shards` decides for large plain
files when it resolves them (a file of JSON lines then splits into blocks like any other) and
`streamds.storage.read` decides for the rest when it reads them; `preprocess.sources` decides the
same way for the converter.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from . import values
from .codecs import strip_codec

__all__ = [
    "BOM",
    "DOCUMENT",
    "LINES",
    "PROBE_SIZE",
    "RESOLVE_ABOVE",
    "document_records",
    "is_document_name",
    "layout",
    "probe",
]

DOCUMENT = "document"  # the file is one JSON value (an array: its elements)
LINES = "lines"  # the file is JSON lines
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark some editors put at the start of a file
PROBE_SIZE = 64 << 10  # bytes per read while deciding
RESOLVE_ABOVE = 64 << 10  # plain .json files above this size are decided when resolved, so a
# file of JSON lines splits into blocks (streamds.storage.plan never splits below 64 KiB:
# the two agree)
_BLANK = b" \t\r\n"


def is_document_name(name: str) -> bool:
    """Whether the file `name` may hold a JSON document: ``.json``, plain or compressed.

    >>> [is_document_name(n) for n in ("a.json", "a.json.gz", "a.jsonl", "a.json.txt")]
    [True, True, False, False]
    """
    return strip_codec(name).lower().endswith(".json")


def _first_value(line: bytes) -> str:
    """Whether `line` holds one whole JSON value ("whole"), the start of one that goes on
    ("partial"), or neither ("invalid")."""
    try:
        values.loads(line)
    except orjson.JSONDecodeError as err:
        text = line.decode("utf-8", "replace").rstrip()
        return "partial" if err.pos >= len(text) else "invalid"
    return "whole"


def layout(head: bytes, *, at_end: bool) -> str | None:
    """DOCUMENT or LINES for a ``.json`` file whose decoded bytes begin with `head` (are all
    of `head` when `at_end`); None when the answer needs more bytes.

    A blank file is LINES (no records, no error), and so is one whose first line is not JSON
    at all (the reader then names that line).

    >>> layout(b'{\\n  "a": 1\\n}\\n', at_end=True), layout(b'{"a": 1}\\n{"a": 2}\\n', at_end=True)
    ('document', 'lines')
    >>> layout(b'[{"a": 1}, {"a": 2}]', at_end=True), layout(b'{"a": 1}\\n', at_end=False)
    ('document', None)
    """
    text = head[len(BOM) :] if head.startswith(BOM) else head
    start = len(text) - len(text.lstrip(_BLANK))
    if start == len(text):
        return LINES if at_end else None
    newline = text.find(b"\n", start)
    if newline < 0:
        return DOCUMENT if at_end else None  # one line so far: maybe all the file holds
    first = _first_value(text[start:newline])
    if first == "partial":
        return DOCUMENT
    if first == "invalid":
        return LINES
    if text[newline + 1 :].strip(_BLANK):
        return LINES  # a second value on a later line
    return DOCUMENT if at_end else None


def probe(read: Callable[[int], bytes]) -> tuple[str, bytes]:
    """The layout of a ``.json`` file read with `read(size)` from its start, and the bytes
    read to decide it (the caller goes on from there, or reopens)."""
    head = b""
    while True:
        data = read(max(PROBE_SIZE, len(head)))  # doubling: a long first line costs O(size)
        head += data
        found = layout(head, at_end=not data)
        if found is not None:
            return found, head


def document_records(data: bytes) -> tuple[list[bytes], bool]:
    """The raw records of a whole document, and whether it was an array: its elements, each
    as compact JSON that reads back to the same value (`streamds.formats.values`: big
    integers and lone surrogates kept), or the document itself (byte-order mark removed). A
    document that is not valid JSON comes back whole, for the parse step to report or skip
    as one record; so does one that is not an object or an array (the parse step refuses
    it as no record)."""
    if data.startswith(BOM):
        data = data[len(BOM) :]
    try:
        value = values.loads(data)
    except orjson.JSONDecodeError:
        return [data], False
    if isinstance(value, list):
        return [values.dumps(element) for element in value], True
    return [data], False
