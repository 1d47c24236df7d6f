"""Plan: split shards into blocks, order them per epoch and assign them to readers.

A block decodes to whole lines on its own: a line-aligned byte range of a plain file, a run of
frames of a seekable zstd file, or a whole file. Blocks are numbered in corpus order, and the
numbering depends on the corpus alone, never on the world, so a position (block, offset)
means the same thing to every reader and to any later world. All functions here are pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .seeds import rng_for
from .shards import Shard
from .world import World

__all__ = ["DEFAULT_BLOCK_SIZE", "Block", "assign", "epoch_order", "make_blocks"]

DEFAULT_BLOCK_SIZE = 8 << 20  # decoded bytes per block of a large file
MIN_BLOCK_SIZE = 64 << 10  # never split finer than this
SPLITS_PER_FILE = 64  # a file smaller than SPLITS_PER_FILE blocks still gets this many readers


@dataclass(frozen=True)
class Block:
    """Decoded bytes [start, end) of one shard; it owns the lines that begin inside them.

    `end` is None for a block that runs to the end of its shard (compressed files without a
    seek table, tar files). For tar shards, offsets count records instead of bytes.
    """

    shard: int
    start: int = 0
    end: int | None = None


def _piece_size(decoded_size: int, block_size: int) -> int:
    return min(block_size, max(MIN_BLOCK_SIZE, math.ceil(decoded_size / SPLITS_PER_FILE)))


def _byte_ranges(index: int, size: int, block_size: int) -> list[Block]:
    if size == 0:
        return [Block(index, 0, None)]
    piece = _piece_size(size, block_size)
    starts = range(0, size, piece)
    return [Block(index, start, min(start + piece, size)) for start in starts[:-1]] + [
        Block(index, starts[-1], None)
    ]


def _frame_runs(index: int, shard: Shard, block_size: int) -> list[Block]:
    frames = shard.frames or ()
    if not frames:
        return [Block(index, 0, None)]
    piece = _piece_size(shard.decoded_size or 0, block_size)
    blocks: list[Block] = []
    run_start = frames[0].decompressed_offset
    for frame in frames:
        frame_end = frame.decompressed_offset + frame.decompressed_size
        if frame_end - run_start >= piece:
            blocks.append(Block(index, run_start, frame_end))
            run_start = frame_end
    if run_start < frames[-1].decompressed_offset + frames[-1].decompressed_size or not blocks:
        blocks.append(Block(index, run_start, None))
    else:  # the last run ended exactly at a piece boundary: let it run to the end
        last = blocks.pop()
        blocks.append(Block(index, last.start, None))
    return blocks


def make_blocks(shards: Sequence[Shard], block_size: int = DEFAULT_BLOCK_SIZE) -> list[Block]:
    """The corpus's blocks in corpus order. Costs nothing beyond the shard metadata."""
    blocks: list[Block] = []
    for index, shard in enumerate(shards):
        if shard.format == "tar":
            blocks.append(Block(index))
        elif shard.codec is None and shard.size is not None:
            blocks.extend(_byte_ranges(index, shard.size, block_size))
        elif shard.frames is not None:
            blocks.extend(_frame_runs(index, shard, block_size))
        else:
            blocks.append(Block(index))
    return blocks


def epoch_order(num_blocks: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Block ids in the order this epoch reads them: corpus order, or shuffled by (seed, epoch)."""
    order = list(range(num_blocks))
    if shuffle:
        rng_for("blocks", seed, epoch).shuffle(order)
    return order


def assign(order: Sequence[int], world: World) -> list[int]:
    """The block ids this reader owns: every `readers`-th block of `order`, from its index.

    Every block goes to exactly one reader of the world, also when there are fewer blocks
    than readers (then some readers get none).
    """
    return list(order[world.reader :: world.readers])
