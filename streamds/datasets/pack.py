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
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import StateMismatchError
from ..stages.packing import PACK_COUNTERS, MergedPack, PackStage, PackTokens
from ..stages.state import (
    FORMAT,
    STATE_FORMAT,
    check_state,
    nested,
    sealed,
    stage_of,
    unnested,
)
from ..stages.transform import Step
from ..world import World, detect_world
from .base import StreamdsDataset

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
    with ``torch.utils.data.default_collate`` for stacked tensors; `.pack` is refused;
    `.cache` stores the source's records (packing runs again on them); `len()` is refused
    (the sequences' number follows the documents' token counts).
    """

    KIND = "packed"

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

    _ITEMS = "this packed dataset"

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

    def _epoch_source(self) -> StreamdsDataset:
        return self.source  # packing follows the source's epoch

    def _with_cache(self, directory: str, key: str, limit: int | None) -> Packed:
        """The source stores its records (`StreamingJsonl.cache`, `Mix.cache`) and packing
        runs on them as on the source's: the same sequences and states. The sequences are
        not stored (how records fill them depends on the reader's world), nor what this
        dataset's own `.map`/`.filter` make (refused after them)."""
        self._cache_refused_after_steps(self._steps, "packed data")
        clone = self._copy()
        clone.source = self.source.cache(directory, key=key, limit=limit)
        return clone

    def _worker_items(self, num_workers: int) -> list[int]:
        raise TypeError(
            "len() of packed data is unknown: how many sequences a reader's documents fill "
            "follows their token counts, known only by tokenizing them; pass max_steps to the "
            "trainer")

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

    def _open(self) -> Iterator[dict[str, torch.Tensor]]:
        stage = self._start(detect_world(self.rank, self.world_size))
        self._pending = self._pending_source = None  # a loaded state starts one iterator
        self._active = stage
        # -> sequences packed from the source's records (`streamds.stages.packing`); its
        # own map and filter run on whole sequences (`StreamdsDataset.__iter__`)
        return iter(stage.open(iter(self.source)))

    # -- state ---------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """The source's state plus the unused ids of the current document (O(document))."""
        if self._pending is not None:
            return sealed(self._pending.get_state(copy.deepcopy(self._pending_source)))
        stage = self._active or self._start(detect_world(self.rank, self.world_size))
        return sealed(stage.get_state(nested(self.source.state_dict())))

    def _load(self, state: dict[str, Any]) -> None:
        """A packing state; its source's state is loaded into the source now."""
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

    def _resumed(self, merged: dict[str, Any]) -> Packed:
        """The source finishes its part of `merged` and this world's readers are dealt the
        old readers' leftovers: every token once."""
        if stage_of(merged) != PackStage.MERGED or merged.get(FORMAT) != STATE_FORMAT:
            raise ValueError(
                "with_resume needs the dict streamds.merge_states() returns for the states of "
                "a packed dataset; to resume with the same world, use load_state_dict()"
            )
        found = MergedPack.from_node(merged, self.packer)
        clone = self._copy()
        clone.source = self.source.with_resume(unnested(PackStage.source_of(merged)))
        clone._merged = dataclasses.replace(found, epoch=clone.source.epoch)
        clone._pending = clone._pending_source = None
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
