"""Packing: tokenized records -> sequences of exactly `seq_len` tokens, no padding between.

`PackTokens` says how (`seq_len`, the separator `eos_id`, where the ids are); `Packed` is the
dataset over a `StreamingJsonl` or a `Mix` (``ds.pack(PackTokens(...))``) that runs a
`streamds.stages.packing.PackStage` in each reader. Each sequence is a dict of LongTensors:

- ``input_ids``: the tokens;
- ``position_ids``: 0, 1, 2, ... restarting at each document (and at the start of a sequence,
  where the rest of a split document continues);
- ``document_ids``: the index of each token's document within the sequence (-1 on padding),
  so attention can stay within documents (`document_mask` turns it into a mask).

Only the last sequence of an epoch can be short: padded with `pad_id` (or dropped with
``drop_last=True``). Counts (``.counts``, `streamds.token_counts(state)`): documents, tokens
read (with separators), tokens packed, padding added, tokens dropped.

State: the packing stage's node (its source's state nested, the unused ids of the document the
last sequence ended in, the counts) with the format version at the top; see
`streamds.stages.packing`. After an elastic merge (`streamds.merge_states`), the leftovers of
every old reader are dealt to the new ones.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..errors import StateMismatchError
from ..stages.packing import PACK_COUNTERS, MergedPack, PackStage, PackTokens
from ..stages.state import (
    FORMAT,
    STATE_FORMAT,
    check_state,
    nested,
    refuse_other_version,
    sealed,
    stage_of,
    unnested,
)
from ..stages.transform import Step, apply_steps
from ..world import World, detect_world
from .base import StreamdsDataset

if TYPE_CHECKING:
    from ..stages.buckets import Rule
    from .batching import Batched

__all__ = ["PackTokens", "Packed", "document_mask"]


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool mask [..., L, L]: token q may attend to token k when both are in the same
    document (not padding) and k <= q (causal)."""
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    length = document_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    real = (document_ids >= 0).unsqueeze(-1)
    return same & causal & real


class Packed(StreamdsDataset):
    """Records of a `StreamingJsonl` or `Mix` -> packed sequences (see the module doc).

    Resume exactly with `state_dict()`/`load_state_dict()` (torchdata's StatefulDataLoader),
    elastically with ``packed.with_resume(streamds.merge_states(states))``. A loaded state
    whose source had finished another epoch than the source's now starts that epoch afresh.
    `.map` / `.filter` apply to whole sequences (e.g. to add an attention mask; tokens of a
    dropped sequence still count as packed); `.batch(n, collate=...)` batches them, e.g.
    with ``torch.utils.data.default_collate`` for stacked tensors; `.pack` is refused.
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
        self._pending: PackStage | None = None  # a loaded state, for the next iterator
        self._pending_source: Any = None  # the source's node in it
        self._merged: MergedPack | None = None  # leftovers of an elastic resume
        self._active: PackStage | None = None
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
        """The packed sequences in whole batches, as ``StreamingJsonl.batch``: `size` sequences
        per batch or a ``streamds.LengthBuckets`` / ``TokenBudget`` rule; `collate` makes
        the batch (None: a `streamds.RecordBatch`). Use it with ``DataLoader(ds.batch(n,
        collate=...), batch_size=None)``; a state taken after any batch resumes exactly."""
        from .batching import Batched

        return Batched(self, size, collate=collate, drop_last=drop_last)

    def pack(self, packer: PackTokens) -> Packed:
        """Refused: packed data is packed already (its sequences join several documents by
        `eos_id`, so packing them again would cut documents at no separator)."""
        raise ValueError(
            f"pack({packer!r}): this dataset is packed already (sequences of "
            f"{self.packer.seq_len} tokens, documents joined by eos_id={self.packer.eos_id}); "
            "packing its sequences again would join documents without a separator. Pack the "
            "source once with the settings you want: source.pack(PackTokens(seq_len=...))"
        )

    # -- iteration -----------------------------------------------------------------------

    def _start(self, world: World) -> PackStage:
        """Where reader `world` starts: a loaded state, else its deal of a merged state's
        leftovers, else nothing. Reads them without using them up (`state_dict` asks too)."""
        pending = self._pending
        if pending is not None:
            epoch, finished = _epoch_of(self.source, unnested(self._pending_source))
            if finished and epoch != self.source.epoch:
                pending = None  # that epoch is over and another was chosen: start it afresh
        if pending is not None:
            if pending.world != world:
                raise StateMismatchError(
                    f"the packed state was taken by reader (rank, world_size, worker, "
                    f"num_workers)={_tuple(pending.world)} but is loaded by {_tuple(world)}; "
                    "resume with the same world, or merge the states of all readers with "
                    "streamds.merge_states() and resume with packed.with_resume(merged)"
                )
            return copy.deepcopy(pending)  # after an elastic resume it holds what was dealt
        stage = PackStage(self.packer, world)
        if self._merged is not None and self._merged.epoch == self.source.epoch:
            stage.start_merged(self._merged)  # this reader's deal of the old leftovers
        return stage

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        stage = self._start(detect_world(self.rank, self.world_size))
        self._pending = self._pending_source = None  # a loaded state starts one iterator
        self._active = stage
        # -> sequences packed from the source's records (`streamds.stages.packing`)
        sequences = iter(stage.open(iter(self.source)))
        # -> its own map and filter, on whole sequences (a state between them stays exact)
        return apply_steps(sequences, self._steps, "this packed dataset") if self._steps else (
            sequences)

    def _with_step(self, step: Step) -> Packed:
        clone = copy.copy(self)
        clone._steps = (*self._steps, step)
        clone._active = None
        return clone

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The source's state plus the unused ids of the current document (O(document))."""
        if self._pending is not None:
            return sealed(self._pending.get_state(copy.deepcopy(self._pending_source)))
        stage = self._active or self._start(detect_world(self.rank, self.world_size))
        return sealed(stage.get_state(nested(self.source.state_dict())))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` at the next `iter()`; refuses a state of another packing."""
        check_state(state, PackStage.STAGE, PackStage.KEYS, "packed dataset")
        stage = PackStage(self.packer, PackStage.world_of(state))
        stage.reset(state)
        source = PackStage.source_of(state)
        self.source.load_state_dict(unnested(source))
        self._active = None
        self._pending, self._pending_source = stage, copy.deepcopy(source)

    def _epoch_of_state(self, state: dict[str, Any]) -> tuple[int, bool]:
        """(epoch, finished) of a state of this dataset: its source's."""
        return _epoch_of(self.source, unnested(PackStage.source_of(state)))

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
            refuse_other_version(merged)
        if stage_of(merged) != PackStage.MERGED or merged.get(FORMAT) != STATE_FORMAT:
            raise ValueError(
                "with_resume needs the dict streamds.merge_states() returns for the states of "
                "a packed dataset; to resume with the same world, use load_state_dict()"
            )
        found = MergedPack.from_node(merged, self.packer)
        clone = copy.copy(self)
        clone.source = self.source.with_resume(unnested(PackStage.source_of(merged)))
        clone._merged = dataclasses.replace(found, epoch=clone.source.epoch)
        clone._pending = clone._pending_source = None
        clone._active = None
        return clone


def _epoch_of(source: Any, state: Any) -> tuple[int, bool]:
    """(epoch, finished) of a state of `source`: streamds datasets tell it from their own
    states; any other source's state holds them as "epoch" and "finished" (its protocol)."""
    own = getattr(source, "_epoch_of_state", None)
    if own is not None:
        return own(state)
    return state["epoch"], state["finished"]


def _tuple(world: World) -> tuple[int, int, int, int]:
    return (world.rank, world.world_size, world.worker, world.num_workers)
