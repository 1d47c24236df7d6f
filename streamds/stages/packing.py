"""`PackStage`: tokenized records -> sequences of exactly `seq_len` tokens, no padding between.

`PackTokens` says how (`seq_len`, the separator `eos_id`, where the ids are). Each document's
ids, then `eos_id`, are appended to the current sequence; a document that does not fit
continues at the start of the next one. Each sequence is a dict of LongTensors: ``input_ids``;
``position_ids`` (0, 1, 2, ... restarting at each document and at the start of a sequence);
``document_ids`` (the index of each token's document within the sequence, -1 on padding).
Only the last sequence of an epoch can be short: padded with `pad_id` (or dropped with
``drop_last=True``).

State node (``get_state(source)``; the top of a saved state also carries the format)::

    {"stage": "packed", "config": [seq_len, eos_id, key, pad_id, drop_last],
     "world": [rank, world_size, worker, num_workers], "source": <the source's node>,
     "leftover": [packed ids], "counts": {documents, tokens, packed, padded, dropped,
     sequences}}

The leftover is the unused part of the document the last sequence ended in (at most one
document's ids, 8 bytes each), so a resume continues mid-document exactly. Merged node
(`merge`): ``{"stage": "merged-packed", "config", "source": <merged node>, "leftovers":
[every old reader's leftover], "counts"}``; `MergedPack.deal` gives each new reader its part.
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import check_bool, check_int
from ..errors import StateMismatchError
from ..world import World
from .state import FORMAT, check_node
from .state import STAGE as STAGE_KEY

__all__ = ["PACK_COUNTERS", "MergedPack", "PackStage", "PackTokens"]

PACK_COUNTERS = ("documents", "tokens", "packed", "padded", "dropped", "sequences")
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


def _unpack_ids(raw: bytes) -> array[int]:
    ids = array("q")
    ids.frombytes(raw)
    return ids


def _tensor(values: array[int]) -> torch.Tensor:
    """An int64 tensor over the array's memory (no copy; the tensor keeps the array alive)."""
    return torch.frombuffer(values, dtype=torch.long)


class PackStage:
    """Stage: one reader's records -> packed sequences; it holds the documents' ids not yet
    emitted and the counts. `open(records)` hands it its source's records."""

    STAGE = "packed"
    MERGED = "merged-packed"
    CONFIG = "config"
    WORLD = "world"
    SOURCE = "source"
    LEFTOVER = "leftover"
    LEFTOVERS = "leftovers"
    COUNTS = "counts"
    KEYS = frozenset((FORMAT, STAGE_KEY, CONFIG, WORLD, SOURCE, LEFTOVER, COUNTS))
    MERGED_KEYS = frozenset((FORMAT, STAGE_KEY, CONFIG, SOURCE, LEFTOVERS, COUNTS))

    def __init__(self, packer: PackTokens, world: World) -> None:
        self.packer = packer
        self.world = world
        self.reset()
        self._records: Iterator[Any] = iter(())

    def reset(self, state: dict[str, Any] | None = None) -> None:
        """Start over at `state` (a node `get_state` made, strictly checked; None: nothing
        carried, zero counts). The source's node is the source's to load (`source_of`)."""
        self.pieces: deque[array[int]] = deque()  # ids with separators
        self.offset = 0  # ids of pieces[0] already emitted
        self.counts: dict[str, int] = dict.fromkeys(PACK_COUNTERS, 0)
        if state is None:
            return
        check_node(state, self.STAGE, self.KEYS, "packed dataset")
        self.check_config(state[self.CONFIG], self.packer)
        self.world = World(*state[self.WORLD])
        self.pieces.extend(_unpack_ids(raw) for raw in state[self.LEFTOVER])
        self.counts = dict(state[self.COUNTS])

    def get_state(self, source: Any) -> dict[str, Any]:
        """This reader's node, with `source` (its source's node) nested; O(document)."""
        w = self.world
        return {STAGE_KEY: self.STAGE, self.CONFIG: self.packer.config(),
                self.WORLD: [w.rank, w.world_size, w.worker, w.num_workers],
                self.SOURCE: source, self.LEFTOVER: self._leftover(),
                self.COUNTS: dict(self.counts)}

    def _leftover(self) -> list[bytes]:
        if not self.pieces:
            return []
        first, *rest = self.pieces
        return [first[self.offset:].tobytes(), *(piece.tobytes() for piece in rest)]

    @classmethod
    def source_of(cls, state: dict[str, Any]) -> Any:
        """The source's node nested in a reader's or a merged node."""
        return state[cls.SOURCE]

    @classmethod
    def world_of(cls, state: dict[str, Any]) -> World:
        return World(*state[cls.WORLD])

    @staticmethod
    def check_config(found: list[Any], packer: PackTokens) -> None:
        if found != packer.config():
            raise StateMismatchError(
                f"the state was taken with PackTokens settings {found} but this dataset "
                f"packs with {packer.config()} (seq_len, eos_id, key, pad_id, drop_last); "
                "pack the same way"
            )

    def start_merged(self, merged: MergedPack) -> None:
        """Carry this reader's deal of a merged state's leftovers (and, reader 0 only, its
        counts, so that they count once)."""
        self.pieces.extend(_unpack_ids(raw) for raw in merged.deal(self.world))
        if self.world.reader == 0:
            self.counts = dict(merged.counts)

    # -- iteration -------------------------------------------------------------------------

    def open(self, records: Iterator[Any]) -> PackStage:
        self._records = records
        return self

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

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        records = self._records
        length, counts = self.packer.seq_len, self.counts
        pieces = self.pieces
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
                piece, start = pieces[0], self.offset
                take = min(length - len(ids), len(piece) - start)
                documents.extend(array("q", [documents[-1] + 1 if documents else 0]) * take)
                ids.extend(piece[start : start + take])
                positions.extend(count_up[:take])
                if start + take == len(piece):
                    pieces.popleft()
                    self.offset = 0
                else:
                    self.offset = start + take
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

    # -- operations on nodes, for merge and counts -----------------------------------------

    @classmethod
    def merge(cls, nodes: Sequence[dict[str, Any]],
              merge_sources: Callable[[list[Any]], Any]) -> dict[str, Any]:
        """The nodes of every reader of a packed dataset -> one merged node: the source's
        nodes merged by `merge_sources`, plus every reader's leftover tokens."""
        first = nodes[0]
        for node in nodes:
            check_node(node, cls.STAGE, cls.KEYS, "packed dataset")
        if any(node[cls.CONFIG] != first[cls.CONFIG] for node in nodes):
            raise StateMismatchError(
                "the packed states come from different PackTokens settings; merge the states "
                "taken at one checkpoint of one run"
            )
        counts: Counter[str] = Counter()
        for node in nodes:
            counts.update(node[cls.COUNTS])
        ordered = sorted(nodes, key=lambda node: node[cls.WORLD])
        return {STAGE_KEY: cls.MERGED, cls.CONFIG: first[cls.CONFIG],
                cls.SOURCE: merge_sources([node[cls.SOURCE] for node in nodes]),
                cls.LEFTOVERS: [chunk for node in ordered for chunk in node[cls.LEFTOVER]],
                cls.COUNTS: dict(counts)}

    @classmethod
    def counts_of(cls, node: dict[str, Any]) -> dict[str, int]:
        """The packing counts of a node (a reader's or a merged one)."""
        return dict(node[cls.COUNTS])


@dataclass(frozen=True)
class MergedPack:
    """The merged state of every reader of a packed dataset, less its source's part: the old
    readers' leftovers and counts, for the epoch `epoch`."""

    epoch: int | None  # the source's, once it resumed the merged source
    leftovers: list[bytes]
    counts: dict[str, int]

    @classmethod
    def from_node(cls, node: dict[str, Any], packer: PackTokens) -> MergedPack:
        """Strict: a merged node of a dataset packed by `packer` (its source's part aside)."""
        check_node(node, PackStage.MERGED, PackStage.MERGED_KEYS, "merged packed dataset")
        PackStage.check_config(node[PackStage.CONFIG], packer)
        return cls(None, list(node[PackStage.LEFTOVERS]), dict(node[PackStage.COUNTS]))

    def deal(self, world: World) -> list[bytes]:
        """The leftovers reader `world` carries: every `readers`-th from its index on."""
        return self.leftovers[world.reader::world.readers]

