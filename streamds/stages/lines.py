"""Lines: this reader's work items -> chunks of raw lines (the first stage of the pipeline).

Reads each work item's block with `read.read_lines` (line alignment, retries) and hands its
lines on in chunks of one read each. With `pad_work` (even ranks), after `work` it cycles
through `pad_work` for as long as the consumer pulls. A damaged block under
on_error="skip" is counted and left. With `readahead` bytes, the stored bytes of the coming
work items are fetched ahead (`streamds.storage.readahead`, through the local `cache` when
given) and handed to the opener as ``ahead=``. With `stored` (`ds.cache`), a block the
cache holds is not read: its stored positions come as chunks of placeholders
(`streamds.stages.record_cache`), and a block read from its start is filled.

State: ``{"stage": "lines", "item": k, "offset": o | None, "counts": {"corrupt_blocks": n}}``:
continue work
item k at the line beginning at offset o (None: where the item starts). `position_in` finds
where the line reader stands in any state nested above it; `seek` moves it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CorruptShardError
from ..retry import DEFAULT_RETRY, RetryPolicy
from ..storage.plan import Block
from ..storage.read import Opener, open_decoded_at, read_lines
from ..storage.readahead import ReadAhead, Span, block_span, on_fuse
from ..storage.shard_cache import ShardCacheSettings
from ..storage.shards import Shard
from .chunks import COUNTS, STAGE, Chunk, WorkItem, checked, find

if TYPE_CHECKING:
    from .record_cache import BlockCache

__all__ = ["Lines"]

log = logging.getLogger(__name__)


class Lines:
    STAGE = "lines"
    ITEM = "item"
    OFFSET = "offset"
    COUNTS = COUNTS

    @classmethod
    def position_in(cls, state: Any) -> tuple[int, int | None]:
        """(work item, offset) where the line reader stands in `state`: its own state, or
        one of a stage nested above it (found down the sources, `chunks.find`)."""
        node = find(state, cls.STAGE)
        return node[cls.ITEM], node[cls.OFFSET]

    def __init__(
        self,
        shards: Sequence[Shard],
        blocks: Sequence[Block],
        work: Sequence[WorkItem],
        *,
        on_error: str = "raise",
        opener: Opener = open_decoded_at,
        retry: RetryPolicy = DEFAULT_RETRY,
        pad_work: Sequence[WorkItem] = (),
        readahead: int = 0,
        cache: ShardCacheSettings | None = None,
        stored: BlockCache | None = None,
    ) -> None:
        self.shards = shards
        self.blocks = blocks
        self.work = list(work)
        self.pad_work = list(pad_work)
        self.on_error = on_error
        self.opener = opener
        self.retry = retry
        self.readahead = readahead
        self.cache = cache
        self.stored = stored
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        if state is not None:
            checked(state, self.STAGE)
        self._item = 0 if state is None else state[self.ITEM]
        self._offset: int | None = None if state is None else state[self.OFFSET]
        self._corrupt = 0 if state is None else state[self.COUNTS]["corrupt_blocks"]

    def seek(self, item: int, offset: int | None) -> None:
        """Continue at the line beginning at `offset` of work item `item` (None: the item's
        start); the counters stay."""
        self._item, self._offset = item, offset

    def get_state(self) -> dict[str, Any]:
        return {STAGE: self.STAGE, self.ITEM: self._item, self.OFFSET: self._offset,
                self.COUNTS: {"corrupt_blocks": self._corrupt}}

    @property
    def counts(self) -> dict[str, int]:
        return {"corrupt_blocks": self._corrupt}

    def work_item(self, k: int) -> WorkItem:
        """The k-th work item; past the end of `work`, `pad_work` over and over."""
        if k < len(self.work):
            return self.work[k]
        return self.pad_work[(k - len(self.work)) % len(self.pad_work)]

    def _more(self, k: int) -> bool:
        return k < len(self.work) or bool(self.pad_work)

    def _pass_begins(self, k: int) -> bool:
        return k >= len(self.work) and (k - len(self.work)) % len(self.pad_work) == 0

    def _spans(self, first: int, offset: int | None) -> Iterator[Span]:
        """The stored bytes of work items `first`... (the first from `offset`), in order. A
        block of a format whose blocks share decoding (Parquet's row ranges of one row group)
        whose span the item before read too is not fetched again: its reader continues the
        decoding of that span, forward."""
        last = None
        for k in range(first, len(self.work)):
            block_id, start = self.work[k]
            block = self.blocks[block_id]
            if k == first and offset is not None:
                start = offset
            span = block_span(self.shards[block.shard],
                              block.start if start is None else start, block.end,
                              at_line=start is not None)
            if span is not None and not (span == last and span[0].format.shared_decoding):
                yield span
            last = span

    def __iter__(self) -> Iterator[Chunk]:
        if not self.readahead:
            yield from self._chunks(self.opener)
            return
        ahead = ReadAhead(self._spans(self._item, self._offset), budget=self.readahead,
                          retry=self.retry, cache=self.cache, fuse=on_fuse(self.shards))
        try:
            yield from self._chunks(functools.partial(self.opener, ahead=ahead))
        finally:
            ahead.close()

    def _chunks(self, opener: Opener) -> Iterator[Chunk]:
        lines_in_pass: int | None = None  # lines of the current pass over pad_work
        while self._more(self._item):
            k = self._item
            if self._pass_begins(k):
                if lines_in_pass == 0:  # a whole pass without a line: it would never end
                    return
                lines_in_pass = 0
            block_id, start = self.work_item(k)
            resume_at = start if self._offset is None else self._offset
            stored = self.stored
            held = None if stored is None else stored.open(block_id)
            if held is not None:  # not read: its stored positions, as placeholders
                for chunk, last in stored.pieces(held, k, resume_at):
                    if lines_in_pass is not None:
                        lines_in_pass += len(chunk.items)
                    if last:  # a state taken from here on starts at the next block
                        self._item, self._offset = k + 1, None
                    else:
                        self._offset = chunk.offsets[-1]
                    yield chunk
                self._item, self._offset = k + 1, None
                continue
            if stored is not None and resume_at is None:
                stored.begin(block_id)
            block = self.blocks[block_id]
            shard = self.shards[block.shard]
            chunks = read_lines(shard, block, block_id, resume_at=resume_at, opener=opener,
                                retry=self.retry)
            try:
                for raw in chunks:
                    self._offset = raw.offsets[-1]
                    if lines_in_pass is not None:
                        lines_in_pass += len(raw.lines)
                    yield Chunk(k, block_id, raw.offsets, raw.lines, False, raw.labels,
                                data=raw.data)
            except CorruptShardError as err:
                if stored is not None:
                    stored.abandon(block_id)
                if self.on_error == "raise":
                    raise
                self._corrupt += 1
                log.warning("skipping the rest of a damaged block: %s", err)
            if stored is not None:
                stored.finish(block_id)
            self._item, self._offset = k + 1, None
