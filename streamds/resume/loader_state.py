"""A StatefulDataLoader's state goes back into a loader with the same number of workers.

torchdata's `StatefulDataLoader` keeps one dataset state per worker, so its state fits only a
loader with the `num_workers` that took it. Between two loaders with workers, each worker's
dataset refuses a state of another world (`StateMismatchError`, naming `merge_states`); between
a single-process loader (``num_workers=0``) and one with workers, torchdata fails first, with a
bare ``AssertionError``, before the dataset sees the state. `check_num_workers` says so before
loading (``ds.loader(...).load_state_dict`` calls it: ``num_workers="auto"`` gives another
count on another machine), and how to change the number of workers: merge the states
(elastic resume).
"""

from __future__ import annotations

from typing import Any

from ..errors import StateMismatchError

__all__ = ["check_num_workers", "saved_num_workers"]

_SNAPSHOT = "_snapshot"  # torchdata's keys: a loader with workers ...
_MAIN_SNAPSHOT = "_main_snapshot"
_NUM_WORKERS = "_num_workers"
_NUM_YIELDED = "_num_yielded"  # ... and a single-process loader


def saved_num_workers(state: Any) -> int:
    """The `num_workers` of the StatefulDataLoader whose `state_dict()` is `state`."""
    if isinstance(state, dict) and _SNAPSHOT in state:
        return int(state[_SNAPSHOT][_MAIN_SNAPSHOT][_NUM_WORKERS])
    if isinstance(state, dict) and _NUM_YIELDED in state:
        return 0
    raise StateMismatchError(
        "not a StatefulDataLoader state: pass the dict that loader.state_dict() returned (for a "
        "dataset's own state, use StreamingJsonl.load_state_dict)"
    )


def check_num_workers(state: Any, num_workers: int) -> None:
    """Refuse a StatefulDataLoader `state` taken with another number of workers than
    `num_workers`, naming both and the fix."""
    saved = saved_num_workers(state)
    if saved != num_workers:
        raise StateMismatchError(
            f"the loader state was taken with num_workers={saved}, but this loader has "
            f"num_workers={num_workers}; resume with num_workers={saved}, or finish the epoch "
            "with any number of workers: merged = streamds.merge_states([...]) over the "
            "loader states of every rank, then a fresh loader over "
            "dataset.with_resume(merged) (without load_state_dict)"
        )
