"""Plan: split shards into blocks, order them per epoch and assign each reader a run of them.

A block reads to whole records on its own: a line-aligned byte range of a plain file, a run of
frames of a seekable zstd file, or a whole file; each shard's format cuts its file
(`Format.blocks`, `streamds.formats.registry`). Blocks are numbered in corpus order, and the
numbering depends on the corpus alone, never on the world, so a position (block, offset)
means the same thing to every reader and to any later world. All functions here are pure.

How fine the cut is: blocks of 64 KiB to `block_size`, and a file of up to
SPLITS_PER_FILE * block_size bytes gets SPLITS_PER_FILE blocks. Under even ranks (`fine=True`)
a corpus too small for SMALL_CORPUS_BLOCKS blocks of 64 KiB is cut into about
SMALL_CORPUS_BLOCKS equal pieces instead (MIN_SMALL_BLOCK bytes at least): ranks own whole
blocks, so a rank's share can only be as even as the blocks are small. The number of readers
is not known when the blocks are cut, and cutting per world would give one position a
different meaning in each world, so the finer cut depends on the corpus alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..formats.protocol import Block
from ..seeds import rng_for
from ..world import World
from .shards import Shard

# decode units as a plan holds them: (blocks per unit, units in a row) pairs; None: none
Units = tuple[tuple[int, int], ...] | None

__all__ = [
    "DEFAULT_BLOCK_SIZE", "Block", "Plan", "Units", "assign", "deal_position", "decode_units",
    "epoch_order", "make_blocks", "reader_at", "run_bounds", "small_corpus_piece",
    "unit_lengths",
]

DEFAULT_BLOCK_SIZE = 8 << 20  # decoded bytes per block of a large file
MIN_BLOCK_SIZE = 64 << 10  # never split finer than this
SPLITS_PER_FILE = 64  # a file smaller than SPLITS_PER_FILE blocks still gets this many readers
SMALL_CORPUS_BLOCKS = 1024  # fine=True: a corpus under this many 64 KiB blocks gets this many
MIN_SMALL_BLOCK = 1 << 10  # ... of at least this many bytes


def _splittable_size(shard: Shard) -> int:
    """Decoded bytes of a shard that can be cut into blocks (0: it is read whole)."""
    if not shard.ranged:  # a server without Range: read whole, as one stream
        return 0
    return shard.format.split_size(shard)


def small_corpus_piece(shards: Sequence[Shard]) -> int | None:
    """Bytes per block of a corpus too small for SMALL_CORPUS_BLOCKS blocks of MIN_BLOCK_SIZE
    (cut with fine=True), else None: each file is cut by its own size."""
    total = sum(_splittable_size(shard) for shard in shards)
    if total >= SMALL_CORPUS_BLOCKS * MIN_BLOCK_SIZE:
        return None
    return max(MIN_SMALL_BLOCK, math.ceil(total / SMALL_CORPUS_BLOCKS))


def _piece_size(decoded_size: int, block_size: int, small: int | None) -> int:
    if small is not None:
        return small
    return min(block_size, max(MIN_BLOCK_SIZE, math.ceil(decoded_size / SPLITS_PER_FILE)))


def make_blocks(
    shards: Sequence[Shard], block_size: int = DEFAULT_BLOCK_SIZE, *, fine: bool = False
) -> list[Block]:
    """The corpus's blocks in corpus order. Costs nothing beyond the shard metadata.

    `fine`: cut a small corpus into about SMALL_CORPUS_BLOCKS blocks (see the module).
    """
    small = small_corpus_piece(shards) if fine else None

    def piece(size: int) -> int:  # the target block size of a file of `size` units
        return _piece_size(size, block_size, small)

    blocks: list[Block] = []
    for index, shard in enumerate(shards):
        if not shard.ranged:  # a server without Range: the file is read whole, as one stream
            blocks.append(Block(index))
        else:
            blocks.extend(shard.format.blocks(index, shard, piece))  # its format cuts the file
    return blocks


def epoch_order(num_blocks: int, *, seed: int, epoch: int, shuffle: bool,
                units: Units = None) -> list[int]:
    """Block ids in the order this epoch reads them: corpus order, or shuffled by (seed, epoch).

    With `units` (blocks that decode one unit, such as a Parquet row group, are neighbours
    in corpus order: `decode_units`) a shuffle orders the units and keeps each unit's blocks
    together and in file order: a reader owning them decodes the unit once, forward (a
    Parquet row group has no row seek: a block decodes the rows before it, so blocks taken
    out of order, or scattered, made it decode the unit again for each). The shuffle buffer
    mixes the records across units."""
    if not shuffle:
        return list(range(num_blocks))
    rng = rng_for("blocks", seed, epoch)
    if units is None:
        order = list(range(num_blocks))
        rng.shuffle(order)
        return order
    spans = []
    first = 0
    for length in unit_lengths(units):
        spans.append(list(range(first, first + length)))
        first += length
    rng.shuffle(spans)
    return [block for span in spans for block in span]


def unit_lengths(units: Units) -> list[int]:
    """Blocks per unit, in corpus order, from `units` as a plan holds them: [length, repeat]
    pairs (a corpus of equal row groups is one pair)."""
    return [length for length, repeat in units or () for _ in range(repeat)]


def decode_units(shards: Sequence[Shard], blocks: Sequence[Block]) -> Units:
    """The corpus's decode units as [length, repeat] pairs (`epoch_order`): neighbouring blocks
    of one shard that its format says decode one unit (`Format.decode_unit`) form one; None
    where no format shares decoding (the blocks are dealt in turn, one by one)."""
    if not any(shard.format.shared_decoding for shard in shards):
        return None
    pairs: list[list[int]] = []
    last: tuple[int, Any] | None = None
    length = 0
    for block in blocks:
        unit = shards[block.shard].format.decode_unit(shards[block.shard], block)
        key = (block.shard, unit)
        if unit is not None and key == last:
            length += 1
            continue
        if length:
            _add_length(pairs, length)
        last, length = key, 1
    if length:
        _add_length(pairs, length)
    return tuple((length, repeat) for length, repeat in pairs)


def _add_length(pairs: list[list[int]], length: int) -> None:
    if pairs and pairs[-1][0] == length:
        pairs[-1][1] += 1
    else:
        pairs.append([length, 1])


def deal_position(world: World) -> int:
    """Where this reader's run comes in the epoch's order: worker-major (worker 0 of every
    rank, then worker 1 of every rank, ...), so that every rank owns a block as soon as there
    are as many blocks as ranks (a rank without blocks stalls a DDP job)."""
    return world.worker * world.world_size + world.rank


def reader_at(position: int, world: World) -> int:
    """The `World.reader` index of the reader whose run is `position` (`deal_position`)."""
    return (position % world.world_size) * world.num_workers + position // world.world_size


def run_bounds(num_blocks: int, readers: int, position: int) -> tuple[int, int]:
    """[start, stop) of the run of the epoch's order owned by the reader at `position`.

    The order is cut into `readers` contiguous runs whose lengths differ by at most one, the
    longer runs first; with fewer blocks than readers the runs from `num_blocks` on are
    empty. Parquet corpora are dealt so (`assign`): the row ranges of one row group are
    neighbours in corpus order, and a reader owning them all decodes the row group once,
    where a deal in turn made every reader decode it (a row group has no row seek).
    """
    base, longer = divmod(num_blocks, readers)
    start = position * base + min(position, longer)
    return start, start + base + (position < longer)


def assign(order: Sequence[int], world: World, runs: bool = False) -> list[int]:
    """The block ids this reader owns, from its place in the deal (`deal_position`): every
    `readers`-th block of `order` (in turn), or with `runs` its contiguous run of `order`
    (`run_bounds`).

    In turn is the default: the readers' record counts then even out wherever record sizes
    drift along a corpus (small records first, long ones later), which even ranks need.
    Runs are for formats whose neighbouring blocks share decoding (`Format.shared_decoding`).
    Either way every block goes to exactly one reader of the world, also when there are fewer
    blocks than readers (then some readers get none: workers past the first of a rank first).
    """
    if not runs:
        return list(order[deal_position(world) :: world.readers])
    start, stop = run_bounds(len(order), world.readers, deal_position(world))
    return list(order[start:stop])


@functools.lru_cache(maxsize=8)
def _cached_order(num_blocks: int, seed: int, epoch: int, shuffle: bool, units: Units
                  ) -> tuple[int, ...]:
    return tuple(epoch_order(num_blocks, seed=seed, epoch=epoch, shuffle=shuffle, units=units))


@dataclass(frozen=True)
class Plan:
    """The corpus's blocks and how an epoch orders and deals them: a pure description.

    `order(epoch)` is computed once per epoch and process; `work(epoch, world)` is one
    reader's share; `reader_records` sums block record counts for every reader in one pass.
    """

    num_blocks: int
    seed: int
    shuffle: bool
    # decode units (`decode_units`): where given, a shuffle keeps each unit's blocks together
    # and each reader owns a contiguous run of the order, not every readers-th block
    units: Units = None

    @property
    def runs(self) -> bool:
        return self.units is not None

    def described(self) -> tuple[int, int, bool, list[list[int]] | None]:
        """The plan as a state holds it (`ReaderState.plan`; `Plan.of` reads it back)."""
        units = None if self.units is None else [list(pair) for pair in self.units]
        return (self.num_blocks, self.seed, self.shuffle, units)

    @classmethod
    def of(cls, described: Sequence[Any]) -> Plan:
        """The plan a state describes (`described`)."""
        num_blocks, seed, shuffle, units = described
        return cls(num_blocks, seed, shuffle,
                   None if units is None else tuple((length, repeat) for length, repeat in units))

    def order(self, epoch: int) -> tuple[int, ...]:
        return _cached_order(self.num_blocks, self.seed, epoch, self.shuffle, self.units)

    def work(self, epoch: int, world: World) -> list[tuple[int, int | None]]:
        """(block id, None) items of one reader, in reading order."""
        return [(block, None) for block in assign(self.order(epoch), world, self.runs)]

    def reader_records(self, epoch: int, world: World, block_counts: Sequence[int]) -> list[int]:
        """Records every reader of `world`'s size owns this epoch, indexed by `World.reader`."""
        totals = [0] * world.readers
        order = self.order(epoch)
        if not self.runs:
            for index, block in enumerate(order):
                totals[reader_at(index % world.readers, world)] += block_counts[block]
            return totals
        for position in range(world.readers):
            start, stop = run_bounds(len(order), world.readers, position)
            totals[reader_at(position, world)] = sum(block_counts[b] for b in order[start:stop])
        return totals
