"""Epoch boundaries (issue 14): a state saved at the end of an epoch starts the next one.

A training loop saves its checkpoint when an epoch ends, so the state it holds is that of a
finished epoch. Loaded into a fresh loader with ``set_epoch(e + 1)`` (called before or after
``load_state_dict``), it must start epoch e+1 exactly as the uninterrupted run does, not
replay epoch e and not yield nothing. The uninterrupted run is one loader doing
``set_epoch(0)``, a whole epoch, ``set_epoch(1)``, a whole epoch, ...

Checked for `StreamingJsonl` under torchdata's StatefulDataLoader with 0-3 workers, and for
its batches that keep state (`.batch(n)`, `.batch(LengthBuckets(...))`,
`.batch(TokenBudget(...))`), with 0 and 2 workers; each with the source shuffled and in file
order:

- the state of a finished epoch starts the next one (the issue's own scenario);
- states taken at the end of an epoch and after the first batch of the next, in a training
  loop, resume the rest of the run, later epochs included;
- a run resumed twice across the boundary (mid-epoch 0, then at the end of epoch 0);
- the same for the datasets on their own, without a loader.

Batches are compared as lists of record ids. With the source in file order, `StreamingJsonl`
and `.batch(n)` have the same order every epoch, so there a replayed epoch goes unnoticed; those
cases still catch an epoch that comes out empty or cut short.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from resume_contract import checkpoint, ids
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import LengthBuckets, Storage, StreamingJsonl, TokenBudget
from streamds.storage.plan import MIN_BLOCK_SIZE, make_blocks
from streamds.storage.shards import resolve_shards

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

EPOCHS = 3  # the uninterrupted run: epochs 0, 1 and 2
BATCH_SIZE = 16
ORDERS = ["set_epoch-first", "load-first"]  # where set_epoch goes relative to load_state_dict

Batch = list[int]


def text_length(record: dict[str, Any]) -> int:
    """Length of a record for the batchers (module level, so worker processes pickle it)."""
    return len(record["text"])


@dataclass(frozen=True)
class Setup:
    """What is iterated: `kind` ("dataset" or a batcher) over a source, and the loader's world."""

    kind: str
    num_workers: int
    shuffle: bool

    def __str__(self) -> str:
        return f"{self.kind}-w{self.num_workers}-{'shuffled' if self.shuffle else 'ordered'}"

    @property
    def epochs_differ(self) -> bool:
        """Whether epochs come in different orders, so that a replayed epoch shows."""
        return self.shuffle or self.kind in ("bucket", "tokens")  # batchers shuffle batches


SETUPS = [
    *(Setup("dataset", workers, shuffle) for workers in (0, 1, 2, 3) for shuffle in (True, False)),
    *(
        Setup(kind, workers, shuffle)
        for kind in ("batches", "bucket", "tokens")
        for workers in (0, 2)
        for shuffle in (True, False)
    ),
]
KINDS = ["dataset", "batches", "bucket", "tokens"]


def build(source: Path, kind: str, shuffle: bool) -> IterableDataset:
    """A fresh dataset or batcher over `source`; batchers yield lists of records."""
    dataset = StreamingJsonl(str(source), shuffle=shuffle, seed=3, buffer_size=64,
                             storage=Storage(block_size=MIN_BLOCK_SIZE))
    if kind == "dataset":
        return dataset
    if kind == "batches":
        return dataset.batch(BATCH_SIZE)
    if kind == "bucket":
        return dataset.batch(LengthBuckets(BATCH_SIZE, buffer_size=64, length=text_length))
    if kind == "tokens":
        return dataset.batch(TokenBudget(12_000, buffer_size=64, length=text_length))
    raise ValueError(f"unknown kind {kind!r}")


def make_loader(source: Path, setup: Setup) -> StatefulDataLoader:
    """A fresh StatefulDataLoader yielding batches as lists of ids."""
    dataset = build(source, setup.kind, setup.shuffle)
    batch_size = BATCH_SIZE if setup.kind == "dataset" else None  # batchers batch themselves
    return StatefulDataLoader(
        dataset, batch_size=batch_size, num_workers=setup.num_workers, collate_fn=ids
    )


def run_epoch(loader: StatefulDataLoader, epoch: int) -> list[Batch]:
    """One whole epoch, as a training loop runs it."""
    loader.dataset.set_epoch(epoch)
    return list(loader)


def load(thing: Any, state: Any, epoch: int, order: str) -> None:
    """Load `state` into a fresh loader or dataset and choose `epoch`, in the given order."""
    dataset = thing.dataset if isinstance(thing, StatefulDataLoader) else thing
    if order == "set_epoch-first":
        dataset.set_epoch(epoch)
        thing.load_state_dict(state)
    else:
        thing.load_state_dict(state)
        dataset.set_epoch(epoch)


def describe(got: list[Any], reference: list[list[Any]], epoch: int, skip: int = 0) -> str:
    """Why `got` is not epoch `epoch` of the uninterrupted run (from its item `skip` on)."""
    want = reference[epoch][skip:]
    head = f"epoch {epoch}" + (f" from item {skip}" if skip else "")
    if not got:
        return f"{head}: the resumed run yields nothing; the uninterrupted run has {len(want)}"
    for other, items in enumerate(reference):
        if other != epoch and got == items[skip:] != want:
            return f"{head}: the resumed run replays epoch {other}'s order instead"
    for index, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"{head}: item {index} is {a!r}, the uninterrupted run has {b!r}"
    return f"{head}: {len(got)} items, the uninterrupted run has {len(want)}"


def flat(batches: list[Batch]) -> list[int]:
    return [i for batch in batches for i in batch]


# -- the corpus and the uninterrupted runs, once per module -----------------------------------


@pytest.fixture(scope="module")
def source(mixed: tuple[Path, list[int]]) -> Path:
    """322 records of every shard format, 10 blocks of 64 KiB or less."""
    directory, _ = mixed
    assert len(make_blocks(resolve_shards(str(directory)), MIN_BLOCK_SIZE)) >= 9
    return directory


POINTS = {  # where a training loop saves: (epoch it resumes into, batches of it already seen)
    "end-of-epoch-0": (1, 0),
    "after-batch-1-of-epoch-1": (1, 1),
    "end-of-epoch-1": (2, 0),
    "after-batch-1-of-epoch-2": (2, 1),
}


class Runs:
    """Uninterrupted runs and the states a training loop saves, computed once per setup."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self._reference: dict[Setup, list[list[Batch]]] = {}
        self._states: dict[Setup, dict[str, Any]] = {}
        self.every = sorted(flat(list(make_loader(source, Setup("dataset", 0, False)))))

    def reference(self, setup: Setup) -> list[list[Batch]]:
        """Batches of epochs 0..EPOCHS-1 from one loader that is never interrupted."""
        if setup not in self._reference:
            loader = make_loader(self.source, setup)
            epochs = [run_epoch(loader, epoch) for epoch in range(EPOCHS)]
            del loader
            for epoch, batches in enumerate(epochs):
                assert sorted(flat(batches)) == self.every, f"{setup}: epoch {epoch} not whole"
            assert (epochs[0] != epochs[1]) is setup.epochs_differ, setup
            # the run is the same as a fresh loader set to that epoch (DESIGN.md guarantee 2)
            assert run_epoch(make_loader(self.source, setup), 1) == epochs[1], setup
            self._reference[setup] = epochs
        return self._reference[setup]

    def states(self, setup: Setup) -> dict[str, Any]:
        """States a training loop saves at each of POINTS, through pickle."""
        if setup not in self._states:
            reference = self.reference(setup)
            loader = make_loader(self.source, setup)
            states: dict[str, Any] = {}
            for epoch in range(EPOCHS):
                loader.dataset.set_epoch(epoch)
                batches = []
                for batch in loader:
                    batches.append(batch)
                    for name, (at_epoch, seen) in POINTS.items():
                        if (at_epoch, seen) == (epoch, len(batches)) and seen:
                            states[name] = checkpoint(loader.state_dict())
                for name, (at_epoch, seen) in POINTS.items():
                    if at_epoch == epoch + 1 and not seen:
                        states[name] = checkpoint(loader.state_dict())
                # taking states does not change the run
                assert batches == reference[epoch], f"{setup}: epoch {epoch}"
            del loader
            assert set(states) == set(POINTS)
            self._states[setup] = states
        return self._states[setup]


@pytest.fixture(scope="module")
def runs(source: Path) -> Runs:
    return Runs(source)


setups = pytest.mark.parametrize("setup", SETUPS, ids=str)
orders = pytest.mark.parametrize("order", ORDERS)


# -- the scenario ------------------------------------------------------------------------


@orders
@setups
def test_finished_epoch_state_starts_the_next_epoch(runs: Runs, setup: Setup, order: str) -> None:
    reference = runs.reference(setup)
    first = make_loader(runs.source, setup)
    assert list(first) == reference[0]  # a new loader runs epoch 0
    state = checkpoint(first.state_dict())  # saved with the model after epoch 0
    del first
    resumed = make_loader(runs.source, setup)
    load(resumed, state, 1, order)
    got = list(resumed)
    assert got == reference[1], describe(got, reference, 1)


# -- states saved in a training loop, around the boundary -----------------------------------------


@orders
@pytest.mark.parametrize("point", POINTS)
@setups
def test_state_saved_at_the_boundary_resumes_the_rest_of_the_run(
    runs: Runs, setup: Setup, point: str, order: str
) -> None:
    reference = runs.reference(setup)
    state = runs.states(setup)[point]
    epoch, seen = POINTS[point]
    resumed = make_loader(runs.source, setup)
    load(resumed, state, epoch, order)
    got = list(resumed)  # the rest of `epoch`
    assert got == reference[epoch][seen:], describe(got, reference, epoch, seen)
    for later in range(epoch + 1, EPOCHS):  # the loop goes on in the resumed process
        got = run_epoch(resumed, later)
        assert got == reference[later], describe(got, reference, later)


@orders
@setups
def test_run_resumed_twice_across_the_boundary(runs: Runs, setup: Setup, order: str) -> None:
    reference = runs.reference(setup)
    cut = 3  # batches of epoch 0 before the first interruption
    first = make_loader(runs.source, setup)
    first.dataset.set_epoch(0)
    iterator = iter(first)
    head = list(islice(iterator, cut))
    assert len(head) == cut
    mid_epoch = checkpoint(first.state_dict())
    del iterator, first  # its workers exit now
    second = make_loader(runs.source, setup)
    load(second, mid_epoch, 0, order)
    rest = list(second)
    assert head + rest == reference[0], describe(head + rest, reference, 0)
    end_of_epoch = checkpoint(second.state_dict())
    del second
    third = make_loader(runs.source, setup)
    load(third, end_of_epoch, 1, order)
    epoch1 = list(third)
    assert epoch1 == reference[1], describe(epoch1, reference, 1)
    assert head + rest + epoch1 == reference[0] + reference[1]


# -- the datasets on their own ------------------------------------------------------------------


def items(thing: IterableDataset) -> list[Any]:
    """One pass of a dataset (record ids) or a batcher (lists of ids)."""
    return [record["id"] if isinstance(record, dict) else ids(record) for record in thing]


@orders
@pytest.mark.parametrize("boundary", [0, 1], ids=["end-of-epoch-0", "end-of-epoch-1"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "ordered"])
@pytest.mark.parametrize("kind", KINDS)
def test_dataset_state_after_a_whole_pass_starts_the_next_epoch(
    source: Path, kind: str, shuffle: bool, boundary: int, order: str
) -> None:
    def make() -> IterableDataset:
        return build(source, kind, shuffle)

    whole = make()
    reference = []
    for epoch in range(boundary + 2):
        whole.set_epoch(epoch)
        reference.append(items(whole))
    first = make()
    first.set_epoch(boundary)
    assert items(iter(first)) == reference[boundary]
    state = checkpoint(first.state_dict())
    fresh = make()
    load(fresh, state, boundary + 1, order)
    got = items(fresh)
    assert got == reference[boundary + 1], describe(got, reference, boundary + 1)
