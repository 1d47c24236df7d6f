"""Where a reader starts (`streamds.resume.start`): `state_dict()` before the first `iter()`.

A StatefulDataLoader asks for `state_dict()` at odd times, and a checkpoint may be taken
before training starts. Before the first iterator that state is a description of where the
iterator will start: taking it reads no data (the corpus is moved away while it is taken) and
refuses nothing, and loading it starts the same way.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import corpus
import pytest

from streamds import StateMismatchError, StreamingJsonl, World, merge_states

RECORDS = 400
SEED = 5


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("start") / "corpus"
    root.mkdir()
    corpus.write_parts(root, RECORDS, 4)
    return root


@contextlib.contextmanager
def unreadable(root: Path) -> Iterator[None]:
    """The corpus moved away: any read of it fails."""
    away = root.with_name(root.name + ".away")
    root.rename(away)
    try:
        yield
    finally:
        away.rename(root)


def dataset(root: Path, resume_from: dict[str, Any] | None = None,
            **options: Any) -> StreamingJsonl:
    data = StreamingJsonl(str(root), shuffle=True, seed=SEED, buffer_size=16, **options)
    return data if resume_from is None else data.with_resume(resume_from)


def ids(data: Any) -> list[int]:
    return [record["id"] for record in data]


def first_run(root: Path, **options: Any) -> tuple[list[int], dict[str, Any]]:
    """2 ranks stopped after 30 records each (shuffled: the merged state has tails)."""
    consumed, states = [], []
    for rank in range(2):
        data = dataset(root, rank=rank, world_size=2, **options)
        iterator = iter(data)
        consumed.extend(next(iterator)["id"] for _ in range(30))
        states.append(data.state_dict())
    merged = merge_states(states)
    assert merged["tails"]  # finishing it reads the records after each snapshot
    return consumed, merged


@pytest.mark.parametrize("even_ranks", [None, "pad"])
def test_state_of_a_merged_start_reads_nothing_and_loads_back(
    source: Path, even_ranks: str | None
) -> None:
    _, merged = first_run(source, even_ranks=even_ranks)
    resumed = dataset(source, rank=1, world_size=3, even_ranks=even_ranks, resume_from=merged)
    with unreadable(source):
        state = resumed.state_dict()
    reference = ids(resumed)
    again = dataset(source, rank=1, world_size=3, even_ranks=even_ranks)
    again.load_state_dict(state)
    assert ids(again) == reference


def test_states_before_iter_of_some_readers_merge_with_the_others(source: Path) -> None:
    """3 ranks finish a merged state; rank 0 reads some, ranks 1 and 2 have not started."""
    consumed, merged = first_run(source)
    states = []
    for rank in range(3):
        data = dataset(source, rank=rank, world_size=3, resume_from=merged)
        if rank == 0:
            iterator = iter(data)
            consumed.extend(next(iterator)["id"] for _ in range(20))
        with unreadable(source):
            states.append(data.state_dict())
    rest = []
    for rank in range(2):
        rest.extend(ids(dataset(source, rank=rank, world_size=2,
                                resume_from=merge_states(states))))
    seen = Counter(consumed + rest)
    assert sorted(seen) == list(range(RECORDS)) and set(seen.values()) == {1}


def test_states_before_iter_of_every_reader_merge_to_the_same_state(source: Path) -> None:
    _, merged = first_run(source)
    states = [dataset(source, rank=rank, world_size=3, resume_from=merged).state_dict()
              for rank in range(3)]
    assert merge_states(states) == merged
    with pytest.raises(ValueError, match=r"one state per reader.*missing \(rank, worker\): "
                                         r"\[\(1, 0\), \(2, 0\)\]"):
        merge_states(states[:1])  # rank 0's alone: the others' shares would be read again


def test_state_of_an_even_ranks_epoch_loads_back_with_its_quota(source: Path) -> None:
    for rank in range(3):
        fresh = dataset(source, rank=rank, world_size=3, even_ranks="drop")
        with unreadable(source):
            state = fresh.state_dict()
        reference = ids(fresh)
        again = dataset(source, rank=rank, world_size=3, even_ranks="drop")
        again.load_state_dict(state)
        assert ids(again) == reference


def test_state_of_a_rank_without_work_is_taken_and_iter_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A world detected from torchrun's variables with more ranks than blocks: the rank
    without a block is refused when it starts reading, not when its state is asked for."""
    corpus.write(tmp_path / "one.jsonl", corpus.make_records(10))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    data = StreamingJsonl(str(tmp_path / "one.jsonl"))
    state = data.state_dict()
    assert state["world"] == [3, 4, 0, 1] and state["pipeline"] is None
    with pytest.raises(ValueError, match="rank 3 of world_size=4 has nothing to read"):
        iter(data)


def test_state_loaded_from_another_world_is_returned_and_iter_refuses(source: Path) -> None:
    taker = dataset(source, rank=0, world_size=2)
    iterator = iter(taker)
    next(iterator)
    taken = taker.state_dict()
    loader = dataset(source, rank=1, world_size=2)
    loader.load_state_dict(taken)
    assert loader.state_dict() == taken
    with pytest.raises(StateMismatchError, match="resume with the same world"):
        iter(loader)


def test_an_empty_rank_is_refused_also_where_a_file_size_is_unknown():
    """A server that sends no size (Content-Length) left `shard.size` None: the empty-rank
    check summed the sizes and raised TypeError instead of its message."""
    from types import SimpleNamespace

    from streamds.resume.start import _check_rank_has_work

    shards = [SimpleNamespace(size=None, ranged=True, url="http://127.0.0.1/a.jsonl")]
    layout = SimpleNamespace(plan=SimpleNamespace(num_blocks=1), shards=shards,
                             world_given=False, fingerprint={"corpus": "c"})
    with pytest.raises(ValueError, match=r"rank 1 of world_size=2 has nothing to read: the "
                                         r"corpus is cut into 1 block\(s\)"):
        _check_rank_has_work(layout, World(1, 2, 0, 1))
