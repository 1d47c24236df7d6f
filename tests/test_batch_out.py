"""`StreamingJsonl.batch`: whole batches out of the workers, exactly once, exact resume."""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from operator import itemgetter
from pathlib import Path
from typing import Any

import pytest
from resume_contract import ids, run_test_save_load_state
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_convert
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import RecordBatch, StateMismatchError, StreamingJsonl, merge_states
from streamds.handover import shm_ring

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


def odd(record: dict[str, Any]) -> bool:
    return record["id"] % 2 == 1


def dataset(source: Path, *, shuffle: bool, **batch: Any) -> StreamingJsonl:
    ds = StreamingJsonl(str(source), shuffle=shuffle, seed=3, buffer_size=16).filter(odd)
    return ds.batch(7, collate=ids, **batch)


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_hold_every_record_once_and_resume_exactly(
    mixed: tuple[Path, list[int]], shuffle: bool, num_workers: int
) -> None:
    source, every = mixed

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(dataset(source, shuffle=shuffle), batch_size=None,
                                  num_workers=num_workers)

    reference = run_test_save_load_state(make, [0, 1, 5, 17])
    flat = [i for batch in reference for i in batch]
    assert sorted(flat) == sorted(i for i in every if i % 2 == 1)
    assert all(len(batch) == 7 for batch in reference[:-num_workers or None][:-1])
    # the same records, in the same order, as batching in the main process
    plain = DataLoader(StreamingJsonl(str(source), shuffle=shuffle, seed=3,
                                      buffer_size=16).filter(odd),
                       batch_size=7, num_workers=num_workers, collate_fn=ids)
    assert reference == list(plain)


def test_drop_last_drops_each_readers_short_batch(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    kept = list(dataset(source, shuffle=False, drop_last=True))
    every = list(dataset(source, shuffle=False))
    assert all(len(batch) == 7 for batch in kept)
    assert kept == every[: len(kept)] and len(every[-1]) < 7


def test_a_state_of_the_unbatched_dataset_is_refused(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    plain = StreamingJsonl(str(source))
    iterator = iter(plain)
    next(iterator)
    with pytest.raises(StateMismatchError, match=r"without \.batch\(\) but is loaded"):
        StreamingJsonl(str(source)).batch(7).load_state_dict(plain.state_dict())
    batched = StreamingJsonl(str(source)).batch(7)
    next(iter(batched))
    with pytest.raises(StateMismatchError, match=r"with \.batch\(n\) but is loaded"):
        StreamingJsonl(str(source)).load_state_dict(batched.state_dict())


def test_batched_states_merge_for_an_elastic_resume(mixed: tuple[Path, list[int]]) -> None:
    source, every = mixed
    states, seen = [], []
    for rank in (0, 1):
        ds = StreamingJsonl(str(source), shuffle=True, seed=3, buffer_size=16, rank=rank,
                            world_size=2).batch(5, collate=ids)
        iterator = iter(ds)
        seen += [i for _ in range(3) for i in next(iterator)]
        states.append(ds.state_dict())
    merged = merge_states(states)
    rest = [i for batch in StreamingJsonl(str(source), shuffle=True, seed=3,
                                          buffer_size=16).with_resume(merged).batch(5, collate=ids)
            for i in batch]
    assert sorted(seen + rest) == sorted(every)


def test_bad_batch_arguments_name_the_fix(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    ds = StreamingJsonl(str(source))
    with pytest.raises(ValueError, match="size must be an integer >= 1"):
        ds.batch(0)
    with pytest.raises(ValueError, match="collate must be callable"):
        ds.batch(4, collate="ids")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="makes batches of 4"):
        ds.batch(4).resume_after_batches(1, batch_size=8, num_workers=0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_without_a_collate_pass_torch_default_conversion_untouched(
    mixed: tuple[Path, list[int]], num_workers: int
) -> None:
    source, every = mixed
    ds = StreamingJsonl(str(source)).batch(7)
    seen = []
    for batch in DataLoader(ds, batch_size=None, num_workers=num_workers):
        assert isinstance(batch, RecordBatch), type(batch).__name__
        assert all(isinstance(record, dict) for record in batch)
        seen += [record["id"] for record in batch.records]
    assert seen == every if num_workers == 0 else sorted(seen) == sorted(every)
    # torch's conversion (what DataLoader(batch_size=None) applies) walks a list, not this
    batch = next(iter(ds))
    assert default_convert(batch) is batch
    assert default_convert(batch.records) is not batch.records


def test_a_record_batch_reads_like_its_list() -> None:
    records = [{"id": 1}, {"id": 2}]
    batch = RecordBatch(records)
    assert batch == records and batch == RecordBatch(list(records)) and batch != records[:1]
    assert len(batch) == 2 and batch[1] == {"id": 2} and batch[:1] == [{"id": 1}]
    assert list(batch) == records
    assert pickle.loads(pickle.dumps(batch)) == batch


def tupled(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "pair": (record["id"], 1)}


class Tag:
    """Something marshal cannot carry (a map may make anything)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tag) and other.value == self.value


def tagged(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "tag": Tag(record["id"])}


def worker_batches(ds: IterableDataset, **loader: Any) -> tuple[list[Any], int]:
    """The batches 2 workers hand over, and how many came through shared memory."""
    before = shm_ring.batches_taken()
    batches = list(DataLoader(ds, batch_size=None, num_workers=2, **loader))
    return batches, shm_ring.batches_taken() - before


def shm_files() -> list[str]:
    return sorted(name for name in os.listdir(shm_ring.SHM_DIR) if name.startswith("streamds-"))


@pytest.mark.skipif(not os.path.isdir(shm_ring.SHM_DIR), reason="no /dev/shm here")
def test_worker_batches_cross_in_shared_memory_exactly(mixed: tuple[Path, list[int]]) -> None:
    source, every = mixed
    leftover = shm_files()
    for ds, expect in ((StreamingJsonl(str(source)).filter(odd).batch(7),
                        [{"id": i} for i in every if i % 2]),
                       (StreamingJsonl(str(source)).map(tupled).batch(7),
                        [{"id": i, "pair": (i, 1)} for i in every])):
        batches, in_shm = worker_batches(ds)
        assert in_shm == len(batches) > 2
        assert all(type(batch) is RecordBatch for batch in batches)
        got = [{k: v for k, v in r.items() if k in ("id", "pair")} for b in batches for r in b]
        key = itemgetter("id")
        assert sorted(got, key=key) == sorted(expect, key=key)  # tuples stay tuples
    assert shm_files() == leftover  # each ring's file was removed once mapped


class CopiedInTheWorker(IterableDataset):
    """Copies and pickles each batch in the worker before handing it over, as code that
    wraps the dataset might."""

    def __init__(self, source: StreamingJsonl) -> None:
        self.source = source

    def __iter__(self) -> Iterator[RecordBatch]:
        for batch in self.source:
            assert copy.copy(batch) == batch and copy.deepcopy(batch) == batch
            assert pickle.loads(pickle.dumps(batch)) == batch  # as its list
            assert pickle.loads(ForkingPickler.dumps(batch)) == batch  # through its own ring
            yield batch


@pytest.mark.skipif(not os.path.isdir(shm_ring.SHM_DIR), reason="no /dev/shm here")
def test_a_batch_pickled_in_its_worker_still_reaches_the_main_process_once(
    mixed: tuple[Path, list[int]]
) -> None:
    source, every = mixed
    batches, in_shm = worker_batches(CopiedInTheWorker(StreamingJsonl(str(source)).batch(7)))
    assert in_shm == len(batches)
    assert sorted(r["id"] for b in batches for r in b) == sorted(every)


def test_worker_batches_marshal_cannot_carry_are_pickled(mixed: tuple[Path, list[int]]) -> None:
    source, every = mixed
    batches, in_shm = worker_batches(StreamingJsonl(str(source)).map(tagged).batch(7))
    assert in_shm == 0
    assert sorted((r["id"], r["tag"].value) for b in batches for r in b) == [
        (i, i) for i in sorted(every)]


def test_worker_batches_cross_the_pipe_without_shared_memory(
    mixed: tuple[Path, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, every = mixed
    monkeypatch.setattr(shm_ring, "SHM_DIR", str(tmp_path / "no-shm"))  # workers fork with it
    batches, in_shm = worker_batches(StreamingJsonl(str(source)).batch(7))
    assert in_shm == 0
    assert sorted(r["id"] for b in batches for r in b) == sorted(every)


@pytest.mark.skipif(not os.path.isdir(shm_ring.SHM_DIR), reason="no /dev/shm here")
def test_batches_that_do_not_fit_the_ring_cross_the_pipe(
    mixed: tuple[Path, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, every = mixed
    # a ring of 2 KiB: small batches fit, a batch of 40 records does not
    monkeypatch.setattr(shm_ring, "MIN_SIZE", 2048)
    monkeypatch.setattr(shm_ring, "MAX_SIZE", 2048)
    small, in_shm = worker_batches(StreamingJsonl(str(source)).batch(2), prefetch_factor=8)
    assert 0 < in_shm <= len(small)
    big, in_shm = worker_batches(StreamingJsonl(str(source)).batch(40))
    assert in_shm < len(big) - 2  # full batches did not fit (a short last one may)
    for batches in (small, big):
        assert sorted(r["id"] for b in batches for r in b) == sorted(every)


def test_record_batches_from_workers_resume_exactly(mixed: tuple[Path, list[int]]) -> None:
    source, every = mixed

    def make() -> StatefulDataLoader:
        ds = StreamingJsonl(str(source), shuffle=True, seed=5, buffer_size=16).batch(5)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2)

    reference = run_test_save_load_state(make, [0, 3, 11])
    assert sorted(r["id"] for b in reference for r in b) == sorted(every)


def test_a_record_batch_pickles_as_its_list_outside_a_worker() -> None:
    batch = RecordBatch([{"blob": b"\x00", "big": 2**70, "pair": (1, 2)}])
    assert pickle.loads(pickle.dumps(batch)) == batch
    assert b"marshal" not in pickle.dumps(batch)  # a portable pickle, not marshal bytes
