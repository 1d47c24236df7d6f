"""`merge_states` of `ds.loader`'s states at any training batch (elastic resume of the
recommended loader): the records the workers handed over and the main process had not cut
into training batches yet count as not read, those it yielded as read, on both routes."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import corpus
import pytest
from resume_contract import ids
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import Mix, Rebatch, StreamingJsonl, merge_states
from streamds.train import loader as loader_module

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

COUNT = 2400
PARTS = 8
MESSAGE = 64  # records per worker message: small, so a few batches cross several


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> str:
    return corpus.write_parts(tmp_path_factory.mktemp("small"), COUNT, PARTS)


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("large")
    each = 300 // PARTS
    for part in range(PARTS):
        rows = [{"id": i, "text": "x" * (1500 + i % 37)}
                for i in range(part * each, (part + 1) * each)]
        (root / f"part-{part}.jsonl").write_bytes(corpus.jsonl(rows))
    return str(root)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> str:
    """8 parts of 100 to 500 records (2,400 in all): readers run out at different batches."""
    root = tmp_path_factory.mktemp("uneven")
    start = 0
    for part, size in enumerate([100, 500, 150, 450, 200, 400, 250, 350]):
        (root / f"part-{part}.jsonl").write_bytes(
            corpus.jsonl(corpus.make_records(size, start=start)))
        start += size
    return str(root)


@pytest.fixture
def small_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader_module, "MESSAGE_RECORDS", MESSAGE)


def odd(record: dict[str, Any]) -> bool:
    return record["id"] % 3 != 0


def dataset(path: str, *, rank: int | None = None, world_size: int | None = None,
            shuffle: bool = True, keep: Any = None, even_ranks: str | None = None) -> Any:
    ds = StreamingJsonl(path, shuffle=shuffle, seed=7, buffer_size=40, rank=rank,
                        world_size=world_size, even_ranks=even_ranks)
    return ds if keep is None else ds.filter(keep)


def checkpoint(path: str, batches: int, *, workers: int, size: int = 24, **options: Any
               ) -> tuple[list[int], list[dict[str, Any]], list[bool]]:
    """Two ranks each yield `batches` training batches of `size` from ds.loader; returns the
    ids they yielded, their loader states (pickled, as a checkpoint keeps them) and whether
    each loader took the small-record route."""
    seen: list[int] = []
    states, routes = [], []
    for rank in (0, 1):
        loader = dataset(path, rank=rank, world_size=2, **options).loader(
            size, num_workers=workers, collate=ids)
        iterator = iter(loader)
        for _ in range(batches):
            seen += next(iterator)
        states.append(pickle.loads(pickle.dumps(loader.state_dict())))
        routes.append(loader.small_records)
        del iterator
    return seen, states, routes


def finish(path: str, merged: dict[str, Any], world_size: int, **options: Any) -> list[int]:
    """The rest of the epoch, read by `world_size` ranks from the merged state."""
    rest: list[int] = []
    for rank in range(world_size):
        resumed = dataset(path, rank=rank, world_size=world_size, **options).with_resume(merged)
        rest += [record["id"] for record in resumed]
    return rest


def expected_ids(keep: Any = None) -> list[int]:
    every = range(COUNT // PARTS * PARTS)
    return [i for i in every if keep is None or keep({"id": i})]


@pytest.mark.usefixtures("small_messages")
@pytest.mark.parametrize(
    ("shuffle", "keep", "workers", "batches"),
    [(True, None, 2, 5), (False, None, 2, 5), (True, odd, 0, 3), (False, odd, 2, 4),
     (True, None, 0, 1)],
    ids=["shuffled-2-workers", "in-order-2-workers", "shuffled-filter-0-workers",
         "in-order-filter-2-workers", "first-batch"],
)
def test_a_small_record_loader_state_inside_a_message_merges_exactly(
    small: str, shuffle: bool, keep: Any, workers: int, batches: int
) -> None:
    seen, states, routes = checkpoint(small, batches, workers=workers, shuffle=shuffle,
                                      keep=keep)
    assert routes == [True, True]  # the small-record route: messages cut by Rebatch
    assert all(state["skip"] % MESSAGE for state in states)  # inside a message, not at a seam
    merged = merge_states(states)
    for world_size in (1, 3):
        rest = finish(small, merged, world_size, shuffle=shuffle, keep=keep)
        assert sorted(seen + rest) == expected_ids(keep), f"finished by {world_size} ranks"


@pytest.mark.usefixtures("small_messages")
@pytest.mark.usefixtures("small_messages")
@pytest.mark.parametrize("batches", [25, 26, 28])
def test_a_state_after_a_worker_ran_out_merges_exactly(uneven: str, batches: int) -> None:
    # rank 0's worker 0 (300 records) hands over its last of 5 messages as the rank's 9th
    # (records 512-555), so messages 11 and 12 both come from worker 1 (400 records): cuts
    # at records 600, 624 and 672 stand before, inside and after that turn
    seen, states, _ = checkpoint(uneven, batches, workers=2, shuffle=False)
    merged = merge_states(states)
    for world_size in (1, 3):
        rest = finish(uneven, merged, world_size, shuffle=False)
        assert sorted(seen + rest) == list(range(COUNT)), f"finished by {world_size} ranks"


@pytest.mark.usefixtures("small_messages")
@pytest.mark.parametrize("even_ranks", ["pad", "drop"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_an_even_ranks_state_inside_a_message_merges_exactly(
    uneven: str, even_ranks: str, shuffle: bool
) -> None:
    # 13 x 24 = 312 records: inside a message; the readers' quotas pad or drop (uneven
    # blocks); one rank finishing the epoch pads and drops nothing of its own
    seen, states, _ = checkpoint(uneven, 13, workers=2, shuffle=shuffle, even_ranks=even_ranks)
    assert all(state["skip"] % MESSAGE for state in states)
    rest = finish(uneven, merge_states(states), 1, shuffle=shuffle, even_ranks=even_ranks)
    assert sorted(seen + rest) == list(range(COUNT))


@pytest.mark.usefixtures("small_messages")
def test_a_merged_loader_state_resumes_in_a_loader_with_other_workers(small: str) -> None:
    seen, states, _ = checkpoint(small, 7, workers=2)
    merged = merge_states(states)
    rest: list[int] = []
    for rank in range(3):
        loader = dataset(small, rank=rank, world_size=3).with_resume(merged).loader(
            16, num_workers=1, collate=ids)
        rest += [i for batch in loader for i in batch]
    assert sorted(seen + rest) == expected_ids()


def test_the_default_message_size_merges_inside_a_message(small: str) -> None:
    seen, states, _ = checkpoint(small, 3, workers=2, size=32)  # 96 of a 2,048-record message
    assert [state["skip"] for state in states] == [96, 96]
    rest = finish(small, merge_states(states), 3)
    assert sorted(seen + rest) == expected_ids()


def test_a_large_record_loader_state_merges_after_any_batch(large: str) -> None:
    seen, states, routes = checkpoint(large, 3, workers=2, size=5)
    assert routes == [False, False]  # the workers make the training batches
    merged = merge_states(states)
    for world_size in (1, 3):
        rest = finish(large, merged, world_size)
        assert sorted(seen + rest) == list(range(300 // PARTS * PARTS))


def test_a_state_inside_a_message_of_a_rebatch_without_its_maker_is_refused(
    small: str,
) -> None:
    _, states, _ = checkpoint(small, 1, workers=0)
    for state in states:
        state["made_by"] = None  # as streamds.stages.rebatch.Rebatch over another loader
    with pytest.raises(ValueError, match="does not say which of the loader's workers made"):
        merge_states(states)


def test_a_state_inside_a_message_of_a_mix_is_refused_naming_the_fix(tmp_path: Path) -> None:
    a, b = corpus.write_two_sources(tmp_path, 200)
    mix = Mix([StreamingJsonl(a), StreamingJsonl(b)], weights=[1, 1], seed=1)
    batches = Rebatch(StatefulDataLoader(mix.batch(50), batch_size=None), 20, collate=ids)
    iterator = iter(batches)
    next(iterator)
    state = batches.state_dict()
    assert state["skip"] == 20
    with pytest.raises(ValueError, match="cannot carry over a Rebatch state inside a big batch"
                       r".* of a batches dataset.*load_state_dict"):
        merge_states([state])
