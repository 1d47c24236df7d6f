"""A ``.json`` file read whole: one JSON document (an array: its elements) or JSON lines, by
the rule of `streamds.formats.documents`.

One block per file. A large plain ``.json`` file of JSON lines is decided when it is resolved
(one short read) and settles into `jsonl`, so it splits into byte ranges; every other
``.json`` file is decided when its block is read. Positions are byte offsets when the file
holds JSON lines, else record ordinals (0 for the document, i for an array's element i).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from typing import Any

from .documents import LINES, RESOLVE_ABOVE, document_records, probe
from .jsonl import FORMAT as JSONL
from .jsonl import line_chunks
from .protocol import Block, Cursor, FileFacts, Format, LineChunk, Opener, Settled

__all__ = ["FORMAT", "JsonFile"]

_DOCUMENT_CHUNK = 1024  # records per chunk of an array document


class JsonFile(Format):
    """A ``.json`` file: one block, a document's records or JSON lines."""

    name = "json"
    suffixes = (".json",)
    summary = "a JSON document or JSON lines, read whole"

    def settle(self, facts: FileFacts) -> Settled:
        if facts.codec is not None or facts.size is None or facts.size <= RESOLVE_ABOVE:
            return Settled(self)  # decided when read: resolving a tree opens none of them
        found = facts.read(lambda raw: probe(raw.read)[0], "first line")
        return Settled(JSONL if found == LINES else self)

    def read_block(self, opener: Opener, shard: Any, block: Block, block_id: int,
                   cursor: Cursor, read_size: int) -> Iterator[LineChunk]:
        with closing(opener(shard, 0)) as stream:
            found, head = probe(stream.read)
            if found != LINES:
                data = b"".join([head, *iter(lambda: stream.read(read_size), b"")])
        if found == LINES:
            yield from line_chunks(opener, shard, block, block_id, cursor, read_size)
            return
        records, is_array = document_records(data)
        label = "element of the JSON array" if is_array else "the JSON document"
        first = cursor.next_line or 0
        cursor.next_line = first
        for begin in range(first, len(records), _DOCUMENT_CHUNK):
            end = min(begin + _DOCUMENT_CHUNK, len(records))
            cursor.next_line = end
            yield LineChunk(
                block_id, list(range(begin, end + 1)), records[begin:end], [label] * (end - begin)
            )

    def place(self, url: str, position: int) -> str | None:
        return (f"{url}: position {position} (a byte offset if the file holds JSON lines, "
                "else the index of the document's element)")


FORMAT = JsonFile()
