"""Record counts per block, for even ranks and for resuming a plain DataLoader.

Where a shard's format knows a block's records without reading (`Format.listed_records`:
shards converted by `streamds convert` list records per frame in their manifest), counts
cost nothing. Other blocks are counted in one pass that splits lines exactly as the
reader does (a line is a record unless it is blank); it reads the data once and never
parses JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..stages.parse import cut_bom
from ..storage.plan import Block
from ..storage.read import Opener, open_decoded_at, read_lines
from ..storage.shards import Shard

__all__ = ["count_block_records", "count_from", "listed_counts"]


def count_from(
    shard: Shard, block: Block, block_id: int, start: int | None, opener: Opener = open_decoded_at
) -> int:
    """Records of `block` from the record at `start` on (None: all): its non-blank lines,
    or every item of a format whose records need no parsing."""
    total = 0
    for chunk in read_lines(shard, block, block_id, resume_at=start, opener=opener):
        if not shard.format.parses:
            total += len(chunk.lines)
            continue
        lines = cut_bom(chunk.lines, chunk.offsets, chunk.labels)
        total += sum(1 for line in lines if line.strip())
    return total


def count_block_records(
    shards: Sequence[Shard], blocks: Sequence[Block], opener: Opener = open_decoded_at
) -> list[int]:
    """Records of every block, in block order."""
    counts = []
    for block_id, block in enumerate(blocks):
        shard = shards[block.shard]
        listed = shard.format.listed_records(shard, block)
        counts.append(
            listed if listed is not None else count_from(shard, block, block_id, None, opener)
        )
    return counts


def listed_counts(shards: Sequence[Shard], blocks: Sequence[Block]) -> list[int] | None:
    """Records of every block from what the shards list (nothing read), or None where a
    block's format does not know its records (`Format.listed_records`)."""
    counts = []
    for block in blocks:
        shard = shards[block.shard]
        listed = shard.format.listed_records(shard, block)
        if listed is None:
            return None
        counts.append(listed)
    return counts
