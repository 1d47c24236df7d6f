"""Record counts per block, for even ranks and for resuming a plain DataLoader.

Counts come from one pass that splits lines exactly as the reader does (a line is a record
unless it is blank). The pass reads the data once; it never parses JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan import Block
from .read import Opener, open_decoded_at, read_lines
from .shards import Shard

__all__ = ["count_block_records", "count_from"]


def count_from(
    shard: Shard, block: Block, block_id: int, start: int | None, opener: Opener = open_decoded_at
) -> int:
    """Records (non-blank lines) of `block` from the line at `start` on (None: all)."""
    total = 0
    for chunk in read_lines(shard, block, block_id, resume_at=start, opener=opener):
        total += sum(1 for line in chunk.lines if line.strip())
    return total


def count_block_records(
    shards: Sequence[Shard], blocks: Sequence[Block], opener: Opener = open_decoded_at
) -> list[int]:
    """Records of every block, in block order."""
    return [
        count_from(shards[block.shard], block, block_id, None, opener)
        for block_id, block in enumerate(blocks)
    ]
