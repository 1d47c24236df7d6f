"""What streamds reads of a torchdata StatefulDataLoader's state: the one module that names
its private keys (torchdata offers no public way to ask a saved state how many workers took
it, or how old its worker states are), so a change in torchdata's layout is fixed here.

A StatefulDataLoader's state goes back into a loader with the same number of workers.

torchdata's `StatefulDataLoader` keeps one dataset state per worker, so its state fits only a
loader with the `num_workers` that took it. Between two loaders with workers, each worker's
dataset refuses a state of another world (`StateMismatchError`, naming `merge_states`); between
a single-process loader (``num_workers=0``) and one with workers, torchdata fails first, with a
bare ``AssertionError``, before the dataset sees the state. `check_num_workers` says so before
loading (``ds.loader(...).load_state_dict`` calls it: ``num_workers="auto"`` gives another
count on another machine), and how to change the number of workers: merge the states
(elastic resume).

`merge_states` (the public one) refuses a loader state taken between snapshots
(`steps_since_snapshot`) before the states are merged (`streamds.resume.merge`).

After an epoch: torchdata's loader keeps each worker's state as of the last batch the loader
yielded. A worker whose records fill whole batches reads the lines after its last batch (lines
skipped, records filtered out) only when asked for one more, and its state after that (sent
with its StopIteration) updates the loader's live worker states but no snapshot: no batch
follows. `StatefulLoader` (what `stateful_loader`, ``ds.loader`` and `StreamdsLoader` build)
returns, once its epoch ran out, every worker's state at its end (`state_after_epoch`), so
`counts_of` counts the whole epoch; for a state of torchdata's own loader in which a worker's
end is not shown, `counts_of` says so instead of counting short.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from ..errors import StateMismatchError
from ..resume import merge, totals
from ..stages.mixing import MixStage
from ..stages.state import find_nodes

__all__ = ["check_num_workers", "counts_of", "merge_states", "saved_num_workers",
           "state_after_epoch", "stateful_loader_class", "steps_since_snapshot",
           "worker_of_last_batch"]

_SNAPSHOT = "_snapshot"  # torchdata's keys: a loader with workers ...
_MAIN_SNAPSHOT = "_main_snapshot"
_NUM_WORKERS = "_num_workers"
_STEPS_SINCE_SNAPSHOT = "_steps_since_snapshot"  # batches yielded since the worker snapshots
_LAST_YIELDED_WORKER_ID = "_last_yielded_worker_id"  # the worker of the batch yielded last
_NUM_YIELDED = "_num_yielded"  # ... and a single-process loader
_ITERATOR_FINISHED = "_iterator_finished"  # the epoch's iterator ran out
_SNAPSHOT_STEP = "_snapshot_step"  # batches yielded when the snapshot was taken
_WORKER_SNAPSHOTS = "_worker_snapshots"  # worker key -> that worker's state (and the
# attribute of the loader's iterator holding each worker's latest state, snapshot or not)
_FETCHER_STATE = "fetcher_state"  # a worker's state: its fetcher's ...
_FETCHER_ENDED = "fetcher_ended"  # ... flag that its dataset iterator ran out (set by torch
# when batch_size is set; never when batch_size=None)
_DATASET_STATE = "dataset_state"


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


def worker_of_last_batch(state: Any) -> int | None:
    """The worker that made the batch a StatefulDataLoader yielded last, from its
    `state_dict()` taken just after it (0 without workers: the main process's one reader);
    None for a state of another loader. torchdata keeps it under a private key (and it is
    the maker whichever workers ran out on the way: exhausted workers are skipped in order)."""
    if isinstance(state, dict) and _SNAPSHOT in state:
        worker = state[_SNAPSHOT].get(_LAST_YIELDED_WORKER_ID)
        return worker if isinstance(worker, int) else None
    if isinstance(state, dict) and _NUM_YIELDED in state:
        return 0
    return None


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


def _nested_dicts(found: Any, *, inside: Any = None) -> Iterator[dict[str, Any]]:
    """Every dict nested anywhere in `found` (in dicts, lists, tuples), outer first; not
    looking inside a dict for which `inside(it)` is false."""
    if isinstance(found, dict):
        yield found
        if inside is not None and not inside(found):
            return
        values: Any = found.values()
    elif isinstance(found, (list, tuple)):
        values = found
    else:
        return
    for value in values:
        yield from _nested_dicts(value, inside=inside)


def steps_since_snapshot(found: Any) -> Iterator[int]:
    """For every StatefulDataLoader state nested anywhere in `found` (a list of them, a dict
    holding them), the batches it yielded after the worker states it holds were taken: more
    than 0 when it was saved between snapshots (``snapshot_every_n_steps`` > 1). torchdata
    keeps that count under a private key and offers no public way to ask for it."""
    for node in _nested_dicts(found):
        since = node.get(_STEPS_SINCE_SNAPSHOT)
        if isinstance(since, int):
            yield since


def merge_states(states: Any) -> dict[str, Any]:
    """One world-independent state from the states of every reader of one epoch: the
    `state_dict()` of each rank's StatefulDataLoader (or of each dataset), in a list (see
    `streamds.resume.merge.merge_states`). Refuses a loader state taken between its snapshots
    (``snapshot_every_n_steps`` > 1): its workers' states are that many batches old, and
    only the loader itself replays the batches since; merging would read them again."""
    since = max(steps_since_snapshot(states), default=0)
    if since:
        raise ValueError(
            f"merge_states cannot use a StatefulDataLoader state taken {since} batches "
            "after its last snapshot (snapshot_every_n_steps > 1): the reader states in "
            "it are that old, so the batches since would be read again; for an elastic "
            "resume save the states at a step that is a multiple of "
            "snapshot_every_n_steps, or resume in the same world with load_state_dict()"
        )
    return merge.merge_states(states)


def state_after_epoch(loader: Any, state: Any) -> Any:
    """`state`, the `state_dict()` of the StatefulDataLoader `loader` with workers, with every
    worker's state at its end once the epoch ran out: the state each worker sent with its
    StopIteration, which torchdata applies to its live worker states but puts in no snapshot
    when no batch follows. Each is marked ended (torch marks it only when batch_size is set),
    and the snapshot stands after the last batch (none to replay: with
    ``snapshot_every_n_steps`` > 1 it stood at the last snapshot). `state` as it is
    mid-epoch or without workers.
    """
    iterator = getattr(loader, "_iterator", None)
    latest = getattr(iterator, _WORKER_SNAPSHOTS, None)
    if (not isinstance(state, dict) or _SNAPSHOT not in state or not latest
            or state.get(_ITERATOR_FINISHED) is not True):
        return state
    ends = {}
    for key, worker in latest.items():
        end = worker.get_state()  # a new dict: the loader's own stay as they are
        if isinstance(end.get(_FETCHER_STATE), dict):
            end[_FETCHER_STATE][_FETCHER_ENDED] = True
        ends[key] = end
    snapshot = state[_SNAPSHOT]
    return {**state, _STEPS_SINCE_SNAPSHOT: 0, _SNAPSHOT: {
        **snapshot, _WORKER_SNAPSHOTS: ends,
        _SNAPSHOT_STEP: snapshot[_SNAPSHOT_STEP] + state[_STEPS_SINCE_SNAPSHOT],
        _LAST_YIELDED_WORKER_ID: getattr(iterator, _LAST_YIELDED_WORKER_ID,
                                         snapshot[_LAST_YIELDED_WORKER_ID])}}


@functools.cache
def stateful_loader_class() -> type:
    """`StatefulLoader`: torchdata's StatefulDataLoader, whose `state_dict()` after an epoch
    holds every worker's state at its end (`state_after_epoch`)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    class StatefulLoader(StatefulDataLoader):
        __doc__ = StatefulDataLoader.__doc__

        def state_dict(self) -> dict[str, Any]:
            return state_after_epoch(self, super().state_dict())

    return StatefulLoader


def _finished_loader_states(found: Any) -> Iterator[dict[str, Any]]:
    """Every state of a StatefulDataLoader with workers whose epoch ran out, nested anywhere
    in `found`."""
    def finished(node: dict[str, Any]) -> bool:
        return _SNAPSHOT in node and node.get(_ITERATOR_FINISHED) is True

    return (node for node in _nested_dicts(found, inside=lambda node: not finished(node))
            if finished(node))


def _end_unshown(worker: Any) -> bool:
    """A worker's state in a finished loader's snapshot that may be from before the worker's
    end: torch does not say its iterator ended, nor does every reader in it (each ran out, or
    the mix it feeds had ended)."""
    if not isinstance(worker, dict):
        return False
    fetcher = worker.get(_FETCHER_STATE)
    if isinstance(fetcher, dict) and fetcher.get(_FETCHER_ENDED) is True:
        return False
    return not totals.readers_ended(worker.get(_DATASET_STATE))


def _holds_mix(worker: Any) -> bool:
    return isinstance(worker, dict) and any(
        find_nodes(worker.get(_DATASET_STATE), (MixStage.STAGE,)))


def counts_of(state: Any) -> dict[str, int]:
    """The counters of every reader state found in `state`, summed: "bad" (malformed lines
    skipped under on_error="skip"), "corrupt_blocks", "blank" and "dropped" (records a map or
    filter removed). `state`: a dataset's, batcher's or loader's `state_dict()`, a list of
    every rank's, or a merged state (`streamds.resume.totals.counts_of` says how far a state
    taken mid-epoch counts).

    After an epoch the counts hold every line read (a stop="first" mix's sources that had not
    run out: up to where they would resume). Refused (ValueError naming the fix): the
    state of torchdata's own StatefulDataLoader after its epoch that holds a worker's state
    from its last batch, before the lines after that batch (counted where the worker's state
    shows its end: torch marks its fetcher ended, every reader ran out, or the mix it feeds
    had ended); the loaders streamds builds keep each worker's end.

    Example::

        loader = ds.loader(32, num_workers=2)
        for batch in loader: ...
        print(streamds.counts_of(loader.state_dict()))  # {"bad": 3, "blank": 0, ...}
    """
    for loader_state in _finished_loader_states(state):
        workers = loader_state[_SNAPSHOT].get(_WORKER_SNAPSHOTS) or {}
        unshown = [key for key, worker in workers.items() if _end_unshown(worker)]
        if unshown:
            mix = ("; a streamds.Mix reads on after its last record: the next draw reads the "
                   "drawn source's last lines until it runs out, and a state shows that only "
                   "where a short last batch (of .batch or .pack) follows"
                   if any(_holds_mix(workers[key]) for key in unshown) else "")
            raise ValueError(
                f"counts_of cannot count this StatefulDataLoader's epoch exactly: it ended, but "
                f"its state holds each of {', '.join(sorted(unshown))} as of the last batch it "
                "made, not the lines it read after that batch (skipped or filtered out), which "
                "torchdata's StatefulDataLoader keeps in no state when no batch follows"
                f"{mix}; build the loader with streamds.stateful_loader(...) or ds.loader(...) "
                "(their state after an epoch holds every worker's end), or read each worker's "
                "'epoch N done' log line"
            )
    return totals.counts_of(state)
