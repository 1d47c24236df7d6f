"""`StreamingJsonl.batch`: whole batches out of the workers, exactly once, exact resume."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from resume_contract import ids, run_test_save_load_state, write_mixed
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_convert
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import RecordBatch, StateMismatchError, StreamingJsonl, merge_states
from streamds.batch import JsonRecordBatch

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    directory = tmp_path_factory.mktemp("batch") / "mixed"
    return directory, write_mixed(directory)


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
    rest = [i for batch in StreamingJsonl(str(source), shuffle=True, seed=3, buffer_size=16,
                                          resume_from=merged).batch(5, collate=ids)
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


def test_parsed_records_cross_as_json_and_mapped_ones_as_pickles(
    mixed: tuple[Path, list[int]]
) -> None:
    source, every = mixed
    parsed = StreamingJsonl(str(source)).filter(odd).batch(7)
    assert type(next(iter(parsed))) is JsonRecordBatch
    mapped = StreamingJsonl(str(source)).map(tupled).batch(7)
    assert type(next(iter(mapped))) is RecordBatch  # a map may make what JSON cannot carry
    # what a worker's batch becomes in the main process: the same records, a RecordBatch
    for ds in (parsed, mapped):
        for batch in ds:
            crossed = pickle.loads(pickle.dumps(batch))
            assert type(crossed) is RecordBatch and crossed == batch
    assert next(iter(pickle.loads(pickle.dumps(next(iter(mapped))))))["pair"] == (every[0], 1)
    odd_ids = [r["id"] for batch in DataLoader(parsed, batch_size=None, num_workers=2)
               for r in batch]
    assert sorted(odd_ids) == sorted(i for i in every if i % 2)
    assert pickle.dumps(next(iter(parsed))).count(b'{"id":') == 7  # one JSON document


def test_a_json_batch_falls_back_to_pickle_for_what_json_cannot_carry() -> None:
    batch = JsonRecordBatch([{"blob": b"\x00", "big": 2**70}])
    assert pickle.loads(pickle.dumps(batch)) == batch
