"""Clear edges (issue 9, bullet 6): each mistake is named where it is made, with its fix.

A plain-loader resume past the end of its epoch, persistent workers that never see
set_epoch(), a non-integer RANK, half a world (world_size without rank), a seed beyond 64
bits, a loader state loaded into a loader with another num_workers, a state whose blocks are
not this dataset's.
"""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path
from typing import Any

import corpus
import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import StateMismatchError, StreamingJsonl, merge_states
from streamds.train.loader_state import saved_num_workers

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

BATCH = 10
RECORDS = 500


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("edges")
    for k in range(3):
        corpus.write(directory / f"part-{k}.jsonl", corpus.make_records(RECORDS // 5 + 50 * k,
                                                                      start=1000 * k))
    return str(directory)


@pytest.fixture(autouse=True)
def no_world_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def ids(batch: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in batch]


# -- resume_after_batches past the end of the epoch -----------------------------------------------


@pytest.mark.parametrize(("workers", "drop_last"), [(0, False), (2, False), (3, True)])
def test_resume_after_the_last_batch_is_refused_with_the_epochs_length(
    source: str, workers: int, drop_last: bool
) -> None:
    dataset = StreamingJsonl(source, shuffle=True, seed=2, buffer_size=20)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=workers, drop_last=drop_last,
                        collate_fn=ids)
    length = sum(1 for _ in loader)
    at_end = dataset.resume_after_batches(length, batch_size=BATCH, num_workers=workers,
                                          drop_last=drop_last)
    assert list(DataLoader(at_end, batch_size=BATCH, num_workers=workers,
                           drop_last=drop_last, collate_fn=ids)) == []
    with pytest.raises(ValueError, match=rf"consumed={length + 1} is past the end of epoch 0: "
                                         rf"this rank's loader yields {length} batches"):
        dataset.resume_after_batches(length + 1, batch_size=BATCH, num_workers=workers,
                                     drop_last=drop_last)


# -- persistent workers and set_epoch -------------------------------------------------------------


def epochs_through(dataset: StreamingJsonl, *, persistent: bool, log_file: Path,
                   set_epochs: bool = True) -> list[list]:
    """Two epochs (set_epoch(0), set_epoch(1) unless not `set_epochs`) through one DataLoader
    with a worker; a forked worker's log records go to `log_file` (a handler it inherits)."""
    handler = logging.FileHandler(log_file)
    logger = logging.getLogger("streamds")
    logger.addHandler(handler)
    try:
        loader = DataLoader(dataset, batch_size=BATCH, num_workers=1, collate_fn=ids,
                            persistent_workers=persistent,
                            multiprocessing_context=multiprocessing.get_context("fork"))
        epochs = []
        for epoch in range(2):
            if set_epochs:
                dataset.set_epoch(epoch)
            epochs.append([i for batch in loader for i in batch])
        return epochs
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_set_epoch_reaches_persistent_workers(source: str, tmp_path: Path) -> None:
    """Persistent (forked) workers start each epoch's iterator from the epoch the main
    process set: the same orders as workers started afresh for each epoch."""
    def dataset() -> StreamingJsonl:
        return StreamingJsonl(source, shuffle=True, seed=3, buffer_size=50)

    kept = epochs_through(dataset(), persistent=True, log_file=tmp_path / "kept.log")
    fresh = epochs_through(dataset(), persistent=False, log_file=tmp_path / "fresh.log")
    assert kept == fresh and kept[0] != kept[1]


def test_persistent_workers_that_miss_set_epoch_warn(source: str, tmp_path: Path) -> None:
    dataset = StreamingJsonl(source, shuffle=True, seed=3, buffer_size=50)
    log_file = tmp_path / "worker.log"
    first, second = epochs_through(dataset, persistent=True, log_file=log_file,
                                   set_epochs=False)
    assert first == second  # set_epoch(1) was never called: what the warning is about
    said = log_file.read_text()
    assert "starts epoch 0 again" in said and "persistent_workers=True" in said
    assert "set_epoch(epoch)" in said


def test_workers_that_start_each_epoch_anew_are_quiet(source: str, tmp_path: Path) -> None:
    dataset = StreamingJsonl(source, shuffle=True, seed=3, buffer_size=50)
    log_file = tmp_path / "worker.log"
    first, second = epochs_through(dataset, persistent=False, log_file=log_file)
    assert first != second and sorted(first) == sorted(second)
    assert "again" not in log_file.read_text()


# -- the world from the environment and the arguments ---------------------------------------------


@pytest.mark.parametrize(("name", "value"), [("RANK", "x"), ("WORLD_SIZE", "two"),
                                             ("WORLD_SIZE", "0"), ("RANK", "-1")])
def test_a_bad_environment_variable_is_named(
    source: str, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"environment variable {name} .*{name}='{value}'"):
        iter(StreamingJsonl(source))


def test_rank_beyond_world_size_in_the_environment_is_named(
    source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"RANK must be < WORLD_SIZE, got RANK=2"):
        iter(StreamingJsonl(source))


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE"])
def test_half_a_world_in_the_environment_is_refused(
    source: str, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match=rf"{name}='1' is set but .* is not"):
        iter(StreamingJsonl(source))


@pytest.mark.parametrize(("given", "missing"), [({"world_size": 2}, "rank"),
                                                ({"rank": 0}, "world_size"),
                                                ({"rank": 1}, "world_size")])
def test_half_a_world_in_the_arguments_is_refused(
    source: str, given: dict[str, int], missing: str
) -> None:
    dataset = StreamingJsonl(source, **given)
    with pytest.raises(ValueError, match=rf"given without {missing}.*pass {missing}="):
        list(dataset)
    with pytest.raises(ValueError, match=rf"given without {missing}"):
        dataset.state_dict()


def test_the_other_half_may_come_from_the_environment(
    source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    every = sorted(r["id"] for r in StreamingJsonl(source))
    monkeypatch.setenv("RANK", "1")
    second = [r["id"] for r in StreamingJsonl(source, world_size=2)]
    monkeypatch.delenv("RANK")
    first = [r["id"] for r in StreamingJsonl(source, rank=0, world_size=2)]
    assert sorted(first + second) == every and first and second


# -- the seed -------------------------------------------------------------------------------------


def test_a_seed_beyond_64_bits_is_refused_in_the_constructor(source: str) -> None:
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 18446744073709551615\]"
                                         r", got 18446744073709551616"):
        StreamingJsonl(source, shuffle=True, seed=1 << 64)
    largest = StreamingJsonl(source, shuffle=True, seed=(1 << 64) - 1)
    assert sorted(r["id"] for r in largest) == sorted(r["id"] for r in StreamingJsonl(source))


# -- a loader state and another num_workers -------------------------------------------------------


def loader_state_after(source: str, workers: int, batches: int) -> tuple[dict, list[int]]:
    loader = StatefulDataLoader(StreamingJsonl(source, shuffle=True, seed=5, buffer_size=30),
                                batch_size=BATCH, num_workers=workers, collate_fn=ids)
    iterator = iter(loader)
    seen = [i for _ in range(batches) for i in next(iterator)]
    return loader.state_dict(), seen


def one_call_loader(source: str, workers: int, small_records: bool) -> Any:
    return StreamingJsonl(source, shuffle=True, seed=5, buffer_size=30).loader(
        BATCH, num_workers=workers, collate=ids, small_records=small_records)


@pytest.mark.parametrize("small_records", [False, True])
@pytest.mark.parametrize(("saved", "now"), [(0, 2), (2, 0), (2, 3), (1, 0)])
def test_a_loader_state_for_another_num_workers_points_to_merge_states(
    source: str, saved: int, now: int, small_records: bool
) -> None:
    """ds.loader(...).load_state_dict checks before torchdata would fail with a bare
    AssertionError (0 <-> N workers), and names merge_states."""
    made = one_call_loader(source, saved, small_records)
    iterator = iter(made)
    for _ in range(4):
        next(iterator)
    state = made.state_dict()
    loader = one_call_loader(source, now, small_records)
    with pytest.raises(StateMismatchError, match=rf"num_workers={saved}, but this loader has "
                                                 rf"num_workers={now}.*merge_states"):
        loader.load_state_dict(state)


def test_workers_refuse_states_of_another_num_workers_naming_merge_states(source: str) -> None:
    """Loaded straight into torchdata's loader (2 workers -> 3), each worker's dataset says so."""
    state, _ = loader_state_after(source, 2, 4)
    loader = StatefulDataLoader(StreamingJsonl(source, shuffle=True, seed=5, buffer_size=30),
                                batch_size=BATCH, num_workers=3, collate_fn=ids)
    loader.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="merge_states"):
        list(loader)


def test_the_fix_the_message_names_finishes_the_epoch(source: str) -> None:
    """The same num_workers resumes exactly; merge_states + with_resume finishes the epoch
    with another num_workers, every record once."""
    state, seen = loader_state_after(source, 0, 7)
    every = sorted(r["id"] for r in StreamingJsonl(source))
    same = StatefulDataLoader(StreamingJsonl(source, shuffle=True, seed=5, buffer_size=30),
                              batch_size=BATCH, num_workers=0, collate_fn=ids)
    assert saved_num_workers(state) == 0
    same.load_state_dict(state)
    assert sorted(seen + [i for batch in same for i in batch]) == every
    merged = merge_states([state])
    resumed = StreamingJsonl(source, shuffle=True, seed=5, buffer_size=30).with_resume(merged)
    rest = [i for batch in DataLoader(resumed, batch_size=BATCH, num_workers=2, collate_fn=ids)
            for i in batch]
    assert sorted(seen + rest) == every


def test_not_a_loader_state_is_refused() -> None:
    with pytest.raises(StateMismatchError, match=r"loader\.state_dict\(\)"):
        saved_num_workers({"format": "streamds.reader/2"})


# -- a state whose blocks are not this dataset's --------------------------------------------------


def test_a_state_with_another_block_count_is_refused(source: str) -> None:
    dataset = StreamingJsonl(source)
    state = dataset.state_dict()
    state["plan"][0] += 1
    with pytest.raises(StateMismatchError, match=r"cut into .* blocks"):
        StreamingJsonl(source).load_state_dict(state)


def test_an_epoch_set_in_a_worker_stays_in_that_worker() -> None:
    """The shared epoch goes from the main process to forked workers only: a worker that sets
    an epoch (a Mix sets its sources' in each worker) moves neither the main process nor its
    sibling workers."""
    from streamds.datasets.epoch import SharedEpoch

    epoch = SharedEpoch(3)
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_set_epoch_to_nine, args=(epoch,))
    child.start()
    child.join()
    assert child.exitcode == 0 and epoch.value == 3
    epoch.value = 4  # the main process's own writes still reach a new worker
    reader = context.Process(target=_exit_with_epoch, args=(epoch,))
    reader.start()
    reader.join()
    assert reader.exitcode == 4


def _set_epoch_to_nine(epoch) -> None:
    epoch.value = 9
    assert epoch.value == 9


def _exit_with_epoch(epoch) -> None:
    raise SystemExit(epoch.value)
