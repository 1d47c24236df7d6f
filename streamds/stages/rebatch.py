"""Rebatch: a loader's big batches -> training batches, cut in the main process.

Workers hand batches over fastest when a message is large (~300 KB: ``ds.batch(2048)`` of
~130-byte records), and torchdata's StatefulDataLoader pays its state bookkeeping once per
batch. A training step often wants far fewer records. `Rebatch` takes the big batches of a
loader (``DataLoader(ds.batch(2048), batch_size=None, ...)``) and yields `batch_size`-record
training batches from them, in order, each record exactly once; a short batch at a seam is
filled from the next big batch, so only the last batch of an epoch is short.

State: where the first record not yet yielded sits: the loader's state before the big batch
that holds it, and how many of that batch's records were yielded already. Loading it loads the
loader's state, and the first big batch the loader yields again has its first `skip` records
dropped. That is exact whenever the loader resumes exactly (StatefulDataLoader over a
streamds dataset does, with any number of workers).

State node: ``{"stage": "rebatch", "loader": <the loader's state>, "skip": n}`` with the
format version at the top. It lives with the stages (below the merge, which asks it
`check_merge`); `streamds.train.rebatch` names it for training code.
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
    KEYS = frozenset({FORMAT, STAGE_KEY, LOADER, SKIP})

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

    def _state(self, loader: Any, skip: int) -> dict[str, Any]:
        return sealed({STAGE_KEY: self.STAGE, self.LOADER: loader, self.SKIP: skip})

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
        return self._state(self.loader.state_dict(), 0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` (from `state_dict()`) on the next iteration."""
        check_state(state, self.STAGE, self.KEYS, "Rebatch")
        check_int("the state's skip", state[self.SKIP], 0,
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
    def check_merge(cls, node: dict[str, Any]) -> None:
        """Refuse a state inside a big batch: it keeps the loader's state before that batch
        and how many of its records were yielded, but which reader made the batch (so which
        records those are) only that loader knows; merging would read them a second time."""
        if node[cls.SKIP]:
            raise ValueError(
                f"merge_states cannot carry over a Rebatch state inside a big batch "
                f"({node[cls.SKIP]} of its records already yielded, and only the loader it "
                "came from knows which); resume in the same world with load_state_dict(), or "
                "save the states for an elastic resume at a step where every rank's state has "
                "skip == 0 (a training batch that ends a big batch)"
            )

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        generation = self._generation
        loaded, self._loaded = self._loaded, None
        big_batches = iter(self.loader)
        if loaded is None:
            held = _Held(self._loader_state(), 0)
        else:
            held = _Held(loaded[self.LOADER], loaded[self.SKIP])
        self._position = self._state(*held.position())  # an error before a batch: still here
        ended = False
        while True:
            while held.ready < self.batch_size and not ended:
                try:
                    records = _records_of(next(big_batches))
                except StopIteration:
                    ended = True
                    break
                held.add(records, self._loader_state())
            held.check_resumed()
            if held.ready == 0 or (ended and held.ready < self.batch_size and self.drop_last):
                # the epoch is over: the loader's own (finished) state, as after its epoch
                self._position = self._state(self._loader_state(), 0)
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
    state before it, and the loader's state after the last one pulled."""

    def __init__(self, start: Any, skip: int) -> None:
        self.batches: deque[tuple[Any, list[Any]]] = deque()  # (state before it, records)
        self.taken = skip  # records of the first batch already yielded (before a resume too)
        self.ready = 0  # records held and not yet yielded
        self.after = start  # the loader's state after the last batch pulled

    def add(self, records: list[Any], after: Any) -> None:
        """A big batch pulled, and the loader's state after it."""
        if not self.batches and self.taken > len(records):
            raise StateMismatchError(
                f"the loaded state skips {self.taken} records of the loader's first batch, "
                f"which holds {len(records)}; the loader does not resume where the state was "
                "taken (another dataset, batch size or number of workers?): load the state "
                "into the loader it came from"
            )
        self.ready += len(records) - (0 if self.batches else self.taken)
        self.batches.append((self.after, records))
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

    def position(self) -> tuple[Any, int]:
        """Where the next record sits: (the loader's state before its big batch, records of
        that batch yielded); after the last batch pulled when every record was yielded."""
        if self.batches:
            return self.batches[0][0], self.taken
        return self.after, self.taken
