"""The state and start of a reader (`StreamingJsonl`): `state_dict`, `load_state_dict`,
`with_resume`.

`ReaderCheckpoints` is the part of `StreamingJsonl` that describes where its next iterator
starts (a loaded state, a merged state, a plain-loader start, a fresh epoch:
`streamds.resume.start.Start`) and checks what is loaded against the dataset (its corpus
identity, its blocks, how it batches).
"""

from __future__ import annotations

import copy
from typing import Any, Self

from ..errors import StateMismatchError
from ..resume.identity import check_identity
from ..resume.merge import MERGED_STATE, START_KEYS
from ..resume.start import MERGED, Merged, Start, describe
from ..stages.batch import Batch
from ..stages.buckets import is_pool_state
from ..stages.state import ReaderState, refuse_other_version, stage_of
from ..world import detect_world

__all__ = ["ReaderCheckpoints"]


class ReaderCheckpoints:
    """`StreamingJsonl`'s state: `state_dict`, `load_state_dict`, `with_resume`."""

    _active: Any
    _start: Start
    _copy: Any
    _layout: Any
    _identity: Any
    _plan: Any
    _batch: Any
    _epoch: Any
    rank: int | None
    world_size: int | None
    epoch: int

    def _resumed(self, merged: dict[str, Any]) -> Self:
        """A copy that starts from `merged` (from `streamds.merge_states`)."""
        clone = self._copy()
        clone._start = Start(MERGED, Merged(clone._check_merged(merged)))
        return clone

    def _state(self) -> dict[str, Any]:
        """The reader's state (`ReaderState.to_dict`). O(1) to take: positions of buffered
        records are packed once per buffer's worth of records (see
        `streamds.stages.shuffle`), never per call. Before the first `iter()`, the start as
        described (`streamds.resume.start.describe`)."""
        if self._active is not None:
            return self._active.reader_state().to_dict()
        world = detect_world(self.rank, self.world_size)
        return describe(self._start, self._layout(), self.epoch, world)

    def _load(self, state: dict[str, Any]) -> None:
        """A reader's state, checked against this dataset's corpus, blocks and batching.

        A state taken after its epoch ran out leaves the epoch as it is: the next iterator of
        that same epoch yields nothing (it is finished), and any other epoch (`set_epoch`,
        before or after loading) starts at its beginning, as an uninterrupted run would. A
        merged state (what `state_dict()` returns before the first `iter()` of a dataset that
        finishes one) loads as `with_resume` takes it.
        """
        if stage_of(state) == MERGED_STATE:
            self._active = None
            self._start = Start(MERGED, Merged(self._check_merged(state)))
            return
        loaded = ReaderState.from_dict(state)
        check_identity(loaded.fingerprint, self._identity, "the state")
        if loaded.plan[0] != self._plan.num_blocks:
            raise StateMismatchError(
                f"the state was taken with the corpus cut into {loaded.plan[0]} blocks, but "
                f"this dataset cuts it into {self._plan.num_blocks} (another streamds "
                "version?); finish the epoch with the version that took the state, or "
                "restart the epoch"
            )
        if loaded.pipeline is not None:
            made, taking = _batching(loaded.pipeline), self._batching()
            if made != taking:
                raise StateMismatchError(
                    f"the state was taken from a dataset {made} but is loaded into one "
                    f"{taking}; build the dataset the same way (streamds.merge_states() of it "
                    "resumes a dataset batched any way)"
                )
        self._active = None
        if not loaded.finished:
            self.epoch = loaded.epoch
        self._start = self._start.load(copy.deepcopy(loaded))
        self._epoch.loaded = self._start.loaded

    def _epoch_of_state(self, state: dict[str, Any]) -> tuple[int, bool]:
        """(epoch, finished) of a state this dataset's `state_dict()` returned (a reader's, or
        the merged state a resumed reader starts from), for a stage built on this one."""
        if stage_of(state) == MERGED_STATE:
            return state["epoch"], False
        loaded = ReaderState.from_dict(state)
        return loaded.epoch, loaded.finished

    def _batching(self) -> str:
        """How this dataset batches, in the words of `_batching(pipeline state)`."""
        if self._batch is None:
            return "without .batch()"
        return "with .batch(n)" if self._batch.rule is None else "with .batch(rule)"

    def _check_merged(self, merged: dict[str, Any] | None) -> dict[str, Any] | None:
        if merged is None:
            return None
        if isinstance(merged, dict):
            refuse_other_version(merged)
        if stage_of(merged) != MERGED_STATE:
            raise ValueError(
                "with_resume needs the dict streamds.merge_states() returns; to resume with "
                "the same world, use load_state_dict() instead"
            )
        check_identity(merged["fingerprint"], self._identity, "the merged state")
        self.epoch = merged["epoch"]
        # a reader's start (state_dict() before iter()) loads as the merged state it names
        return {key: copy.deepcopy(value) for key, value in merged.items()
                if key not in START_KEYS}


def _batching(pipeline: dict[str, Any]) -> str:
    """How the dataset that took a pipeline state batched."""
    if is_pool_state(pipeline):
        return "with .batch(rule)"
    return "with .batch(n)" if Batch.owns(pipeline) else "without .batch()"
