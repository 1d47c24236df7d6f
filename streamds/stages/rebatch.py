"""Rebatch: a loader's big batches -> training batches, cut in the main process.

Workers hand batches over fastest when a message is large (~300 KB: ``ds.batch(2048)`` of
~130-byte records), and torchdata's StatefulDataLoader pays its state bookkeeping once per
batch. A training step often wants far fewer records. `Rebatch` takes the big batches of a
loader (``DataLoader(ds.batch(2048), batch_size=None, ...)``) and yields `batch_size`-record
training batches from them, in order, each record exactly once; a short batch at a seam is
filled from the next big batch, so only the last batch of an epoch is short.

State: where the first record not yet yielded sits: the loader's state before the big batch
that holds it, how many of that batch's records were yielded already, and which of the
loader's workers made that batch. Loading it loads the loader's state, and the first big batch
the loader yields again has its first `skip` records dropped. That is exact whenever the loader
resumes exactly (StatefulDataLoader over a streamds dataset does, with any number of workers).
An elastic merge (`streamds.merge_states`) counts the records of the big batches held here as
not yet read, and the `skip` records as read by the reader of worker `made_by`
(`handed_after`).

State node: ``{"stage": "rebatch", "loader": <the loader's state>, "skip": n,
"made_by": worker or None}`` with the format version at the top. It lives with the stages
(below the merge, which asks it `handed_after`); `streamds.train.rebatch` gives it the
worker of each big batch from torchdata's loader state, and names it for training code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..checks import check_bool, check_int
from ..errors import StateMismatchError
from .batch import RecordBatch
from .state import FORMAT, check_state, sealed
from .state import STAGE as STAGE_KEY

__all__ = ["Rebatch"]



def _records_of(batch: Any) -> list[Any]:
    """The records of one big batch: a `RecordBatch` (``ds.batch(n)``) or a list."""
    if isinstance(batch, RecordBatch):
        return batch.records
    if isinstance(batch, list):
        return batch
    raise TypeError(
        f"Rebatch cuts lists of records, and the loader yielded a {type(batch).__name__}; "
        "give the loader big batches of records (ds.batch(n) without a collate, "
        "batch_size=None) and pass the collate to Rebatch(..., collate=...) instead"
    )


class Rebatch:
    """Training batches of `batch_size` records cut from `loader`'s bigger batches.

    ``Rebatch(StatefulDataLoader(ds.batch(2048), batch_size=None, num_workers=2), 32)``:
    iterate it as the loader; `collate` (in the main process) turns each list of records
    into what the model takes; `drop_last` drops the short batch at the end of an epoch.
    `state_dict()` / `load_state_dict()` need a loader that has them (torchdata's
    StatefulDataLoader), and resume after any training batch. Checkpoint this object's
    state, not the loader's: the loader's alone would lose the records held here.
    """

    STAGE = "rebatch"
    LOADER = "loader"  # the loader's state before the big batch holding the next record
    SKIP = "skip"  # records of that big batch already yielded
    MADE_BY = "made_by"  # the loader's worker that made that big batch (None: not known)
    KEYS = frozenset({FORMAT, STAGE_KEY, LOADER, SKIP, MADE_BY})

    def __init__(
        self,
        loader: Iterable[Any],
        batch_size: int,
        *,
        collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> None:
        check_int("batch_size", batch_size, 1, "pass the number of records a training batch holds")
        check_bool("drop_last", drop_last)
        if isinstance(loader, Iterator):
            raise ValueError(
                "loader is a one-shot iterator; pass the loader itself, so that every epoch "
                "and every resume can iterate it again"
            )
        if getattr(loader, "in_order", True) is False and getattr(loader, "num_workers", 0):
            raise ValueError(
                "the loader has in_order=False, so the batch after a resume need not be the "
                "one the state names; use in_order=True (the default)"
            )
        self.loader = loader
        self.batch_size = batch_size
        self.collate = collate
        self.drop_last = drop_last
        self._loaded: dict[str, Any] | None = None  # a loaded state not yet iterated from
        self._position: dict[str, Any] | None = None  # where the live iterator stands
        self._generation = 0  # bumped by each new iterator and each load: older ones stop

    # -- state -----------------------------------------------------------------------------

    def _loader_state(self) -> Any:
        state_dict = getattr(self.loader, "state_dict", None)
        return None if state_dict is None else state_dict()

    def _state(self, loader: Any, skip: int, made_by: int | None) -> dict[str, Any]:
        return sealed({STAGE_KEY: self.STAGE, self.LOADER: loader, self.SKIP: skip,
                       self.MADE_BY: made_by})

    def made_by(self, loader_state: Any) -> int | None:
        """The worker of the loader that made the batch it yielded last, from its state after
        that batch (None: not known; `streamds.train.rebatch.Rebatch` reads torchdata's)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Where the next training batch begins: the loader's state before the big batch that
        holds its first record, and how many records of that big batch were yielded."""
        if not callable(getattr(self.loader, "state_dict", None)):
            raise TypeError(
                f"{type(self.loader).__name__} has no state_dict(), so Rebatch cannot say "
                "where it stands; use torchdata's StatefulDataLoader (pip install torchdata)"
            )
        for state in (self._loaded, self._position):
            if state is not None:
                return dict(state)
        return self._state(self.loader.state_dict(), 0, None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` (from `state_dict()`) on the next iteration."""
        check_state(state, self.STAGE, self.KEYS, "Rebatch")
        check_int("the state's skip", state[self.SKIP], 0,
                  "pass the dict that state_dict() returned, unchanged")
        if state[self.MADE_BY] is not None:
            check_int("the state's made_by", state[self.MADE_BY], 0,
                      "pass the dict that state_dict() returned, unchanged")
        load = getattr(self.loader, "load_state_dict", None)
        if load is None:
            raise TypeError(
                f"{type(self.loader).__name__} has no load_state_dict(); use torchdata's "
                "StatefulDataLoader"
            )
        load(state[self.LOADER])
        self._loaded = dict(state)
        self._position = None
        self._generation += 1

    @classmethod
    def loader_state_of(cls, state: dict[str, Any]) -> Any:
        """The state of the loader inside a Rebatch `state` (to check it before loading)."""
        check_state(state, cls.STAGE, cls.KEYS, "Rebatch")
        return state[cls.LOADER]

    # the stage protocol's names for the same two operations
    def get_state(self) -> dict[str, Any]:
        return self.state_dict()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        """Resume at `state` on the next iteration (None: where the loader stands)."""
        if state is None:
            self._loaded = self._position = None
            self._generation += 1
        else:
            self.load_state_dict(state)

    @classmethod
    def handed_after(cls, node: dict[str, Any]) -> tuple[int | None, int]:
        """(the loader's worker that made the big batch, records of it yielded) of a state:
        an elastic merge reads the loader's state as standing before that batch, and the
        reader of that worker as having handed out those records since (skip 0: none).
        Refuses a state inside a big batch whose maker is not known."""
        skip, made_by = node[cls.SKIP], node[cls.MADE_BY]
        if skip and made_by is None:
            raise ValueError(
                f"merge_states cannot carry over a Rebatch state inside a big batch "
                f"({skip} of its records already yielded) that does not say which of the "
                "loader's workers made the batch (a loader other than torchdata's "
                "StatefulDataLoader, or streamds.stages.rebatch.Rebatch used directly); use "
                "streamds.Rebatch or ds.loader(...), resume in the same world with "
                "load_state_dict(), or save the states at a step where every rank's state has "
                "skip == 0"
            )
        return made_by, skip

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        generation = self._generation
        loaded, self._loaded = self._loaded, None
        big_batches = iter(self.loader)
        if loaded is None:
            held = _Held(self._loader_state(), 0, None)
        else:
            held = _Held(loaded[self.LOADER], loaded[self.SKIP], loaded[self.MADE_BY])
        self._position = self._state(*held.position())  # an error before a batch: still here
        ended = False
        while True:
            while held.ready < self.batch_size and not ended:
                try:
                    records = _records_of(next(big_batches))
                except StopIteration:
                    ended = True
                    break
                after = self._loader_state()
                held.add(records, after, self.made_by(after))
            held.check_resumed()
            if held.ready == 0 or (ended and held.ready < self.batch_size and self.drop_last):
                # the epoch is over: the loader's own (finished) state, as after its epoch
                self._position = self._state(self._loader_state(), 0, None)
                return
            batch = held.take(self.batch_size)
            out = batch if self.collate is None else self.collate(batch)
            self._position = self._state(*held.position())  # only once `out` exists
            yield out
            if self._generation != generation:
                raise RuntimeError(
                    "this Rebatch iterator is stale: a newer iter() or load_state_dict() of "
                    "the same Rebatch came after it, and the loader's state follows that one "
                    "now; iterate one iterator at a time"
                )


class _Held:
    """The big batches pulled whose records are not all yielded yet, each with the loader's
    state before it and the worker that made it, and the loader's state after the last one
    pulled."""

    def __init__(self, start: Any, skip: int, made_by: int | None) -> None:
        # (the loader's state before it, its records, the worker that made it)
        self.batches: deque[tuple[Any, list[Any], int | None]] = deque()
        self.taken = skip  # records of the first batch already yielded (before a resume too)
        self.ready = 0  # records held and not yet yielded
        self.after = start  # the loader's state after the last batch pulled
        self.made_by = made_by  # the maker of the batch a loaded state stood inside

    def add(self, records: list[Any], after: Any, made_by: int | None) -> None:
        """A big batch pulled, the loader's state after it and the worker that made it."""
        if not self.batches and self.taken > len(records):
            raise StateMismatchError(
                f"the loaded state skips {self.taken} records of the loader's first batch, "
                f"which holds {len(records)}; the loader does not resume where the state was "
                "taken (another dataset, batch size or number of workers?): load the state "
                "into the loader it came from"
            )
        self.ready += len(records) - (0 if self.batches else self.taken)
        if not self.batches and self.taken and self.made_by is not None:
            made_by = self.made_by  # the batch a loaded state stood inside: as it said
        self.batches.append((self.after, records, made_by))
        self.after = after

    def check_resumed(self) -> None:
        """After the loader ran out: a resumed state's skip must have found its batch."""
        if self.taken and not self.batches:
            raise StateMismatchError(
                f"the loaded state skips {self.taken} records of the loader's first batch, and "
                "the loader yielded nothing; load the state into the loader it came from"
            )

    def take(self, count: int) -> list[Any]:
        """The next `count` records (fewer at the end of the epoch)."""
        batch: list[Any] = []
        while len(batch) < count and self.batches:
            records = self.batches[0][1]
            piece = records[self.taken : self.taken + count - len(batch)]
            batch.extend(piece)
            self.taken += len(piece)
            if self.taken == len(records):
                self.batches.popleft()
                self.taken = 0
        self.ready -= len(batch)
        return batch

    def position(self) -> tuple[Any, int, int | None]:
        """Where the next record sits: (the loader's state before its big batch, records of
        that batch yielded, the worker that made it); after the last batch pulled when every
        record was yielded."""
        if self.batches:
            before, _, made_by = self.batches[0]
            return before, self.taken, made_by
        return self.after, self.taken, self.made_by if self.taken else None
