"""`ds.loader(...)`: one call; exactly once, exact resume, len, collate in the workers."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import corpus
import numpy as np
import pytest
from resume_contract import ids, records, run_test_save_load_state
from torch.utils.data import DataLoader

from streamds import StreamingJsonl
from streamds.handover import shm_ring
from streamds.train.loader import Loader, auto_workers, usable_cpus

pytestmark = [pytest.mark.filterwarnings("error:'set_vital' is deprecated:UserWarning")]

COUNT = 300


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loader") / "part.jsonl"
    corpus.write_plain(path, corpus.jsonl(records(COUNT, 0)))
    return path


def pid_and_ids(batch: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """A collate that says which process ran it."""
    return os.getpid(), ids(batch)


def make(source: Path, workers: int, small: bool, **options: Any) -> Loader:
    ds = StreamingJsonl(str(source), shuffle=True, seed=3, buffer_size=32)
    return ds.loader(7, num_workers=workers, small_records=small, **options)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_record_once_collated_where_the_route_says(source: Path, workers: int,
                                                        small: bool) -> None:
    batches = list(make(source, workers, small, collate=pid_and_ids))
    flat = [i for _, batch in batches for i in batch]
    assert sorted(flat) == list(range(COUNT))
    sizes = [len(batch) for _, batch in batches]
    if small or workers == 0:  # one stream: only the last batch is short
        assert sizes == [7] * (COUNT // 7) + [COUNT % 7]
    made_in = {pid for pid, _ in batches}
    # small records: collated in the main process; else where the batches are made
    assert made_in == {os.getpid()} if small or workers == 0 else os.getpid() not in made_in


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_after_any_batch_resumes_exactly(source: Path, workers: int,
                                                 small: bool) -> None:
    run_test_save_load_state(lambda: make(source, workers, small, collate=ids),
                             [0, 1, 3, 4, 8, 20])


def test_default_collate_hands_over_records_of_unequal_lists(tmp_path: Path) -> None:
    path = tmp_path / "ragged.jsonl"
    rows = [{"id": i, "text": "x" * i, "sections": ["a"] * (i % 4)} for i in range(20)]
    corpus.write_plain(path, corpus.jsonl(rows))
    batches = list(StreamingJsonl(str(path)).loader(8, num_workers=0))
    assert [len(batch) for batch in batches] == [8, 8, 4]
    assert batches[0][3] == rows[3]  # torch's default collate would fail on these


def with_array(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "array": np.arange(3)}


@pytest.mark.parametrize("small, workers", [(False, 0), (False, 2), (True, 0), (True, 2)])
def test_batches_are_handed_on_as_made(source: Path, workers: int, small: bool) -> None:
    """Neither route runs torch's default conversion over a batch (it copies every record,
    walks every value, and turns arrays into tensors): the records come as the map made
    them."""
    ds = StreamingJsonl(str(source)).map(with_array)
    seen = 0
    for batch in ds.loader(7, num_workers=workers, small_records=small):
        assert type(batch) is list
        assert all(type(record["array"]) is np.ndarray for record in batch)
        seen += len(batch)
    assert seen == COUNT


def buffers(record: dict[str, Any]) -> dict[str, Any]:
    """Values marshal would silently write as bytes (they have the buffer protocol)."""
    i = record["id"]
    return {"id": i, "scalar": np.int64(i), "nested": [[np.float32(0.5)], bytearray(b"ab")]}


def test_values_a_map_makes_cross_from_the_workers_unchanged(source: Path) -> None:
    """A worker's batch is marshalled only where marshal gives it back as it was: numpy
    scalars and arrays, a bytearray, anywhere in a record, arrive as the map made them."""
    batches = DataLoader(StreamingJsonl(str(source)).map(buffers).batch(5), batch_size=None,
                         num_workers=2)
    seen = [record for batch in batches for record in batch]
    assert sorted(record["id"] for record in seen) == list(range(COUNT))
    for record in seen:
        assert type(record["scalar"]) is np.int64 and record["scalar"] == record["id"]
        assert type(record["nested"][0][0]) is np.float32
        assert type(record["nested"][1]) is bytearray


def test_set_epoch_chooses_the_order(source: Path) -> None:
    loader = make(source, 0, False, collate=ids)
    first = [i for batch in loader for i in batch]
    loader.set_epoch(1)
    second = [i for batch in loader for i in batch]
    assert sorted(first) == sorted(second) and first != second


def test_the_route_follows_the_mean_record_size(tmp_path: Path) -> None:
    from streamds.preprocess.convert import convert

    for width, small in ((60, True), (3000, False)):
        src = tmp_path / f"in{width}.jsonl"
        corpus.write_plain(src, corpus.jsonl(records(50, 0, width=width)))
        convert([str(src)], tmp_path / f"out{width}")
        converted = StreamingJsonl(str(tmp_path / f"out{width}"))
        assert converted.loader(8, num_workers=0).small_records is small
    # plain JSONL lists no record counts: the size is read off its first lines
    for width, small in ((60, True), (3000, False)):
        plain = str(tmp_path / f"in{width}.jsonl")
        assert StreamingJsonl(plain).loader(8, num_workers=0).small_records is small


@pytest.mark.parametrize("workers", [0, 2])
def test_without_a_collate_batches_are_lists_on_either_route(source: Path,
                                                             workers: int) -> None:
    for small in (False, True):
        taken = shm_ring.batches_taken()
        batches = list(make(source, workers, small))
        assert {type(batch) for batch in batches} == {list}
        assert sorted(r["id"] for batch in batches for r in batch) == list(range(COUNT))
        # from workers, every batch crossed in their shared-memory rings (as lines, parsed
        # here), none pickled through the pipe
        crossed = shm_ring.batches_taken() - taken
        if workers == 0:
            assert crossed == 0
        elif not small:  # a message per batch
            assert crossed == len(batches)
        else:  # big messages, cut here
            assert 0 < crossed < len(batches)


@pytest.mark.parametrize(("cpus", "workers"), [(1, 0), (2, 2), (6, 6), (32, 8)])
def test_auto_workers_follow_the_usable_cpus(monkeypatch: pytest.MonkeyPatch, cpus: int,
                                             workers: int) -> None:
    # the affinity mask, not the machine's CPU count: a launcher may bind a rank to a few
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cpus() == cpus
    assert auto_workers() == workers


@pytest.mark.parametrize(("options", "says"), [
    ({"collate_fn": ids}, "collate_fn= is set by Loader"),
    ({"num_workers": -1}, "num_workers"),
    ({"small_records": "yes"}, "small_records"),
])
def test_bad_options_are_refused_naming_them(source: Path, options: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        StreamingJsonl(str(source)).loader(8, **options)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mix_has_the_loader_too(tmp_path: Path, workers: int) -> None:
    from streamds import Mix

    paths = []
    for start in (0, 1000):
        path = tmp_path / f"{start}.jsonl"
        corpus.write_plain(path, corpus.jsonl(records(60, start)))
        paths.append(str(path))

    def make() -> Loader:
        mix = Mix([StreamingJsonl(p, shuffle=True) for p in paths], weights=[1, 1], seed=1)
        return mix.loader(8, num_workers=workers, collate=ids)

    batches = list(make())
    assert sorted(i for batch in batches for i in batch) == [*range(60), *range(1000, 1060)]
    run_test_save_load_state(make, [0, 3, 7], expected=batches)


def fails_at_id_200(record: dict[str, Any]) -> dict[str, Any]:
    if record["id"] == 200:
        raise ValueError("record 200 is bad")
    return record


@pytest.mark.parametrize("small", [False, True])
def test_a_failed_epoch_stops_its_workers_before_the_error_reaches_the_loop(
    source: Path, small: bool
) -> None:
    """The error keeps the epoch's iterator alive (a reference cycle); left to the garbage
    collector, its two workers took 10 s to go, in whatever code ran then."""
    ds = StreamingJsonl(str(source)).map(fails_at_id_200)
    loader = ds.loader(7, num_workers=2, small_records=small)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="record 200 is bad") as raised:
        for _ in loader:
            pass
    assert set(multiprocessing.active_children()) - before == set()  # exited and joined
    assert raised.value is not None  # the error (and the iterator it holds) is still alive
    assert loader.state_dict()  # still readable after the failure
    ds.set_epoch(1)
    with pytest.raises(ValueError, match="record 200 is bad"):  # a new epoch starts again
        list(loader)
