"""Shuffle: a seeded buffer of records that yields them in random order.

The buffer fills with `size` records, then each incoming record replaces a random buffered
one, which is yielded; at the end of the stream the rest drain in random order. The state is
the buffered records' positions plus the generator state (O(size) small integers, never the
records): on resume the records are re-read from their positions.
"""

from __future__ import annotations

import random
import zlib
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from .stream import Position, RecordStream

__all__ = ["ShuffleBuffer", "pack_positions", "unpack_positions"]


def pack_positions(positions: Sequence[Position]) -> bytes:
    """Positions as compressed 32-bit block ids then 64-bit offsets (a few bytes each)."""
    blocks = array("I", (block for block, _ in positions))
    offsets = array("Q", (offset for _, offset in positions))
    return zlib.compress(blocks.tobytes() + offsets.tobytes(), 6)


def unpack_positions(packed: bytes) -> list[Position]:
    raw = zlib.decompress(packed)
    count = len(raw) // 12
    blocks, offsets = array("I"), array("Q")
    blocks.frombytes(raw[: 4 * count])
    offsets.frombytes(raw[4 * count :])
    return list(zip(blocks, offsets, strict=True))


class ShuffleBuffer:
    """Records of `source` in an order drawn from `rng_seed`.

    State: ``{"source": ..., "positions": packed, "rng": ..., "draining": bool}``, where
    `positions` is `pack_positions` of the buffered records' (block, offset) in slot order.
    """

    SOURCE = "source"
    POSITIONS = "positions"
    RNG = "rng"
    DRAINING = "draining"

    def __init__(self, source: RecordStream, *, size: int, rng_seed: int) -> None:
        if size < 1:
            raise ValueError(f"buffer size must be >= 1, got {size}")
        self._source = source
        self._size = size
        self._rng_seed = rng_seed
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        self._rng = random.Random(self._rng_seed)
        self._records: list[Any] = []
        self._positions: list[Position] = []
        self._draining = False
        if state is None:
            self._source.reset()
            return
        self._source.reset(state[self.SOURCE])
        self._positions = unpack_positions(state[self.POSITIONS])
        self._records = self._source.fetch(self._positions)
        version, internal, gauss = state[self.RNG]
        self._rng.setstate((version, tuple(internal), gauss))
        self._draining = state[self.DRAINING]

    def get_state(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {
            self.SOURCE: self._source.get_state(),
            self.POSITIONS: pack_positions(self._positions),
            self.RNG: [version, list(internal), gauss],
            self.DRAINING: self._draining,
        }

    @property
    def counts(self) -> dict[str, int]:
        return self._source.counts

    @property
    def quota(self) -> int | None:
        return self._source.quota

    def add_counts(self, counts: dict[str, int]) -> None:
        self._source.add_counts(counts)

    def prefill(self, positions: list[Position]) -> None:
        """Put the records at `positions` into the buffer (from another world's buffers)."""
        self._records.extend(self._source.fetch(positions))
        self._positions.extend(positions)

    def __iter__(self) -> Iterator[Any]:
        records, positions, size = self._records, self._positions, self._size
        random = self._rng.random  # int(random() * n): uniform enough, and C-fast
        if not self._draining:
            for position, record in self._source.with_positions():
                if len(records) < size:
                    records.append(record)
                    positions.append(position)
                    continue
                slot = int(random() * size)
                out = records[slot]
                records[slot], positions[slot] = record, position
                yield out
            self._draining = True
        while records:
            slot = int(random() * len(records))
            records[slot], records[-1] = records[-1], records[slot]
            positions[slot], positions[-1] = positions[-1], positions[slot]
            positions.pop()
            yield records.pop()
