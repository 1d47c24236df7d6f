"""`Rebatch`: training batches cut from a loader's big batches, exactly once, exact resume."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import corpus
import pytest
from resume_contract import ids, records, run_test_save_load_state
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import Rebatch, StateMismatchError, StreamingJsonl, merge_states
from streamds.stages.rebatch import Rebatch as StageRebatch

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

COUNT = 700


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rebatch") / "part.jsonl"
    corpus.write_plain(path, corpus.jsonl(records(COUNT, 0)))
    return path


def big_batches(source: Path, *, workers: int, big: int = 50, **loader: Any) -> StatefulDataLoader:
    ds = StreamingJsonl(str(source), shuffle=True, seed=5, buffer_size=64).batch(big)
    return StatefulDataLoader(ds, batch_size=None, num_workers=workers, **loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_training_batches_hold_every_record_once_in_the_loaders_order(
    source: Path, workers: int
) -> None:
    loader = big_batches(source, workers=workers)
    flat = [i for big in loader for i in ids(big)]
    batches = list(Rebatch(big_batches(source, workers=workers), 32, collate=ids))
    assert [i for batch in batches for i in batch] == flat  # same records, same order
    assert sorted(flat) == list(range(COUNT))
    # every batch full but the last: a short big batch (a reader's last) is filled from the next
    assert [len(batch) for batch in batches] == [32] * (COUNT // 32) + [COUNT % 32]


@pytest.mark.parametrize(
    ("workers", "snapshot"), [(0, 1), (2, 1), (2, 3)], ids=["0-workers", "2-workers", "every-3"]
)
def test_resume_after_any_training_batch_is_exact(
    source: Path, workers: int, snapshot: int
) -> None:
    def make() -> Rebatch:
        loader = big_batches(source, workers=workers, snapshot_every_n_steps=snapshot)
        return Rebatch(loader, 32, collate=ids)

    # cuts inside a big batch (1), right at a seam (25 * 32 = 16 big batches of 50), after a
    # batch that spans two big batches (2: records 32..63), and at the end of the epoch
    reference = run_test_save_load_state(make, [0, 1, 2, 3, 11, 12, 21, 22])
    assert sorted(i for batch in reference for i in batch) == list(range(COUNT))


def test_a_batch_larger_than_the_big_batches_spans_several(source: Path) -> None:
    def make() -> Rebatch:
        return Rebatch(big_batches(source, workers=2, big=7), 64, collate=ids)

    reference = run_test_save_load_state(make, [1, 4, 10])
    assert [len(batch) for batch in reference] == [64] * (COUNT // 64) + [COUNT % 64]


def test_drop_last_drops_only_the_short_batch_at_the_end(source: Path) -> None:
    kept = list(Rebatch(big_batches(source, workers=0), 32, collate=ids, drop_last=True))
    every = list(Rebatch(big_batches(source, workers=0), 32, collate=ids))
    assert kept == every[:-1] and len(every[-1]) == COUNT % 32


def test_a_state_skips_inside_the_big_batch_it_names(source: Path) -> None:
    batches = Rebatch(big_batches(source, workers=0), 32, collate=ids)
    iterator = iter(batches)
    next(iterator)
    state = batches.state_dict()
    assert state["skip"] == 32  # 32 of the first big batch's 50 were yielded
    next(iterator)  # records 32..63: the rest of big batch 1 and 14 of big batch 2
    assert batches.state_dict()["skip"] == 14
    assert pickle.loads(pickle.dumps(batches.state_dict())) == batches.state_dict()


def test_a_state_that_does_not_fit_the_loader_is_refused(source: Path) -> None:
    batches = Rebatch(big_batches(source, workers=0), 32, collate=ids)
    iterator = iter(batches)
    next(iterator)
    state = batches.state_dict()
    # the same state loaded into a loader whose big batches hold 20 records, not 50
    other = Rebatch(big_batches(source, workers=0, big=20), 32)
    other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="skips 32 records of the loader's first batch"):
        next(iter(other))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: {k: v for k, v in s.items() if k != "skip"}, "missing keys \\['skip'\\]"),
        (lambda s: {**s, "extra": 1}, "unknown keys \\['extra'\\]"),
        (lambda s: {**s, "format": "streamds.rebatch/0"}, "reads 'streamds/5'"),
        (lambda s: {**s, "skip": -1}, "skip must be an integer >= 0"),
        (lambda s: {**s, "made_by": "w0"}, "made_by must be an integer >= 0"),
    ],
    ids=["missing", "unknown", "format", "negative", "maker"],
)
def test_loading_is_strict(source: Path, change: Any, message: str) -> None:
    state = Rebatch(big_batches(source, workers=0), 32).state_dict()
    with pytest.raises((StateMismatchError, ValueError), match=message):
        Rebatch(big_batches(source, workers=0), 32).load_state_dict(change(state))


def rank_states(source: Path, training_batches: int) -> tuple[list[int], list[dict]]:
    """Two ranks each yield `training_batches` batches of 25 from big batches of 50; returns
    the ids they yielded and their Rebatch states."""
    seen, states = [], []
    for rank in (0, 1):
        ds = StreamingJsonl(str(source), shuffle=True, seed=5, buffer_size=64, rank=rank,
                            world_size=2).batch(50)
        batches = Rebatch(StatefulDataLoader(ds, batch_size=None), 25, collate=ids)
        iterator = iter(batches)
        seen += [i for _ in range(training_batches) for i in next(iterator)]
        states.append(pickle.loads(pickle.dumps(batches.state_dict())))
    return seen, states


def test_states_at_a_big_batch_seam_merge_for_an_elastic_resume(source: Path) -> None:
    seen, states = rank_states(source, 4)  # 4 x 25 = 2 big batches: skip == 0
    assert [state["skip"] for state in states] == [0, 0]
    merged = merge_states(states)
    rest = [r["id"] for r in StreamingJsonl(str(source), shuffle=True, seed=5,
                                            buffer_size=64).with_resume(merged)]
    assert sorted(seen + rest) == list(range(COUNT))


def test_states_inside_a_big_batch_merge_exactly(source: Path) -> None:
    seen, states = rank_states(source, 3)  # 75 records: 25 of the second big batch yielded
    assert [state["skip"] for state in states] == [25, 25]
    merged = merge_states(states)  # the 25 count as read, the other 25 as not
    rest = [r["id"] for r in StreamingJsonl(str(source), shuffle=True, seed=5,
                                            buffer_size=64).with_resume(merged)]
    assert sorted(seen + rest) == list(range(COUNT))


def test_states_inside_a_big_batch_of_the_stage_itself_refuse_to_merge(source: Path) -> None:
    # the stage without torchdata's reading does not know which worker made a big batch
    ds = StreamingJsonl(str(source), shuffle=True, seed=5, buffer_size=64, rank=0,
                        world_size=1).batch(50)
    batches = StageRebatch(StatefulDataLoader(ds, batch_size=None), 25, collate=ids)
    iterator = iter(batches)
    next(iterator)
    state = batches.state_dict()
    assert state["skip"] == 25 and state["made_by"] is None
    with pytest.raises(ValueError, match="does not say which of the loader's workers made"):
        merge_states([state])


def test_a_plain_dataloader_iterates_but_has_no_state(source: Path) -> None:
    ds = StreamingJsonl(str(source)).batch(50)
    batches = Rebatch(DataLoader(ds, batch_size=None), 32, collate=ids)
    assert [i for batch in batches for i in batch] == list(range(COUNT))
    with pytest.raises(TypeError, match="use torchdata's StatefulDataLoader"):
        batches.state_dict()


def test_big_batches_that_are_not_lists_of_records_are_refused(source: Path) -> None:
    ds = StreamingJsonl(str(source)).batch(50, collate=lambda b: {"ids": ids(b)})
    loader = DataLoader(ds, batch_size=None)
    with pytest.raises(TypeError, match=r"Rebatch cuts lists of records.*collate="):
        next(iter(Rebatch(loader, 32)))


def test_in_order_false_is_refused(source: Path) -> None:
    with pytest.raises(ValueError, match="in_order=False"):
        Rebatch(big_batches(source, workers=2, in_order=False), 32)


def resumed_after(source: Path, cut: int, **rebatch: Any) -> tuple[list[int], dict]:
    """The ids of the first `cut` training batches and the state after them (pickled)."""
    batches = Rebatch(big_batches(source, workers=0), 32, collate=ids, **rebatch)
    iterator = iter(batches)
    seen = [i for _ in range(cut) for i in next(iterator)]
    return seen, pickle.loads(pickle.dumps(batches.state_dict()))


def test_a_loaded_state_is_the_state_until_a_batch_is_yielded(source: Path) -> None:
    seen, state = resumed_after(source, 1)
    batches = Rebatch(big_batches(source, workers=0), 32, collate=ids)
    batches.load_state_dict(state)
    assert batches.state_dict() == state  # loaded, not yet iterated
    iterator = iter(batches)
    assert batches.state_dict() == state  # iterated, nothing pulled yet
    rest = [i for batch in iterator for i in batch]
    assert sorted(seen + rest) == list(range(COUNT))


class Interrupt(Exception):
    """Stands for a preemption signal arriving in the main process."""


def test_an_error_before_the_first_batch_after_a_resume_keeps_the_state(source: Path) -> None:
    _, state = resumed_after(source, 1)  # skip 32 of the first big batch
    failing = {"armed": True}

    def flaky(record: dict) -> dict:
        if failing["armed"]:
            failing["armed"] = False
            raise Interrupt
        return record

    ds = StreamingJsonl(str(source), shuffle=True, seed=5, buffer_size=64).map(flaky).batch(50)
    batches = Rebatch(StatefulDataLoader(ds, batch_size=None), 32, collate=ids)
    batches.load_state_dict(state)
    with pytest.raises(Interrupt):
        next(iter(batches))
    assert batches.state_dict() == state  # the emergency checkpoint still skips the 32


def test_an_error_in_collate_does_not_count_the_batch(source: Path) -> None:
    calls = {"n": 0}

    def collate(batch: list[dict]) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise Interrupt
        return ids(batch)

    batches = Rebatch(big_batches(source, workers=0), 32, collate=collate)
    iterator = iter(batches)
    seen = next(iterator) + next(iterator)
    with pytest.raises(Interrupt):
        next(iterator)
    state = pickle.loads(pickle.dumps(batches.state_dict()))
    resumed = Rebatch(big_batches(source, workers=0), 32, collate=ids)
    resumed.load_state_dict(state)
    rest = [i for batch in resumed for i in batch]
    assert sorted(seen + rest) == list(range(COUNT))  # the third batch's records come again


def test_a_stale_iterator_stops_instead_of_moving_the_state(source: Path) -> None:
    batches = Rebatch(big_batches(source, workers=0), 32, collate=ids)
    first = iter(batches)
    next(first)
    second = iter(batches)
    next(second)
    with pytest.raises(RuntimeError, match="stale"):
        next(first)


def test_after_a_whole_epoch_the_state_starts_the_next(source: Path) -> None:
    batches = Rebatch(big_batches(source, workers=2), 32, collate=ids)
    first_epoch = list(batches)
    state = pickle.loads(pickle.dumps(batches.state_dict()))
    resumed = Rebatch(big_batches(source, workers=2), 32, collate=ids)
    resumed.load_state_dict(state)
    next_epoch = list(resumed)
    assert sorted(i for batch in next_epoch for i in batch) == list(range(COUNT))
    assert next_epoch == first_epoch  # no set_epoch: the same order again


def test_drop_last_resumes_exactly(source: Path) -> None:
    def make() -> Rebatch:
        return Rebatch(big_batches(source, workers=2), 32, collate=ids, drop_last=True)

    reference = run_test_save_load_state(make, [1, 12, 21])
    assert len(reference) == COUNT // 32 and {len(batch) for batch in reference} == {32}


def test_bad_arguments_name_the_fix(source: Path) -> None:
    loader = big_batches(source, workers=0)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        Rebatch(loader, 0)
    with pytest.raises(ValueError, match="one-shot iterator"):
        Rebatch(iter(loader), 32)
