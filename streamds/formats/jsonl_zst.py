"""Seekable zstd JSON lines (``.jsonl.zst`` with a seek table, as `streamds convert` writes).

Blocks: runs of whole frames (`streamds.formats.seekable`), each decoded from its first frame
without reading the frames before it. Positions are byte offsets in the decoded bytes, as in
plain JSON lines. The frames come from the manifest beside the file when it lists them
(records per frame too, so counts cost nothing), else from the file's seek table; a ``.zst``
without a seek table is plain `jsonl`, read whole.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ..errors import CorruptShardError
from .jsonl import FORMAT as JSONL
from .jsonl import Jsonl
from .protocol import Block, FileFacts, Piece, Settled
from .seekable import SeekTableError, read_seek_table

__all__ = ["FORMAT", "SeekableJsonl", "frame_runs"]

log = logging.getLogger(__name__)


def frame_runs(index: int, shard: Any, piece: Piece) -> list[Block]:
    """Blocks of whole frames, each at least `piece(decoded size)` bytes (the last runs to
    the end of the shard)."""
    frames = shard.frames or ()
    if not frames:
        return [Block(index, 0, None)]
    step = piece(shard.decoded_size or 0)
    blocks: list[Block] = []
    run_start = frames[0].decompressed_offset
    for frame in frames:
        frame_end = frame.decompressed_offset + frame.decompressed_size
        if frame_end - run_start >= step:
            blocks.append(Block(index, run_start, frame_end))
            run_start = frame_end
    if run_start < frames[-1].decompressed_offset + frames[-1].decompressed_size or not blocks:
        blocks.append(Block(index, run_start, None))
    else:  # the last run ended exactly at a piece boundary: let it run to the end
        last = blocks.pop()
        blocks.append(Block(index, last.start, None))
    return blocks


class SeekableJsonl(Jsonl):
    """JSON lines in independent zstd frames with a seek table: split by runs of frames."""

    name = "jsonl.zst"
    suffixes = Jsonl.suffixes
    summary = "seekable zstd: frames of whole lines + seek table"
    codec = "zst"

    def settle(self, facts: FileFacts) -> Settled:
        """The manifest's frames when it lists this file at its size, else the seek table's
        (read, retried); no table: plain `jsonl`. A damaged table raises CorruptShardError,
        or under on_error="skip" the file is read as a plain zstd stream."""
        if facts.listed is not None and facts.listed[0] is self:
            entry = facts.listed[1]
            if entry.bytes == facts.size:
                return Settled(self, entry.seek_frames(), tuple(entry.records_per_frame) or None,
                               entry.checksum)
        if facts.size is None:
            return Settled(JSONL)
        size = facts.size
        try:
            frames = facts.read(lambda raw: read_seek_table(raw, size, name=facts.url),
                                "seek table")
        except SeekTableError as err:
            if facts.on_error == "skip":
                log.warning("%s; reading it as a plain zstd stream", err)
                return Settled(JSONL)
            raise CorruptShardError(
                f"{facts.url}: damaged seek table ({err}); convert the file again, or pass "
                "on_error='skip' to read it as a plain zstd stream",
                url=facts.url,
                offset=size,
            ) from err
        return Settled(JSONL) if frames is None else Settled(self, tuple(frames))

    def check(self, shard: Any) -> None:
        if shard.frames is None:
            raise ValueError(
                f"{shard.url}: a 'jsonl.zst' shard needs its frames (the seek table); a .zst "
                "file without them is format 'jsonl'"
            )

    def split_size(self, shard: Any) -> int:
        return (shard.decoded_size or 0) if shard.frames else 0

    def blocks(self, index: int, shard: Any, piece: Piece) -> list[Block]:
        return frame_runs(index, shard, piece)

    def listed_records(self, shard: Any, block: Block) -> int | None:
        """Records of a run of frames from the manifest's records per frame, if listed."""
        if shard.frame_records is None or len(shard.frame_records) != len(shard.frames):
            return None
        end = math.inf if block.end is None else block.end
        return sum(
            records
            for frame, records in zip(shard.frames, shard.frame_records, strict=True)
            if block.start <= frame.decompressed_offset < end
        )


FORMAT = SeekableJsonl()
