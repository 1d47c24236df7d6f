"""`StreamdsLoader`: a torchdata StatefulDataLoader whose state is every rank's, for frameworks
that save one object's state from rank 0 (Lightning's checkpoint, accelerate's
`register_for_checkpointing`).

`state_dict()` runs on every rank while a checkpoint is written in both frameworks, so it
gathers every rank's state there (`all_gather_object`, a collective call); `load_state_dict`
gives each rank its own, or, under another world size, the states merged by
`streamds.merge_states`, from which the dataset finishes their epoch (elastic resume).
It keeps the state after each batch it hands out, so a framework that fetches ahead of
training can ask for the state after the last batch trained (`trained`).

`stateful_loader(dataset, **options)` is torchdata's `StatefulDataLoader(dataset, **options)`
built without the deprecation warning that torchdata's own constructor triggers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from ..errors import StateMismatchError
from ..train.loader import stateful_loader, stop_workers, torchdata_set_vital_ignored
from ..train.loader_state import stateful_loader_class
from . import require

require("torchdata.stateful_dataloader")  # an ImportError naming the package where missing

__all__ = ["RANKS", "StreamdsLoader", "stateful_loader"]

RANKS = "streamds_ranks"  # key of the gathered states: one loader state per rank, by rank
COUNTS_BATCHES = "counts_streamds_batches"  # set on StreamdsCallback (Lightning)
_LIGHTNING = ("lightning.pytorch", "pytorch_lightning")


def _lightning_trainer() -> Any:
    """The Lightning Trainer whose loop is iterating a loader now, or None: its fit loop (the
    `self` of a frame in Lightning's loops, with a `trainer`) is up the call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(_LIGHTNING):
            trainer = getattr(frame.f_locals.get("self"), "trainer", None)
            if hasattr(trainer, "callbacks"):
                return trainer
        frame = frame.f_back
    return None


def _missing_lightning_callback() -> ValueError | None:
    """The error for iteration by a Lightning Trainer without `StreamdsCallback`: Lightning
    never calls set_epoch on an IterableDataset (every epoch would repeat epoch 0's order) and
    fetches a batch ahead of training (a checkpoint would count it as trained, and a resume
    would lose it); only the callback does both right."""
    trainer = _lightning_trainer()
    if trainer is None or any(getattr(c, COUNTS_BATCHES, False) for c in trainer.callbacks):
        return None
    return ValueError(
        "StreamdsLoader under a Lightning Trainer needs StreamdsCallback: without it every "
        "epoch repeats epoch 0's order and a checkpoint counts the batch Lightning fetched "
        "ahead as trained; pass lightning.Trainer(..., callbacks=[StreamdsCallback()]) "
        "(from streamds.integrations.lightning import StreamdsCallback)"
    )

def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class StreamdsLoader(stateful_loader_class()):  # type: ignore[misc]
    """A `StatefulDataLoader` whose state holds every rank's state after its last batch
    trained: the last batch handed out, unless `trained` (batches of the current epoch's
    iterator) says fewer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with torchdata_set_vital_ignored():
            super().__init__(*args, **kwargs)
        self._after: dict[int, dict[str, Any]] = {}  # batches handed out -> state after them
        self._handed = 0
        self.trained: int | None = None

    def __iter__(self) -> Iterator[Any]:
        # raised at the first batch: Lightning's teardown after an error in iter() itself
        # hides it behind its own ("Please call `iter(combined_loader)` first")
        refused = _missing_lightning_callback()
        iterator = super().__iter__()
        self._handed = 0
        self.trained = None if self.trained is None else 0
        self._after = {0: super().state_dict()}
        return self._keep_states(iterator, refused)

    def _keep_states(self, iterator: Iterator[Any],
                     refused: Exception | None = None) -> Iterator[Any]:
        if refused is not None:
            stop_workers(self)
            raise refused
        try:
            for batch in iterator:
                self._handed += 1
                self._after[self._handed] = super().state_dict()
                behind = self._handed - 2 if self.trained is None else self.trained
                for old in [n for n in self._after if n < behind]:
                    del self._after[old]  # only the batches ahead of training are kept
                yield batch
        except Exception:
            stop_workers(self)  # the epoch failed: its workers stop now (see stop_workers)
            raise
        # the epoch ran out: the state after the last batch may not say so yet (a reader whose
        # records fill whole batches is done only when asked for one more), so keep the state
        # taken now; loaded, it would otherwise restart this epoch instead of the next
        self._after[self._handed] = super().state_dict()

    def own_state_dict(self) -> dict[str, Any]:
        """This rank's state after its last batch trained."""
        if not self._after:
            return super().state_dict()
        done = self._handed if self.trained is None else min(self.trained, self._handed)
        return self._after[done]

    def state_dict(self) -> dict[str, Any]:
        """Every rank's `own_state_dict()`, gathered (a collective call under DDP)."""
        import torch.distributed as dist

        own = self.own_state_dict()
        _, size = _world()
        states: list[Any] = [own]
        if size > 1:
            states = [None] * size
            dist.all_gather_object(states, own)
        return {RANKS: states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's own state in the same world, else the merged states of all ranks (the
        dataset then finishes their epoch under this world)."""
        from ..train.loader_state import merge_states

        if not isinstance(state_dict, dict) or RANKS not in state_dict:
            raise StateMismatchError(
                f"not a StreamdsLoader state (no {RANKS!r} key; it holds "
                f"{_keys(state_dict)}): pass the dict that StreamdsLoader.state_dict() "
                "returned; a plain StatefulDataLoader's or ds.loader(...)'s state goes back "
                "into a loader of that kind, a dataset's own into dataset.load_state_dict"
            )
        states = state_dict[RANKS]
        rank, size = _world()
        if len(states) == size:
            super().load_state_dict(states[rank])
            return
        resumed = self.dataset.with_resume(merge_states(states))
        vars(self.dataset).update(vars(resumed))  # the loader keeps its dataset object


def _keys(state: Any) -> str:
    """What a state holds, for an error: its first keys, or its type."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}"
    keys = sorted(map(str, state))
    return "keys " + ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")
