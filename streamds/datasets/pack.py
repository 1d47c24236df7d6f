"""Packing: tokenized records -> sequences of exactly `seq_len` tokens, no padding between.

`PackTokens` says how (`seq_len`, the separator `eos_id`, where the ids are); `Packed` is the
stage, a dataset over a `StreamingJsonl` or a `Mix` (``ds.pack(PackTokens(...))``). Each
document's ids, then `eos_id`, are appended to the current sequence; a document that does
not fit continues at the start of the next one. Each sequence is a dict of LongTensors:

- ``input_ids``: the tokens;
- ``position_ids``: 0, 1, 2, ... restarting at each document (and at the start of a sequence,
  where the rest of a split document continues);
- ``document_ids``: the index of each token's document within the sequence (-1 on padding),
  so attention can stay within documents (`document_mask` turns it into a mask).

Only the last sequence of an epoch can be short: padded with `pad_id` (or dropped with
``drop_last=True``). Counts (``.counts``, `streamds.token_counts(state)`): documents, tokens
read (with separators), tokens packed, padding added, tokens dropped.

State: ``{"format": "streamds/3", "stage": "packed", "config": [...], "world": [rank,
world_size, worker, num_workers], "source": <the source's state, nested>, "leftover": [packed
ids], "counts": {...}}``;
the leftover is the unused part of the document the last sequence ended in (at most one
document's ids, 8 bytes each), so a resume continues mid-document exactly. After an elastic
merge (`streamds.merge_states`), the leftovers of every old reader are dealt to the new ones.
"""

from __future__ import annotations

import copy
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset

from ..checks import check_bool, check_int
from ..errors import StateMismatchError
from ..resume.merge import MERGED_PACKED, PACKED
from ..resume.totals import PACK_COUNTERS
from ..stages.state import (
    FORMAT,
    STAGE,
    STATE_FORMAT,
    check_state,
    nested,
    refuse_old,
    stage_of,
    unnested,
)
from ..stages.transform import Step, apply_steps
from ..world import World, detect_world

if TYPE_CHECKING:
    from ..stages.buckets import Rule
    from .batching import Batched

__all__ = ["PackTokens", "Packed", "document_mask"]

_KEYS = frozenset((FORMAT, STAGE, "config", "world", "source", "leftover", "counts"))
_END = object()  # the source ran out


@dataclass(frozen=True)
class PackTokens:
    """How to pack: sequences of `seq_len` tokens, documents separated by `eos_id`.

    `key`: the record field holding the token ids (None: the record is the list of ids).
    `pad_id` fills the short last sequence of an epoch; `drop_last` drops it instead.
    """

    seq_len: int
    eos_id: int
    key: str | None = "input_ids"
    pad_id: int = 0
    drop_last: bool = False

    def __post_init__(self) -> None:
        check_int("seq_len", self.seq_len, 1, "the number of tokens per packed sequence")
        check_int("eos_id", self.eos_id, 0, "the id of the document separator token")
        check_int("pad_id", self.pad_id, 0, "the id that fills the short last sequence")
        check_bool("drop_last", self.drop_last)
        if self.key is not None and not isinstance(self.key, str):
            raise ValueError(f"key must be a field name or None, got {self.key!r}")

    def config(self) -> list[Any]:
        return [self.seq_len, self.eos_id, self.key, self.pad_id, self.drop_last]


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool mask [..., L, L]: token q may attend to token k when both are in the same
    document (not padding) and k <= q (causal)."""
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    length = document_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    real = (document_ids >= 0).unsqueeze(-1)
    return same & causal & real


def _unpack_ids(raw: bytes) -> array[int]:
    ids = array("q")
    ids.frombytes(raw)
    return ids


def _tensor(values: array[int]) -> torch.Tensor:
    """An int64 tensor over the array's memory (no copy; the tensor keeps the array alive)."""
    return torch.frombuffer(values, dtype=torch.long)


@dataclass
class _Cursor:
    """One reader's packing position: the documents' ids not yet emitted, and counts."""

    world: World
    pieces: deque[array[int]] = field(default_factory=deque)  # ids with separators
    offset: int = 0  # ids of pieces[0] already emitted
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PACK_COUNTERS, 0))

    def leftover(self) -> list[bytes]:
        if not self.pieces:
            return []
        first, *rest = self.pieces
        return [first[self.offset:].tobytes(), *(piece.tobytes() for piece in rest)]


class Packed(IterableDataset):
    """Stage: records of a `StreamingJsonl` or `Mix` -> packed sequences (see module doc).

    Resume exactly with `state_dict()`/`load_state_dict()` (torchdata's StatefulDataLoader),
    elastically with ``packed.with_resume(streamds.merge_states(states))``. The source's
    state tells its "epoch" and whether it is "finished", as those of `StreamingJsonl` and
    `Mix` do: a finished state of another epoch than the source's starts that epoch afresh.
    """

    def __init__(self, source: Any, packer: PackTokens) -> None:
        super().__init__()
        if not isinstance(packer, PackTokens):
            raise ValueError(
                f"pack needs a streamds.PackTokens, got {packer!r}; e.g. "
                "ds.pack(PackTokens(seq_len=2048, eos_id=tokenizer.token_to_id('[EOS]')))"
            )
        self.source = source
        self.packer = packer
        self._pending: dict[str, Any] | None = None  # a loaded state, for the next iterator
        self._merged: dict[str, Any] | None = None  # leftovers of an elastic resume
        self._active: _Cursor | None = None
        self._steps: tuple[Step, ...] = ()  # map and filter of the sequences (.map/.filter)

    def __repr__(self) -> str:
        return f"Packed({self.source!r}, {self.packer!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_active"] = None  # a live iterator stays in the process that made it
        return state

    @property
    def rank(self) -> int | None:
        return self.source.rank

    @property
    def world_size(self) -> int | None:
        return self.source.world_size

    @property
    def counts(self) -> dict[str, int]:
        """This process's packing counts (see the module doc); zeros before iterating."""
        if self._active is None:
            return dict.fromkeys(PACK_COUNTERS, 0)
        return dict(self._active.counts)

    @property
    def epoch(self) -> int:
        """The source's epoch (packing follows it)."""
        return self.source.epoch

    def set_epoch(self, epoch: int) -> None:
        self.source.set_epoch(epoch)

    def batch(
        self, size: int | Rule, *, collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> Batched:
        """The packed sequences in whole batches, as ``StreamingJsonl.batch``: `size`
        sequences per batch (or a ``streamds.LengthBuckets`` / ``TokenBudget`` rule, though
        packed sequences all have one length); `collate` makes the batch, e.g.
        ``torch.utils.data.default_collate`` for stacked tensors (None: a
        `streamds.RecordBatch`). Use it with ``DataLoader(packed.batch(n, ...),
        batch_size=None)``; a state taken after any batch resumes exactly."""
        from .batching import Batched

        return Batched(self, size, collate=collate, drop_last=drop_last)

    # -- iteration -----------------------------------------------------------------------

    def _start(self, world: World) -> _Cursor:
        """Where reader `world` starts: a loaded state, else its deal of a merged state's
        leftovers, else nothing. Reads them without using them up (`state_dict` asks too)."""
        pending = self._pending
        cursor = _Cursor(world)
        if pending is not None and pending["source"]["finished"] and (
                pending["source"]["epoch"] != self.source.epoch):
            pending = None  # that epoch is over and another was chosen: start it afresh
        if pending is not None:
            if World(*pending["world"]) != world:
                raise StateMismatchError(
                    f"the packed state was taken by reader (rank, world_size, worker, "
                    f"num_workers)={tuple(pending['world'])} but is loaded by "
                    f"{(world.rank, world.world_size, world.worker, world.num_workers)}; "
                    "resume with the same world, or merge the states of all readers with "
                    "streamds.merge_states() and resume with packed.with_resume(merged)"
                )
            cursor.pieces.extend(_unpack_ids(raw) for raw in pending["leftover"])
            cursor.counts = dict(pending["counts"])
            return cursor  # taken after an elastic resume, it already holds what was dealt
        merged = self._merged
        if merged is not None and merged["epoch"] == self.source.epoch:
            # this reader's deal of the old readers' leftovers
            leftovers = merged["leftovers"][world.reader::world.readers]
            cursor.pieces.extend(_unpack_ids(raw) for raw in leftovers)
            if world.reader == 0:
                cursor.counts = dict(merged["counts"])
        return cursor

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        cursor = self._start(detect_world(self.rank, self.world_size))
        self._pending = None  # a loaded state starts one iterator
        self._active = cursor
        sequences = self._generate(iter(self.source), cursor)
        # -> its own map and filter, on whole sequences (a state between them stays exact)
        return apply_steps(sequences, self._steps, "this packed dataset") if self._steps else (
            sequences)

    def _with_step(self, step: Step) -> Packed:
        clone = copy.copy(self)
        clone._steps = (*self._steps, step)
        clone._active = None
        return clone

    def map(self, fn: Callable[[Any], Any]) -> Packed:
        """A new packed dataset whose sequences are `fn(sequence)` (None drops one), e.g. to
        add an attention mask; tokens of a dropped sequence still count as packed."""
        if not callable(fn):
            raise ValueError(f"map needs a callable, got {fn!r}")
        return self._with_step(Step("map", fn))

    def filter(self, predicate: Callable[[Any], bool]) -> Packed:
        """A new packed dataset keeping the sequences for which `predicate(sequence)` is
        true."""
        if not callable(predicate):
            raise ValueError(f"filter needs a callable, got {predicate!r}")
        return self._with_step(Step("filter", predicate))

    def _ids(self, record: Any, number: int) -> array[int]:
        """The token ids of `record` (document `number` of this reader), then `eos_id`."""
        key = self.packer.key
        try:
            ids = array("q", record if key is None else record[key])
        except (KeyError, TypeError, IndexError, OverflowError) as err:
            where = "the record" if key is None else f"record[{key!r}]"
            raise ValueError(
                f"PackTokens(key={key!r}): {where} is not a list of token ids ({err!r}); map "
                "records to {key: ids} first, or pass key=None for records that are id lists"
            ) from None
        values = record if key is None else record[key]
        index = None
        if isinstance(values, (list, tuple)) and bool in set(map(type, values)):
            index = next(i for i, v in enumerate(values) if isinstance(v, bool))
        elif ids and min(ids) < 0:
            index = next(i for i, v in enumerate(ids) if v < 0)
        if index is not None:  # array("q") takes both, and an embedding table neither
            shown = values[index] if isinstance(values, (list, tuple)) else ids[index]
            where = "the record" if key is None else f"record[{key!r}]"
            raise ValueError(
                f"PackTokens(key={key!r}): {where} of document {number} (counted from 1 in "
                f"this reader's epoch) holds {shown!r} at index {index}: token ids are "
                "integers >= 0 (a bool is no token id); check the tokenizer's output or the "
                "map that made the ids"
            )
        ids.append(self.packer.eos_id)
        return ids

    def _generate(self, records: Iterator[Any], cursor: _Cursor) -> Iterator[dict[str, Any]]:
        length, counts = self.packer.seq_len, cursor.counts
        pieces = cursor.pieces
        count_up = array("q", range(length))  # position ids are slices of it
        while True:
            ids, positions, documents = array("q"), array("q"), array("q")
            # -> up to `length` ids: the rest of the current document, then whole documents
            while len(ids) < length:
                if not pieces:
                    record = next(records, _END)
                    if record is _END:
                        break
                    pieces.append(self._ids(record, counts["documents"] + 1))
                    counts["documents"] += 1
                    counts["tokens"] += len(pieces[0])
                piece, start = pieces[0], cursor.offset
                take = min(length - len(ids), len(piece) - start)
                documents.extend(array("q", [documents[-1] + 1 if documents else 0]) * take)
                ids.extend(piece[start : start + take])
                positions.extend(count_up[:take])
                if start + take == len(piece):
                    pieces.popleft()
                    cursor.offset = 0
                else:
                    cursor.offset = start + take
            real = len(ids)
            if real == 0:
                return
            if real < length:  # the source ran out: the short last sequence
                if self.packer.drop_last:
                    counts["dropped"] += real
                    return
                short = length - real
                counts["padded"] += short
                ids.extend(array("q", [self.packer.pad_id]) * short)
                positions.extend(array("q", [0]) * short)
                documents.extend(array("q", [-1]) * short)
            counts["packed"] += real
            counts["sequences"] += 1
            yield {"input_ids": _tensor(ids), "position_ids": _tensor(positions),
                   "document_ids": _tensor(documents)}

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The source's state plus the unused ids of the current document (O(document))."""
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        cursor = self._active or self._start(detect_world(self.rank, self.world_size))
        w = cursor.world
        return {FORMAT: STATE_FORMAT, STAGE: PACKED, "config": self.packer.config(),
                "world": [w.rank, w.world_size, w.worker, w.num_workers],
                "source": nested(self.source.state_dict()), "leftover": cursor.leftover(),
                "counts": dict(cursor.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` at the next `iter()`; refuses a state of another packing."""
        check_state(state, PACKED, _KEYS, "packed dataset")
        self._check_config(state["config"])
        self.source.load_state_dict(unnested(state["source"]))
        self._active = None
        self._pending = copy.deepcopy(state)

    def _check_config(self, config: list[Any]) -> None:
        if config != self.packer.config():
            raise StateMismatchError(
                f"the state was taken with PackTokens settings {config} but this dataset "
                f"packs with {self.packer.config()} (seq_len, eos_id, key, pad_id, "
                "drop_last); pack the same way"
            )

    def resume_after_batches(self, consumed: int, **loader: Any) -> Packed:
        """Refused: how many documents a plain DataLoader's batches used cannot be told
        without tokenizing them again; resume packing through `state_dict()`."""
        raise ValueError(
            f"resume_after_batches({consumed}): a packed dataset cannot be resumed from a "
            "batch count (the sequences' documents are known only by tokenizing them); use "
            "torchdata's StatefulDataLoader and checkpoint loader.state_dict()"
        )

    def with_resume(self, merged: dict[str, Any]) -> Packed:
        """A copy that finishes the epoch of `merged` (`streamds.merge_states` of the packed
        states of every reader) under this dataset's world: every token once."""
        if isinstance(merged, dict):
            refuse_old(merged)
        if stage_of(merged) != MERGED_PACKED:
            raise ValueError(
                "with_resume needs the dict streamds.merge_states() returns for the states of "
                "a packed dataset; to resume with the same world, use load_state_dict()"
            )
        self._check_config(merged["config"])
        clone = copy.copy(self)
        clone.source = self.source.with_resume(unnested(merged["source"]))
        clone._merged = {"epoch": merged["source"]["epoch"],
                         "leftovers": list(merged["leftovers"]),
                         "counts": dict(merged["counts"])}
        clone._pending = None
        clone._active = None
        return clone
