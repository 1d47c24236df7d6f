"""`ReaderState`: everything one reader needs to start, in one typed, versioned object.

Every way of starting a reader produces one: a fresh epoch, `load_state_dict` (the only way
in from a checkpoint), a share of a merged state (elastic resume), or a plain DataLoader's
batch count (`resume_after_batches`). The dataset has one code path from a `ReaderState` to
a running pipeline.

Dict form (``state_dict()``)::

    {"format": "streamds.reader/3",
     "fingerprint": {...},                     # the corpus and settings (`resume.identity`)
     "epoch": int,
     "world": [rank, world_size, worker, num_workers],
     "plan": [num_blocks, seed, shuffle],      # to derive the reader's work
     "seat": [rank, worker],                   # whose share and shuffle seed it reads
     "work": [[block, start], ...] | None,     # explicit work (elastic resume); None: derived
     "prefill": [[block, offset], ...],        # buffered records carried from another world
     "carried": {counter: n},                  # counts carried from another world
     "quota": int | None,                      # records to yield under even_ranks
     "finished": bool,                         # the epoch's iterator ran out
     "pipeline": <nested stage state> | None}  # None: not started

The pipeline state nests like the pipeline: [after-buffer map and filter <-] shuffle (or
records) <- even ranks <- transform <- parse <- lines (a shuffling reader without even_ranks
runs its steps after the buffer: `streamds.stages.pipeline`). Loading is strict: a missing or
unknown key, or another format, fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import StateMismatchError
from ..world import World
from .chunks import Position, WorkItem

__all__ = [
    "BATCHER_FORMAT",
    "OLD_FORMATS",
    "REBATCH_FORMAT",
    "STATE_FORMAT",
    "ReaderState",
    "check_epoch_change",
    "check_state",
]

STATE_FORMAT = "streamds.reader/3"
# the batchers of `streamds.train` keep their states in these formats; they live here, below
# resume/, so that the merge can tell them apart without importing the training layer
BATCHER_FORMAT = "streamds.batches/2"  # `streamds.datasets.batching`
REBATCH_FORMAT = "streamds.rebatch/1"  # `streamds.train.rebatch.Rebatch`
# formats of earlier versions, refused with the reason
_OLD_REASONS = {
    "streamds.state/1": "written by streamds 0.1",
    "streamds.reader/2": "written by an earlier streamds version, whose states named the "
                         "files by absolute path (this one names them relative to the source "
                         "root, so that states survive moving the files)",
}
OLD_FORMATS = tuple(_OLD_REASONS)
_KEYS = ("format", "fingerprint", "epoch", "world", "plan", "seat", "work", "prefill", "carried",
         "quota", "finished", "pipeline")


@dataclass
class ReaderState:
    fingerprint: dict[str, Any]  # the corpus and settings (`streamds.resume.identity`)
    epoch: int
    world: World
    plan: tuple[int, int, bool]  # (num_blocks, seed, shuffle)
    seat: tuple[int, int] | None = None  # (rank, worker) whose share it reads; None: own
    work: list[WorkItem] | None = None
    prefill: list[Position] = field(default_factory=list)
    carried: dict[str, int] = field(default_factory=dict)
    quota: int | None = None
    finished: bool = False
    pipeline: dict[str, Any] | None = None

    @property
    def started(self) -> bool:
        return self.pipeline is not None

    @property
    def share(self) -> World:
        """The world whose share of the plan (and shuffle seed) this reader reads: its own,
        or another worker's after a plain-loader resume rotated the workers."""
        if self.seat is None:
            return self.world
        rank, worker = self.seat
        return World(rank, self.world.world_size, worker, self.world.num_workers)

    def to_dict(self) -> dict[str, Any]:
        w = self.world
        return {
            "format": STATE_FORMAT, "fingerprint": self.fingerprint, "epoch": self.epoch,
            "world": [w.rank, w.world_size, w.worker, w.num_workers], "plan": list(self.plan),
            "seat": [self.share.rank, self.share.worker],
            "work": None if self.work is None else [list(item) for item in self.work],
            "prefill": [list(p) for p in self.prefill], "carried": dict(self.carried),
            "quota": self.quota, "finished": self.finished, "pipeline": self.pipeline,
        }

    @classmethod
    def from_dict(cls, state: Any) -> ReaderState:
        """Strict: the dict `to_dict` made, of this format, with exactly its keys."""
        if not isinstance(state, dict) or "format" not in state:
            raise StateMismatchError(
                f"not a streamds state (format {STATE_FORMAT!r} expected); pass the dict that "
                "state_dict() returned"
            )
        if state["format"] in OLD_FORMATS:
            raise StateMismatchError(
                f"this state has format {state['format']!r}, {_OLD_REASONS[state['format']]}; "
                f"this version reads {STATE_FORMAT!r} only. Finish the epoch with the version "
                "that took the state, or restart the epoch (its records are not lost, only "
                "re-read)"
            )
        if state["format"] != STATE_FORMAT:
            raise StateMismatchError(
                f"unknown state format {state['format']!r}; this version reads "
                f"{STATE_FORMAT!r}; pass the dict that state_dict() returned"
            )
        missing = [key for key in _KEYS if key not in state]
        unknown = sorted(set(state) - set(_KEYS))
        if missing or unknown:
            raise StateMismatchError(
                f"damaged streamds state: missing keys {missing}, unknown keys {unknown}; "
                "pass the dict that state_dict() returned, unchanged"
            )
        num_blocks, seed, shuffle = state["plan"]
        return cls(
            fingerprint=state["fingerprint"], epoch=state["epoch"], world=World(*state["world"]),
            plan=(num_blocks, seed, shuffle), seat=(state["seat"][0], state["seat"][1]),
            work=None if state["work"] is None else [(b, s) for b, s in state["work"]],
            prefill=[(b, o) for b, o in state["prefill"]], carried=dict(state["carried"]),
            quota=state["quota"], finished=state["finished"], pipeline=state["pipeline"],
        )


def check_epoch_change(
    pending: dict[str, Any] | ReaderState | None, epoch: int, *, or_else: str = ""
) -> None:
    """Refuse `set_epoch(epoch)` while a loaded state (a reader's, or a dict with its "epoch"
    and whether it "finished") is in the middle of another epoch; `or_else`: another fix."""
    if pending is None:
        return
    if isinstance(pending, ReaderState):
        loaded, finished = pending.epoch, pending.finished
    else:
        loaded, finished = pending["epoch"], pending["finished"]
    if not finished and loaded != epoch:
        raise ValueError(
            f"set_epoch({epoch}): the loaded state is in the middle of epoch {loaded}; "
            f"iterate to finish that epoch first{f' ({or_else})' if or_else else ''}"
        )


def check_state(state: Any, kind: str, keys: frozenset[str], what: str) -> None:
    """Strict loading of a mix, packed or rebatch state: format `kind` with exactly `keys`."""
    if not isinstance(state, dict) or state.get("format") != kind:
        raise StateMismatchError(
            f"not a streamds {what} state (format {kind!r} expected); pass the dict that "
            f"state_dict() of the {what} returned"
        )
    if set(state) != keys:
        raise StateMismatchError(
            f"damaged {what} state: missing keys {sorted(keys - set(state))}, unknown keys "
            f"{sorted(set(state) - keys)}; pass the dict that state_dict() returned"
        )
