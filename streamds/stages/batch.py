"""Batch: records -> whole batches, made in the worker (`StreamingJsonl.batch`).

With ``DataLoader(ds.batch(n, collate=...), batch_size=None)`` each message from a worker is
one batch, so pipe and pickling costs are paid per batch, not per record. The state is the
source's state at the batch boundary, so a state taken after any batch resumes exactly.

State: ``{"stage": "batch", "source": <the records stage's state>}``. Batches cut by length
(a `BatchSettings` with a `rule`) come from the `streamds.stages.buckets.PoolBatch` stage instead.
"""

from __future__ import annotations

import copy
import marshal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from torch.utils.data import get_worker_info

from ..handover import shm_ring
from .chunks import SOURCE, STAGE, Below, HandedOut, Rest, checked
from .line_runs import LineRuns

if TYPE_CHECKING:
    from .buckets import Rule

__all__ = ["Batch", "BatchSettings", "RecordBatch", "marshal_exact", "records_from_user_steps"]


class RecordBatch:
    """The records of one batch, as `StreamingJsonl.batch(n)` yields them without a collate.

    Reads like a list (``len``, indexing, iteration, ``==`` with a list); ``batch.records`` or
    ``list(batch)`` is the list itself. It is not a `Sequence` on purpose: with
    ``DataLoader(batch_size=None)`` torch's default conversion (`default_convert`) copies every
    record of a list and walks every value in it (a cost per value in the main process), but
    hands anything else over as it is. Pickles as its list; the queue of a DataLoader worker
    sends it through shared memory (`_reduce_for_queue`).
    """

    __slots__ = ("records",)

    def __init__(self, records: list[Any]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.records)

    def __getitem__(self, index: Any) -> Any:
        return self.records[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordBatch):
            return self.records == other.records
        return isinstance(other, list) and self.records == other

    __hash__ = None  # type: ignore[assignment]  # mutable, like the list it holds

    def __repr__(self) -> str:
        return f"RecordBatch({self.records!r})"

    def __copy__(self) -> RecordBatch:
        return RecordBatch(list(self.records))

    def __deepcopy__(self, memo: dict[int, Any]) -> RecordBatch:
        return RecordBatch(copy.deepcopy(self.records, memo))

    def __reduce__(self) -> tuple[Any, ...]:  # pickle, torch.save: as its list
        return (RecordBatch, (self.records,))


def _reduce_for_queue(batch: RecordBatch) -> tuple[Any, ...]:
    """How multiprocessing's pickler (the DataLoader's queues) sends a `RecordBatch`."""
    if get_worker_info() is None:  # not on the way from a DataLoader worker
        return (RecordBatch, (batch.records,))
    return reduce_records_in_worker(batch.records)


ForkingPickler.register(RecordBatch, _reduce_for_queue)


# Whether a user's map or filter made some records this process hands over. marshal writes
# any object with the buffer protocol (a numpy array or scalar, a bytearray, a memoryview) as
# bytes without a word, so records a user step made are checked first (`marshal_exact`);
# records as parsed (dicts, lists, str, int, float, bool, None, bytes) never need it.
_user_records = False


def records_from_user_steps() -> None:
    """Note that a map or filter runs in this process: its batches are checked before they
    are marshalled (called where a reader or dataset with steps starts iterating)."""
    global _user_records
    _user_records = True


_MARSHAL_EXACT = frozenset({str, int, float, bool, type(None), bytes})
_CONTAINERS = frozenset({dict, list, tuple})


def marshal_exact(value: Any) -> bool:
    """Whether marshal gives `value` back as it is: only the exact types above, in dicts,
    lists and tuples (a subclass, or an object marshal would turn into bytes, is not)."""
    kind = type(value)
    if kind is dict:
        if not set(map(type, value)) <= _MARSHAL_EXACT:
            return False
        items: Any = value.values()
    elif kind is list or kind is tuple:
        items = value
    else:
        return kind in _MARSHAL_EXACT
    kinds = set(map(type, items))
    if kinds <= _MARSHAL_EXACT:
        return True
    if not kinds <= _MARSHAL_EXACT | _CONTAINERS:
        return False
    return all(marshal_exact(item) for item in items if type(item) in _CONTAINERS)


def reduce_records_in_worker(records: list[Any]) -> tuple[Any, ...]:
    """A worker's batch as the main process will rebuild it: marshalled into the worker's
    shared-memory ring (`streamds.handover.shm_ring`), else marshalled through the pipe, else
    (records marshal cannot carry exactly: numpy arrays and scalars, tensors, subclasses of
    dict) pickled.

    marshal is exact for what JSON parsing and most maps make (dict, list, tuple, str, bytes,
    int, float, bool, None), is safe between a worker and its main process (the same
    interpreter), and reads and writes a batch faster than pickle (`benchmarks/throughput.py`
    times pickle, orjson and marshal per batch).
    """
    if _user_records and not marshal_exact(records):
        return (RecordBatch, (records,))
    try:
        payload = marshal.dumps(records)
    except ValueError:  # "unmarshallable object" or nested too deeply
        return (RecordBatch, (records,))
    entry = shm_ring.put(payload)
    if entry is None:
        return (_from_marshal, (payload,))
    return (_from_ring, (entry,))


def _from_marshal(payload: bytes) -> RecordBatch:
    return RecordBatch(marshal.loads(payload))


def _from_ring(entry: shm_ring.Entry) -> RecordBatch:
    return RecordBatch(shm_ring.take(entry, marshal.loads))


@dataclass(frozen=True)
class BatchSettings:
    size: int | None  # records per batch; None: as many as the rule's token budget allows
    collate: Callable[[list[Any]], Any] = RecordBatch  # list of records -> the batch
    drop_last: bool = False
    rule: Rule | None = None  # cut pools by length (`streamds.stages.buckets`); None: fixed `size`
    ahead: int | str = "auto"  # batches a worker makes ahead of requests (`streamds.stages.ahead`)
    # a batch of lines (the main process parses them: `streamds.stages.parse_later`) ends
    # early once its lines hold this many bytes (None: `size` records); parsed records are
    # not measured
    max_bytes: int | None = None
    # the main process takes the batches on a CPU its workers keep off from their start
    # (`streamds.train.loader.OnMainCpu`: ds.loader, where the main process parses them)
    main_cpu: bool = False


class Batch:
    """Stage: records -> `collate(list of size records)`; the last batch may be short unless
    `drop_last`.

    The lists come from the source's `batches` (`streamds.stages.records.Records`,
    `streamds.stages.shuffle.Shuffle`: without a step per record); with `positions`, from its
    `batches_with_positions`, and `collate(records, blocks, offsets)` is given where each
    record's line is.
    """

    STAGE = "batch"
    SOURCE = SOURCE
    PIECE = 32  # records asked of the source at a time when a batch is bounded by bytes

    @classmethod
    def state_over(cls, source: Any) -> dict[str, Any]:
        """The state of this stage over a records stage standing at `source`."""
        return {STAGE: cls.STAGE, cls.SOURCE: source}

    @classmethod
    def unfinished(cls, state: dict[str, Any], below: Below) -> Rest:
        """What a reader batched at `state` leaves: what its records stage leaves (a batch is
        handed out whole, so none is open)."""
        return below(cls.source_of(state))

    def over(self, source: Any, handed: HandedOut) -> dict[str, Any]:
        """This stage's state once the reader has handed out `handed` (whole batches), its
        records stage standing at `source`."""
        return self.state_over(source)

    @classmethod
    def owns(cls, state: Any) -> bool:
        """Whether a pipeline state is this stage's."""
        return isinstance(state, dict) and state.get(STAGE) == cls.STAGE

    @classmethod
    def source_of(cls, state: dict[str, Any]) -> Any:
        """The records stage's state under this stage's."""
        return state[cls.SOURCE]

    def __init__(self, source: Any, spec: BatchSettings, collate: Callable[..., Any], *,
                 positions: bool = False) -> None:
        self.source = source
        self.spec = spec
        self.collate = collate
        self.positions = positions
        self._failed: Any = None  # the source's state before a batch whose making raised

    def reset(self, state: dict[str, Any] | None = None) -> None:
        if state is not None:
            checked(state, self.STAGE)
        self.source.reset(None if state is None else state[self.SOURCE])
        self._failed = None

    def get_state(self) -> dict[str, Any]:
        if self._failed is not None:
            return self.state_over(self._failed)
        return self.state_over(self.source.get_state())

    @property
    def counts(self) -> dict[str, int]:
        return self.source.counts

    @property
    def done(self) -> bool:
        """Whether the last batch has been handed out (its records are the source's last)."""
        return self._failed is None and self.source.done

    def __iter__(self) -> Iterator[Any]:
        # a batch whose making raises (its collate, or a stage below on one of its records)
        # hands out none of its records: the state then stands before it (guarantee 12), so
        # the source's state is kept before each batch (O(1) small integers)
        before = self.source.get_state()
        try:
            for batch in self._batches():
                yield batch
                before = self.source.get_state()
        except GeneratorExit:  # closed at a yield: that batch was handed out
            raise
        except BaseException:  # an error, or an interrupt while a batch was made
            self._failed = before
            raise

    def _batches(self) -> Iterator[Any]:
        size, collate, drop_last = self.spec.size, self.collate, self.spec.drop_last
        assert size is not None, "a BatchSettings with a rule goes to PoolBatch"
        if self.positions and self.spec.max_bytes is not None:
            yield from self._bounded_batches(size, self.spec.max_bytes)
            return
        if self.positions:
            for batch, blocks, offsets in self.source.batches_with_positions(size):
                if drop_last and len(batch) < size:
                    return
                yield collate(batch, blocks, offsets)
            return
        for batch in self.source.batches(size):
            if drop_last and len(batch) < size:
                return
            yield collate(batch)

    def _bounded_batches(self, size: int, max_bytes: int) -> Iterator[Any]:
        """Batches of lines of `size` records, each ended early once its lines hold
        `max_bytes` bytes: gathered from lists of at most PIECE records that divide `size`
        (a `size` with no divisor near PIECE pays a step per list), so a batch ends at most
        PIECE - 1 lines past the bound, and the source's state after each list stands after
        its last record (a state taken after a batch is exact). The cut depends only on the
        lines from the batch's start, so a resumed reader cuts the same batches."""
        assert not self.spec.drop_last, "a batch cut by bytes may be short anywhere"
        piece = next(d for d in range(min(size, self.PIECE), 0, -1) if size % d == 0)
        lines = LineRuns()
        blocks: list[int] = []
        offsets: list[int] = []
        for part, part_blocks, part_offsets in self.source.batches_with_positions(piece):
            lines += part
            blocks += part_blocks
            offsets += part_offsets
            if len(lines) >= size or lines.nbytes >= max_bytes:
                yield self.collate(lines, blocks, offsets)
                lines, blocks, offsets = LineRuns(), [], []
        if lines:
            yield self.collate(lines, blocks, offsets)
