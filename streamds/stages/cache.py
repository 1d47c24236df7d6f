"""Cache: the records the stages before `ds.cache(...)` made, stored per block and read back.

`BlockCache` is one reader's view of a `RecordStore` (`streamds.storage.records_cache`),
shared by the stages that fill and read it:

- `Lines` asks `open(block)` before reading a block. A stored block is not read or parsed:
  `pieces` hands its positions on in chunks of `Stored` placeholders (`PIECE` at most; blank
  and skipped lines as their markers), the same positions reading the source gives, so the
  shuffle buffer draws the same order and a state says the same as without the cache. A
  block not stored, started from its beginning, gets a writer (`begin`; one per block across
  the processes of the machine: a process that does not get it just computes) and, once
  read, its count (`finish`).
- Where the steps run before the buffer (no shuffle, or even_ranks), `Transform` resolves
  placeholders (`resolve`) and hands each computed chunk to `seen`, which stores its records,
  drops and lines without a record in order. Where they run after the buffer, `Transform`
  hands `seen` the parsed chunks (it counts them and stores the lines without a record),
  and `AfterBuffer` resolves placeholders and `put`s each record the steps made (or their
  drop) at its position as it leaves the buffer; the block completes when its last record
  has left.
- A resumed reader never sees the records handed out before its state, so a block it was
  filling does not complete; `close()` (at the epoch's end, or when the reader is dropped)
  gives up every open writer: a later epoch stores the block.

Counters are the same as without the cache: a stored block keeps its drops and its lines
without a record (blank, or malformed and skipped under on_error="skip") as entries, which
come back as the markers the parse and the steps made (only the first epoch logs the
malformed lines one by one).

A stored block that turns out damaged (`CachedBlockError`) is logged and its records are
computed from the source at the same positions.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import StateMismatchError
from ..storage.plan import Block
from ..storage.records_cache import (
    BAD_LINE,
    BLANK_LINE,
    BlockReader,
    BlockWriter,
    CachedBlockError,
    RecordStore,
    UncacheableRecordError,
    block_key,
    uncacheable,
)
from ..storage.records_cache import DROPPED as STORED_DROP
from ..storage.shards import Shard, stat_shard
from .chunks import Chunk, Position, Stored
from .parse import BAD, BLANK, DROPPED, LineNumbers, Marker

__all__ = ["PIECE", "BlockCache", "RecordsCache"]

log = logging.getLogger(__name__)

PIECE = 1024  # placeholders per chunk of a stored block (bounds what one chunk holds)


@dataclass(frozen=True)
class RecordsCache:
    """What `ds.cache(directory, key=...)` asked for: the store, each block's key (None: the
    block is read as without a cache) and how many of the dataset's steps run before it
    (their records are stored; the steps after run on the stored records).

    `keys` are made from the shards as listed when `.cache()` was called; a reader checks
    each shard it uses against its storage once per epoch (`shard_now`), since a file may
    change under a dataset that lives for many epochs. `shards`, `blocks`, `names` (the
    shards' names under the source root), `key` and `upstream` make the keys again.
    """

    store: RecordStore
    keys: tuple[str | None, ...]
    steps: int
    shards: tuple[Shard, ...]
    blocks: tuple[Block, ...]
    names: tuple[str, ...]
    key: str
    upstream: str

    def shard_now(self, index: int) -> Shard | None:
        """Shard `index` as its storage describes it now (one stat): itself where unchanged,
        a copy with the new version where only that changed and no checksum names its
        content (its blocks get new keys), None where its records cannot be told from
        stored ones (a new size, or a manifest checksum that may be stale): read it as
        without the cache. Logged once per process and file."""
        shard = self.shards[index]
        if uncacheable(shard) is not None:
            return shard  # no key to check
        try:
            size, version = stat_shard(shard)
        except OSError:
            return None  # reading it says what is wrong
        if (size, version) == (shard.size, shard.version):
            return shard
        if size == shard.size and shard.checksum is None and version is not None:
            _say_once(shard.url, logging.INFO, "ds.cache: %s changed since the dataset was "
                      "made (%s, was %s); its records are computed again and stored anew",
                      shard.url, version, shard.version)
            return replace(shard, version=version)
        _say_once(shard.url, logging.WARNING,
                  "ds.cache: %s changed since the dataset was made (%s bytes, %s; was %s "
                  "bytes, %s); it is read from the source, not the cache, while this dataset "
                  "lives: build the dataset again (its blocks and checksums are taken when it "
                  "is made)", shard.url, size, version, shard.size, shard.version)
        return None

    def key_now(self, block: int, shard: Shard | None) -> str | None:
        """Block `block`'s key for its shard as `shard_now` gave it."""
        if shard is None:
            return None
        index = self.blocks[block].shard
        if shard is self.shards[index]:
            return self.keys[block]
        return block_key(shard, self.blocks[block], name=self.names[index], key=self.key,
                         upstream=self.upstream)


_said: set[str] = set()  # files whose change was logged in this process


def _say_once(url: str, level: int, message: str, *args: Any) -> None:
    if url not in _said:
        _said.add(url)
        log.log(level, message, *args)


class _Held:
    """An open stored block: its reader, and how many of its placeholders are still out."""

    __slots__ = ("block", "key", "out", "reader", "reading")

    def __init__(self, block: int, key: str, reader: BlockReader) -> None:
        self.block = block
        self.key = key
        self.reader = reader
        self.out = 0
        self.reading = True  # `Lines` is still handing out its positions


_MARKS = {DROPPED: STORED_DROP, BLANK: BLANK_LINE, BAD: BAD_LINE}  # stage marker -> entry


class _Filling:
    """A writer and the number of the block's records handed to the buffer so far."""

    __slots__ = ("count", "writer")

    def __init__(self, writer: BlockWriter) -> None:
        self.writer = writer
        self.count = 0


class BlockCache:
    """One reader's use of a `RecordsCache`.

    `late`: the steps run after the shuffle buffer (records are put as they leave it).
    `compute(positions)`: the records at `positions` after the cached steps (DROPPED where
    they drop one), read from the source: used where a stored block turns out damaged.
    """

    def __init__(self, spec: RecordsCache, *, late: bool, where: LineNumbers,
                 compute: Callable[[Sequence[Position]], list[Any]]) -> None:
        self.spec = spec
        self.late = late
        self.where = where
        self.compute = compute
        self._held: dict[int, _Held] = {}
        self._damaged: list[_Held] = []
        self._filling: dict[int, _Filling] = {}
        self._keys: dict[int, str | None] = {}  # per block, checked against its shard now
        self._shards: dict[int, Shard | None] = {}  # per shard: `RecordsCache.shard_now`

    def _key(self, block: int) -> str | None:
        """Block `block`'s key, its shard checked against its storage once per reader (a
        reader lives one epoch): a file changed since `.cache()` never gets stale records."""
        if block in self._keys:
            return self._keys[block]
        spec = self.spec
        index = spec.blocks[block].shard
        if index not in self._shards:
            self._shards[index] = spec.shard_now(index)
        key = self._keys[block] = spec.key_now(block, self._shards[index])
        return key

    # -- reading (Lines) ---------------------------------------------------------------------

    def open(self, block: int) -> _Held | None:
        """The stored block, held open while `Lines` hands out its positions and while its
        placeholders are out (None: not stored)."""
        held = self._open(block)
        if held is not None:
            held.reading = True
        return held

    def _open(self, block: int) -> _Held | None:
        held = self._held.get(block)
        if held is not None:
            return held
        key = self._key(block)
        if key is None:
            return None
        reader = self.spec.store.get(key)
        if reader is None:
            return None
        held = self._held[block] = _Held(block, key, reader)
        held.reading = False
        return held

    def pieces(self, held: _Held, work_index: int, start: int | None
               ) -> Iterator[tuple[Chunk, bool]]:
        """(chunk of placeholders, whether it is the block's last) from the first stored
        position at or after `start` (None: the block's start)."""
        reader = held.reader
        count = len(reader)
        first = 0 if start is None else reader.first_at(start)
        try:
            for low in range(first, count, PIECE):
                high = min(count, low + PIECE)
                offsets = [reader.position(i) for i in range(low, high)]
                # past the last: a state never holds it (`Lines` moves to the next block
                # before handing the last piece on)
                offsets.append(reader.position(high) if high < count else offsets[-1] + 1)
                marks = reader.line_marks(low, high)
                items: list[Any] = [Stored(held, i) for i in range(low, high)]
                for ordinal, mark in marks.items():
                    items[ordinal - low] = BLANK if mark is BLANK_LINE else BAD
                held.out += len(items) - len(marks)
                chunk = Chunk(work_index, held.block, offsets, items, not marks, stored=True)
                yield chunk, high == count
        finally:
            held.reading = False
            self._release(held)

    def _release(self, held: _Held) -> None:
        if held.out <= 0 and not held.reading and self._held.get(held.block) is held:
            del self._held[held.block]
            held.reader.close()

    def resolve(self, item: Stored) -> Any:
        """The stored record of a placeholder (`DROPPED` where the steps dropped it)."""
        held = item.held
        try:
            record = held.reader.record(item.ordinal)
        except CachedBlockError as err:
            log.warning("%s; computing its records from the source (the next epoch stores "
                        "the block again)", err)
            self._forget(held)
            record = self.compute([(held.block, held.reader.position(item.ordinal))])[0]
        held.out -= 1
        self._release(held)
        return DROPPED if record is STORED_DROP else record

    def _forget(self, held: _Held) -> None:
        """Remove a damaged stored block (it is read from the source from now on)."""
        path = self.spec.store.path_of(held.key)
        if self._held.get(held.block) is held:
            del self._held[held.block]
        held.out = 1 << 62  # its reader stays open for the placeholders still out (until
        self._damaged.append(held)  # `close`)
        path.unlink(missing_ok=True)

    def fetch(self, positions: Sequence[Position],
              source: Callable[[Sequence[Position]], list[Any]]) -> list[Any]:
        """The items at `positions` for a buffer to hold: placeholders where the block is
        stored (checked against the stored positions), `source(positions)` for the rest."""
        out: list[Any] = [None] * len(positions)
        rest: list[int] = []
        wanted: dict[int, list[int]] = defaultdict(list)
        for index, (block, _) in enumerate(positions):
            wanted[block].append(index)
        for block, indexes in wanted.items():
            held = self._open(block)
            if held is None:
                rest += indexes
                continue
            reader = held.reader
            for index in indexes:
                offset = positions[index][1]
                ordinal = reader.first_at(offset)
                if ordinal >= len(reader) or reader.position(ordinal) != offset:
                    raise StateMismatchError(
                        f"{self.where.place(block, offset)}: a buffered record of the state is "
                        f"not among the stored records of its block ({reader.path}); the data "
                        "or the steps changed since the state was taken")
                out[index] = Stored(held, ordinal)
                held.out += 1
            self._release(held)
        if rest:
            for index, record in zip(rest, source([positions[i] for i in rest]), strict=True):
                out[index] = record
        return out

    # -- writing -------------------------------------------------------------------------------

    def begin(self, block: int) -> None:
        """`Lines` starts reading `block` from its beginning: fill it, where nobody else is."""
        old = self._filling.pop(block, None)
        if old is not None:  # a pass that stopped short (even ranks' padding reads it again)
            old.writer.abort()
        key = self._key(block)
        if key is None:
            return
        writer = self.spec.store.start(key)
        if writer is not None:
            self._filling[block] = _Filling(writer)

    def finish(self, block: int) -> None:
        """`Lines` read the whole block: its record count is known."""
        filling = self._filling.get(block)
        if filling is None:
            return
        filling.writer.expect(filling.count)
        self._settle(block, filling)

    def abandon(self, block: int) -> None:
        """The block was cut short (damaged, skipped): store nothing of it."""
        filling = self._filling.pop(block, None)
        if filling is not None:
            filling.writer.abort()

    def seen(self, chunk: Chunk) -> None:
        """A computed chunk on its way to the buffer: count its records; where the steps
        ran already (not `late`), store them and their drops."""
        filling = self._filling.get(chunk.block)
        if filling is None:
            return
        items = chunk.items
        put = filling.writer.put_at
        filling.count += len(items)
        if self.late and chunk.clean:  # records: put as they leave the buffer
            return
        for offset, item in zip(chunk.offsets, items, strict=False):
            if item.__class__ is Marker:
                item = _MARKS[item]
            elif self.late:
                continue
            self._put(put, chunk.block, offset, item)
        self._settle(chunk.block, filling)

    def put(self, block: int, offset: int, record: Any) -> None:
        """The record the steps made of the one at (block, offset) as it left the buffer
        (`DROPPED` for a drop)."""
        filling = self._filling.get(block)
        if filling is None:
            return
        self._put(filling.writer.put_at, block, offset,
                  STORED_DROP if record is DROPPED else record)
        self._settle(block, filling)

    def _put(self, put: Callable[[int, Any], None], block: int, offset: int, record: Any
             ) -> None:
        try:
            put(offset, record)
        except UncacheableRecordError as err:
            self._filling.pop(block, None)
            raise UncacheableRecordError(
                f"{self.where.place(block, offset)}: ds.cache cannot store what the steps "
                f"before it made of this record: {err}") from None

    def _settle(self, block: int, filling: _Filling) -> None:
        writer = filling.writer
        if writer.complete or not writer.stored:
            self._filling.pop(block, None)

    def close(self) -> None:
        """Give up the blocks not filled (a later epoch fills them) and close the readers."""
        for filling in self._filling.values():
            filling.writer.abort()
        self._filling.clear()
        for held in [*self._held.values(), *self._damaged]:
            held.reader.close()
        self._held.clear()
        self._damaged.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at exit: the descriptors go with the process
            self.close()
