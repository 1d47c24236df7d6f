"""Shuffle: chunks -> records in an order drawn from a seeded buffer.

The buffer fills with `size` records, then each incoming record replaces a random buffered
one, which is yielded; at the end of the stream the rest drain in random order.

Taking the state is O(1): the stage keeps a *snapshot* (the buffered records' positions,
packed, and where the source stood) that it renews every `size` records handed out, so the
cost of packing is spread over them; the state is that snapshot plus how many records were
handed out since. A resume rebuilds the buffer from the snapshot (re-reading its records)
and replays those few steps. Draws come from a generator seeded by (seed parts, round), where
a round is the span between two snapshots, so no generator state is kept either. With the
last record, a final snapshot stands at the end of the source (an empty buffer): the state
taken once the last record is out says the epoch is done and carries its exact counts.

The buffer holds what the stages below hand in: parsed records, with their positions. A
reader's map and filter steps run on records as they leave it (`streamds.stages.pipeline`),
except under even_ranks, so that filling it costs a read and a parse per record, never a map.
Filling that takes longer than `SLOW_FILL` seconds is logged once per process (INFO), with
why and what to do.

State: ``{"stage": "shuffle", "source": <position at the snapshot>, "positions": packed,
"round": r, "since": n, "draining": bool}``. Resumes computed elsewhere (elastic,
plain-loader) use the stage's operations on it: `source_of`, `snapshot_of` / `restarted` /
`since_of` (the buffer part without the source), `positions_of` / `moved`.
"""

from __future__ import annotations

import logging
import random
import time
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

from ..seeds import derive_seed
from .chunks import (
    SOURCE,
    STAGE,
    Below,
    Chunk,
    ChunkCursor,
    ChunkStage,
    Position,
    Rest,
    checked,
)
from .parse import Marker
from .records import PositionedBatch

__all__ = ["SLOW_FILL", "Shuffle", "pack_positions", "unpack_positions"]

log = logging.getLogger(__name__)

SLOW_FILL = 5.0  # seconds: a buffer fill (or re-fill on resume) slower than this is logged
_said = {"slow fill": False}  # the slow fill is logged once per process
MIN_ROUND = 1024  # records per round at least, so tiny buffers do not reseed every record


def pack_positions(blocks: Sequence[int], offsets: Sequence[int]) -> bytes:
    """Positions as compressed 64-bit block ids then 64-bit offsets (a few bytes each)."""
    return zlib.compress(array("q", blocks).tobytes() + array("q", offsets).tobytes(), 1)


def unpack_positions(packed: bytes) -> list[Position]:
    raw = zlib.decompress(packed)
    count = len(raw) // 16
    blocks, offsets = array("q"), array("q")
    blocks.frombytes(raw[: 8 * count])
    offsets.frombytes(raw[8 * count :])
    return list(zip(blocks, offsets, strict=True))


class Shuffle:
    """Stage: chunks -> records, shuffled through a buffer of `size` records.

    `fetch(positions)` re-reads the records at positions (used on resume and for `prefill`,
    records carried over from another world's buffers). `on_end` is called once when the
    last record has been handed out. With `tell`, `last_position` is the (block, offset) of
    the record handed out last (for the messages of the stage above). `fill_note` is added
    to the slow-fill log line (what else made the fill slow).
    """

    STAGE = "shuffle"
    SOURCE = SOURCE
    POSITIONS = "positions"
    ROUND = "round"
    SINCE = "since"
    DRAINING = "draining"

    # -- operations on a state, for resumes computed outside the stage --------------------

    @classmethod
    def source_of(cls, state: dict[str, Any]) -> dict[str, Any]:
        """The `ChunkCursor` position of the source at the state's snapshot."""
        return state[cls.SOURCE]

    @classmethod
    def unfinished(cls, state: dict[str, Any], below: Below) -> Rest:
        """What a reader whose buffer stands at `state` leaves: its source's stream from
        where it stood at the buffer's snapshot, and the snapshot (the records handed out
        since are replayed from it)."""
        return Rest(cls.source_of(state), snapshot=cls.snapshot_of(state))

    @classmethod
    def snapshot_of(cls, state: dict[str, Any]) -> dict[str, Any]:
        """The state without where its source stood: the buffer at the snapshot, its round,
        whether it drained, and the records handed out since (`since_of`)."""
        return {key: state[key] for key in (cls.POSITIONS, cls.ROUND, cls.DRAINING, cls.SINCE)}

    @classmethod
    def since_of(cls, state: dict[str, Any]) -> int:
        """Records handed out since the snapshot, of a state or a `snapshot_of`."""
        return int(state[cls.SINCE])

    @classmethod
    def restarted(cls, snapshot: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
        """The state with the buffer of `snapshot` (a `snapshot_of`), the source at position
        `source`, and no record handed out since (for replays from a snapshot)."""
        return {STAGE: cls.STAGE, **snapshot, cls.SOURCE: source, cls.SINCE: 0}

    @classmethod
    def positions_of(cls, state: dict[str, Any]) -> list[Position]:
        """The positions of the records buffered at the state's snapshot, in slot order."""
        return unpack_positions(state[cls.POSITIONS])

    @classmethod
    def moved(cls, state: dict[str, Any], *, positions: Sequence[Position],
              source: dict[str, Any]) -> dict[str, Any]:
        """The state with its buffered positions and its source's position replaced (a replay
        on record numbers, put where those records are)."""
        return {**state, cls.POSITIONS: pack_positions([block for block, _ in positions],
                                                       [offset for _, offset in positions]),
                cls.SOURCE: source}

    def __init__(
        self,
        source: ChunkStage,
        *,
        size: int,
        seed_parts: tuple[int | str, ...],
        fetch: Callable[[Sequence[Position]], list[Any]],
        prefill: Sequence[Position] = (),
        round_size: int | None = None,
        on_end: Callable[[], None] | None = None,
        tell: bool = False,
        fill_note: str = "",
    ) -> None:
        if size < 1:
            raise ValueError(f"buffer size must be >= 1, got {size}")
        self.cursor = ChunkCursor(source)
        self.size = size
        self.seed_parts = seed_parts
        self.fetch = fetch
        self.prefill = list(prefill)
        # records handed out per round (a smaller round_size only to test rounds)
        self.period = max(size, MIN_ROUND) if round_size is None else round_size
        self.on_end = on_end  # called once the last record has been handed out
        self.tell = tell
        self.last_position: Position = (-1, -1)  # kept with `tell`
        self.fill_note = fill_note
        self.reset()

    # -- state ---------------------------------------------------------------------------

    def reset(self, state: dict[str, Any] | None = None) -> None:
        if state is None:
            self.cursor.reset(None)
            positions = self.prefill
            self._round, self._draining, replay = 0, False, 0
        else:
            checked(state, self.STAGE)
            self.cursor.reset(state[self.SOURCE])
            positions = unpack_positions(state[self.POSITIONS])
            self._round, self._draining = state[self.ROUND], state[self.DRAINING]
            replay = state[self.SINCE]
        started = time.perf_counter()
        self._records: list[Any] = self.fetch(positions) if positions else []
        if positions:
            self._say_if_slow(started, f"re-reading the {len(positions):,} records the "
                              "shuffle buffer held, to resume")
        self._blocks = array("q", (block for block, _ in positions))
        self._offsets = array("q", (offset for _, offset in positions))
        self._since = 0
        self._replay = replay  # records to hand out again, unseen, to reach the state
        self.done = False  # the last record has been handed out
        self._snapshot = self._pack(
            state[self.SOURCE] if state is not None else self._start_position()
        )

    def _start_position(self) -> dict[str, Any]:
        return ChunkCursor.between(self.cursor.source.get_state())

    def _pack(self, source_position: dict[str, Any]) -> dict[str, Any]:
        """A snapshot: O(buffer), taken once per round."""
        return {STAGE: self.STAGE, self.SOURCE: source_position,
                self.POSITIONS: pack_positions(self._blocks, self._offsets),
                self.ROUND: self._round, self.DRAINING: self._draining}

    def get_state(self) -> dict[str, Any]:
        """O(1): the snapshot and the records handed out since."""
        return {**self._snapshot, self.SINCE: self._since + self._replay}

    @property
    def counts(self) -> dict[str, int]:
        return self.cursor.source.counts

    def buffered(self) -> list[Any]:
        """The records in the buffer now, in slot order (for replays on numbers)."""
        return list(self._records)

    # -- iteration -----------------------------------------------------------------------

    def _say_if_slow(self, started: float, doing: str) -> None:
        """Log once per process, at INFO, that filling the buffer is slow, and what to do."""
        elapsed = time.perf_counter() - started
        if elapsed < SLOW_FILL or _said["slow fill"]:
            return
        _said["slow fill"] = True
        log.info("%s: %.0f s so far; the buffer holds %s records per reader (buffer_size) "
                 "before its first record comes out; a smaller buffer_size gives a quicker "
                 "first batch%s", doing, elapsed, f"{self.size:,}", self.fill_note)

    def _filling(self, started: float) -> None:
        """Called per chunk while the buffer fills: says so once when it takes long."""
        if not _said["slow fill"]:
            self._say_if_slow(started, f"filling the shuffle buffer ({len(self._records):,} "
                              f"of {self.size:,} records read)")

    def _rng(self) -> Callable[[], float]:
        return random.Random(derive_seed("shuffle", *self.seed_parts, self._round)).random

    def _next_round(self, position: dict[str, Any]) -> Callable[[], float]:
        self._round += 1
        self._since = 0
        self._snapshot = self._pack(position)
        return self._rng()

    def __iter__(self) -> Iterator[Any]:
        out = self._shuffled()
        if self._replay:
            for _ in islice(out, self._replay):
                pass
            self._replay = 0
        return out

    def _shuffled(self) -> Iterator[Any]:
        records, blocks, offsets = self._records, self._blocks, self._offsets
        size, period, tell = self.size, self.period, self.tell
        random_ = self._rng()  # int(random_() * n): uniform enough, and C-fast
        if not self._draining:
            chunk: Chunk
            started = time.perf_counter()
            for chunk in self.cursor.chunks():
                if len(records) < size:
                    self._filling(started)
                block, at, clean = chunk.block, chunk.offsets, chunk.clean
                for index, record in enumerate(chunk.items):
                    if not clean and record.__class__ is Marker:
                        continue
                    if len(records) < size:
                        records.append(record)
                        blocks.append(block)
                        offsets.append(at[index])
                        continue
                    if self._since >= period:
                        random_ = self._next_round(self.cursor.position(chunk, index))
                    slot = int(random_() * size)
                    out = records[slot]
                    if tell:
                        self.last_position = (blocks[slot], offsets[slot])
                    records[slot] = record
                    blocks[slot] = block
                    offsets[slot] = at[index]
                    self._since += 1
                    yield out
            self._draining = True
        while records:
            random_, record, block, offset = self._drain_one(random_)
            self.last_position = (block, offset)
            yield record
        if not self.done:  # nothing was buffered at the end of the source
            self._finish()

    def batches(self, size: int) -> Iterator[list[Any]]:
        """The records in lists of `size` (the last may be short): the same records, draws
        and state after each list as `size` steps of iteration, without a step per record."""
        for records, _, _ in self._shuffled_lists(size, positions=False):
            yield records

    def batches_with_positions(self, size: int) -> Iterator[PositionedBatch]:
        """As `batches`, each list with the block id and offset of each record's line."""
        return self._shuffled_lists(size, positions=True)

    def _shuffled_lists(self, size: int, *, positions: bool) -> Iterator[PositionedBatch]:
        """`_shuffled`, the records gathered into lists (records to replay are left out)."""
        records, blocks, offsets = self._records, self._blocks, self._offsets
        capacity, period = self.size, self.period
        random_ = self._rng()
        skip = self._replay  # records handed out before the state this resumes from
        out: list[Any] = []
        out_blocks: list[int] = []
        out_offsets: list[int] = []
        if not self._draining:
            chunk: Chunk
            started = time.perf_counter()
            for chunk in self.cursor.chunks():
                if len(records) < capacity:
                    self._filling(started)
                block, at, clean = chunk.block, chunk.offsets, chunk.clean
                for index, record in enumerate(chunk.items):
                    if not clean and record.__class__ is Marker:
                        continue
                    if len(records) < capacity:
                        records.append(record)
                        blocks.append(block)
                        offsets.append(at[index])
                        continue
                    if self._since >= period:
                        random_ = self._next_round(self.cursor.position(chunk, index))
                    slot = int(random_() * capacity)
                    if skip:
                        skip -= 1
                        self._replay = skip
                    else:
                        out.append(records[slot])
                        if positions:
                            out_blocks.append(blocks[slot])
                            out_offsets.append(offsets[slot])
                    records[slot] = record
                    blocks[slot] = block
                    offsets[slot] = at[index]
                    self._since += 1
                    if len(out) == size:
                        yield out, out_blocks, out_offsets
                        out, out_blocks, out_offsets = [], [], []
            self._draining = True
        while records:
            random_, record, block, offset = self._drain_one(random_)
            if skip:
                skip -= 1
                self._replay = skip
                continue
            out.append(record)
            if positions:
                out_blocks.append(block)
                out_offsets.append(offset)
            if len(out) == size:
                yield out, out_blocks, out_offsets
                out, out_blocks, out_offsets = [], [], []
        self._replay = 0
        if not self.done:  # nothing was buffered at the end of the source
            self._finish()
        if out:
            yield out, out_blocks, out_offsets

    def _drain_one(self, random_: Callable[[], float]) -> tuple[Callable[[], float], Any, int, int]:
        """One draw once the source is spent: (the generator for the next draw, the record, its
        block id and offset); the last record's draw takes the final snapshot."""
        records, blocks, offsets = self._records, self._blocks, self._offsets
        if self._since >= self.period:
            random_ = self._next_round(self.cursor.position(None, 0))
        slot = int(random_() * len(records))
        last = len(records) - 1
        records[slot], records[last] = records[last], records[slot]
        blocks[slot], blocks[last] = blocks[last], blocks[slot]
        offsets[slot], offsets[last] = offsets[last], offsets[slot]
        block, offset = blocks.pop(), offsets.pop()
        self._since += 1
        record = records.pop()
        if not records:  # the last record: a state taken once it is out is the end
            self._finish()
        return random_, record, block, offset

    def give_back(self) -> None:
        """The record handed out last was not used (a step above raised on it): the state
        now stands before it, so a resume hands it out again (guarantee 12). Only the state
        changes; the iteration that raised is over."""
        if self.done:  # it was the last: back to the state before the final snapshot
            self._snapshot, self._since, self._round = self._before_finish
            self.done = False
        self._since -= 1

    def _finish(self) -> None:
        """A last snapshot, past every record (O(1): the buffer is empty), so the state at the
        end says "finished" and carries the epoch's exact counts."""
        self._before_finish = (self._snapshot, self._since, self._round)  # for `give_back`
        self._next_round(self.cursor.position(None, 0))
        self.done = True
        if self.on_end is not None:
            self.on_end()
