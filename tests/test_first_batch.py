"""A first batch after a bounded amount of work (DESIGN.md guarantee 6): with shuffle=True the
map and filter steps run on records as they leave the shuffle buffer, so the buffer holds
parsed records and neither filling it nor re-filling it on a resume runs a step. Under
even_ranks the steps run before the buffer (a reader's quota counts the records they keep).
"""

from __future__ import annotations

import logging
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any

import corpus
import pytest
from resume_contract import checkpoint, ids, run_test_save_load_state

from streamds import (
    CorruptRecordError,
    LengthBuckets,
    StateMismatchError,
    StreamingJsonl,
    merge_states,
)
from streamds.stages import shuffle as shuffle_stage

BUFFER = 1000
COUNT = 3000

calls: Counter[int] = Counter()  # ids the map has been called on (module level: picklable)


def counted(record: dict[str, Any]) -> dict[str, Any]:
    calls[record["id"]] += 1
    return {**record, "mapped": True}


def keep(record: dict[str, Any]) -> bool:
    return record["id"] % 5 != 2


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("first") / "a.jsonl"
    path.write_bytes(corpus.jsonl({"id": i, "text": "t" * (20 + i % 13)} for i in range(COUNT)))
    return str(path)


def shuffled(source: str, **options: Any) -> StreamingJsonl:
    return StreamingJsonl(source, shuffle=True, seed=7, buffer_size=BUFFER, **options)


def test_the_first_record_comes_after_one_map_call(source: str) -> None:
    calls.clear()
    first = next(iter(shuffled(source).map(counted)))
    assert first["mapped"]
    assert sum(calls.values()) == 1  # not the ~1000 records of the buffer


def test_the_first_record_after_a_resume_comes_after_one_map_call(source: str) -> None:
    ds = shuffled(source).filter(keep).map(counted)
    iterator = iter(ds)
    before = list(islice(iterator, 1500))  # mid-epoch: past a round of the buffer
    state = checkpoint(ds.state_dict())
    after = list(iterator)
    calls.clear()
    resumed = shuffled(source).filter(keep).map(counted)
    resumed.load_state_dict(state)
    rest = iter(resumed)
    assert next(rest) == after[0]
    assert sum(calls.values()) <= 5  # the records the filter drops before it: a few
    assert before + after[:1] + list(rest) == before + after


def test_the_map_never_sees_a_record_still_in_the_buffer(source: str) -> None:
    calls.clear()
    ds = shuffled(source).filter(keep).map(counted)
    out = []
    for record in islice(iter(ds), 1500):
        out.append(record["id"])
        # mapped: what came out, and nothing else (the filter runs first and drops a fifth)
        assert set(calls) == set(out)
        assert len(calls) == len(out)
    buffered = ds._active.records.buffered()
    assert len(buffered) == BUFFER
    assert not any("mapped" in record for record in buffered)  # held as parsed, unmapped


def test_every_record_once_and_the_drops_counted(source: str) -> None:
    out = [r["id"] for r in shuffled(source).filter(keep).map(counted)]
    assert sorted(out) == [i for i in range(COUNT) if keep({"id": i})]
    ds = shuffled(source).filter(keep)
    assert len(list(ds)) == len(out)
    assert ds.counts["dropped"] == COUNT - len(out)


def test_resume_is_exact_after_any_record_with_drops_after_the_buffer(
    tmp_path: Path,
) -> None:
    path = tmp_path / "small.jsonl"
    path.write_bytes(corpus.jsonl({"id": i} for i in range(300)))

    def make() -> StreamingJsonl:
        return StreamingJsonl(str(path), shuffle=True, seed=3, buffer_size=40).filter(keep)

    def dropped(ds: StreamingJsonl) -> int:
        return ds.counts["dropped"]

    reference = run_test_save_load_state(make, [0, 1, 39, 100, 200, 239, 240],
                                         after=dropped)
    assert sorted(r["id"] for r in reference) == [i for i in range(300) if keep({"id": i})]


def test_a_state_taken_mid_pool_with_drops_after_the_buffer_merges_exactly(
    source: str,
) -> None:
    def batched(**options: Any) -> StreamingJsonl:
        return (StreamingJsonl(source, shuffle=True, seed=7, buffer_size=50, **options)
                .filter(keep).batch(LengthBuckets(5, buffer_size=12, length="text"),
                                    collate=ids))

    seen, states = [], []
    for rank, taken in ((0, 4), (1, 9)):
        ds = batched(rank=rank, world_size=2)
        iterator = iter(ds)
        seen += [i for batch in islice(iterator, taken) for i in batch]
        while not ds.state_dict()["pipeline"]["emitted"]:  # stop inside a pool
            seen += next(iterator)
        states.append(checkpoint(ds.state_dict()))
    merged = merge_states(states)
    rest = [i for batch in batched().with_resume(merged) for i in batch]
    assert sorted(seen + rest) == [i for i in range(COUNT) if keep({"id": i})]


def test_a_step_that_raises_after_the_buffer_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(corpus.jsonl({"id": i, "text": "x"} for i in range(50)))

    def refuse(record: dict[str, Any]) -> dict[str, Any]:
        if record["id"] == 17:
            raise KeyError("no such field")
        return record

    with pytest.raises(KeyError) as caught:
        list(StreamingJsonl(str(path), shuffle=True, buffer_size=10).map(refuse))
    said = " ".join(getattr(caught.value, "__notes__", [])) + str(caught.value)
    assert "a.jsonl: line 18 (byte offset" in said
    assert "map step 1 of 1" in said


def test_a_bad_line_still_names_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"id": 0}\n{"id": 1}\n{"id": \n{"id": 3}\n')
    with pytest.raises(CorruptRecordError, match=r"a\.jsonl: line 3"):
        list(StreamingJsonl(str(path), shuffle=True, buffer_size=2).map(counted))


def test_under_even_ranks_the_steps_run_before_the_buffer(source: str) -> None:
    calls.clear()
    ds = shuffled(source, even_ranks="pad", rank=0, world_size=2).filter(keep).map(counted)
    next(iter(ds))
    assert sum(calls.values()) > BUFFER // 2  # the buffer filled with mapped records


def test_a_slow_fill_is_logged_once_saying_why(
    source: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shuffle_stage, "SLOW_FILL", 0.0)  # every fill counts as slow
    monkeypatch.setitem(shuffle_stage._said, "slow fill", False)
    caplog.set_level(logging.INFO, logger="streamds.stages.shuffle")
    ds = shuffled(source, even_ranks="pad", rank=0, world_size=2).map(counted)
    next(iter(ds))
    next(iter(ds))
    said = [r.getMessage() for r in caplog.records if "shuffle buffer" in r.getMessage()]
    assert len(said) == 1, said
    assert "filling the shuffle buffer" in said[0]
    assert "1,000 records per reader (buffer_size)" in said[0]
    assert "smaller buffer_size" in said[0]
    assert "under even_ranks the map and filter steps run before the buffer" in said[0]


def test_a_quick_fill_says_nothing(
    source: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(shuffle_stage._said, "slow fill", False)
    caplog.set_level(logging.INFO, logger="streamds.stages.shuffle")
    next(iter(shuffled(source).map(counted)))
    assert not [r for r in caplog.records if "shuffle buffer" in r.getMessage()]


def test_a_state_that_mapped_before_the_buffer_is_refused_naming_why(source: str) -> None:
    ds = shuffled(source).map(counted)
    next(iter(ds))
    state = ds.state_dict()
    state["pipeline"] = state["pipeline"]["source"]  # the shape earlier versions took
    fresh = shuffled(source).map(counted)
    fresh.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="ran the map and filter steps before"):
        next(iter(fresh))
