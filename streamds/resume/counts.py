"""Record counts per block, for even ranks and for resuming a plain DataLoader.

Shards converted by `streamds convert` list records per frame in their manifest, so their
counts cost nothing. Other blocks are counted in one pass that splits lines exactly as the
reader does (a line is a record unless it is blank); it reads the data once and never
parses JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..stages.parse import cut_bom
from ..storage.plan import Block
from ..storage.read import Opener, open_decoded_at, read_lines
from ..storage.shards import Shard

__all__ = ["count_block_records", "count_from", "listed_counts"]


def count_from(
    shard: Shard, block: Block, block_id: int, start: int | None, opener: Opener = open_decoded_at
) -> int:
    """Records (non-blank lines) of `block` from the line at `start` on (None: all)."""
    total = 0
    for chunk in read_lines(shard, block, block_id, resume_at=start, opener=opener):
        if chunk.parsed:  # rows of a Parquet or Arrow file: every one a record
            total += len(chunk.lines)
            continue
        lines = cut_bom(chunk.lines, chunk.offsets, chunk.labels)
        total += sum(1 for line in lines if line.strip())
    return total


def _manifest_count(shard: Shard, block: Block) -> int | None:
    """Records of a frame-run block from the manifest's records per frame, if listed."""
    if shard.layout is not None:  # Parquet, Arrow: the footer's row counts
        return (block.end or block.start) - block.start
    if shard.frames is None or shard.frame_records is None:
        return None
    if len(shard.frame_records) != len(shard.frames):
        return None
    end = math.inf if block.end is None else block.end
    return sum(
        records
        for frame, records in zip(shard.frames, shard.frame_records, strict=True)
        if block.start <= frame.decompressed_offset < end
    )


def count_block_records(
    shards: Sequence[Shard], blocks: Sequence[Block], opener: Opener = open_decoded_at
) -> list[int]:
    """Records of every block, in block order."""
    counts = []
    for block_id, block in enumerate(blocks):
        shard = shards[block.shard]
        listed = _manifest_count(shard, block)
        counts.append(
            listed if listed is not None else count_from(shard, block, block_id, None, opener)
        )
    return counts


def listed_counts(shards: Sequence[Shard], blocks: Sequence[Block]) -> list[int] | None:
    """Records of every block from the manifests alone (nothing read), or None where a block's
    shard lists no records per frame."""
    counts = []
    for block in blocks:
        listed = _manifest_count(shards[block.shard], block)
        if listed is None:
            return None
        counts.append(listed)
    return counts
