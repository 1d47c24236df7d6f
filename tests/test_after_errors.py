"""Checkpoints after a failure (guarantee 12): a state taken after a map, a collate or a bad
line raised resumes at the record that failed; nothing after it is lost, nothing before it is
read again. Each case compares the records before the error plus the resumed ones with an
uninterrupted run of the fixed pipeline: the same records in the same order."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from streamds import CorruptRecordError, LengthBuckets, Storage, StreamingJsonl

RECORDS = 3000
FAILING = 333
OPTIONS = {"seed": 3, "buffer_size": 200, "storage": Storage(block_size=64 << 10)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("after-errors") / "c.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"i": i, "pad": "x" * (i % 100)}) + b"\n"
                              for i in range(RECORDS)))
    return path


@pytest.fixture(scope="module")
def big_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Records over 1 KB: ds.loader collates them in the reader (`.batch`), not after."""
    path = tmp_path_factory.mktemp("after-errors-big") / "big.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"i": i, "text": "y" * 1500}) + b"\n"
                              for i in range(500)))
    return path


def fails_on_333(record: dict) -> dict:
    if record["i"] == FAILING:
        raise ValueError("bad record")
    return record


def keeps(record: dict) -> dict:
    return record


def ids_of(items: list) -> list[int]:
    return [record["i"] for record in items]


def read_until_error(ds: StreamingJsonl, error: type[Exception]) -> list[int]:
    got: list[int] = []
    with pytest.raises(error):
        for record in ds:
            got.append(record["i"])
    return got


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_a_state_after_a_failing_map_resumes_at_the_failing_record(corpus, shuffle):
    full = ids_of(list(StreamingJsonl(corpus, shuffle=shuffle, **OPTIONS).map(keeps)))
    ds = StreamingJsonl(corpus, shuffle=shuffle, **OPTIONS).map(fails_on_333)
    before = read_until_error(ds, ValueError)
    state = ds.state_dict()
    fixed = StreamingJsonl(corpus, shuffle=shuffle, **OPTIONS).map(keeps)
    fixed.load_state_dict(state)
    rest = ids_of(list(fixed))
    assert FAILING in rest  # (records of its chunk that were never handed out come first)
    assert before + rest == full


def test_a_state_after_the_last_record_failed_hands_it_out_again(corpus):
    full = ids_of(list(StreamingJsonl(corpus, shuffle=True, **OPTIONS)))
    last = full[-1]

    ds = StreamingJsonl(corpus, shuffle=True, **OPTIONS).map(
        _Fails(last))  # the buffer's final draw raises: the state must not say "finished"
    before = read_until_error(ds, ValueError)
    fixed = StreamingJsonl(corpus, shuffle=True, **OPTIONS)
    fixed.load_state_dict(ds.state_dict())
    assert before + ids_of(list(fixed)) == full


class _Fails:
    """A map that raises on record `i` (picklable, unlike a closure)."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __call__(self, record: dict) -> dict:
        if record["i"] == self.i:
            raise ValueError("bad record")
        return record


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_a_state_after_a_bad_line_resumes_under_skip_with_every_good_record(tmp_path, shuffle):
    path = tmp_path / "bad.jsonl"
    lines = [orjson.dumps({"i": i}) for i in range(RECORDS)]
    lines[FAILING] = b'{"i": 333,'  # malformed
    path.write_bytes(b"\n".join(lines) + b"\n")
    ds = StreamingJsonl(path, shuffle=shuffle, **OPTIONS)
    before = read_until_error(ds, CorruptRecordError)
    skipping = StreamingJsonl(path, shuffle=shuffle, on_error="skip", **OPTIONS)
    full = ids_of(list(skipping))
    skipping.load_state_dict(ds.state_dict())
    assert before + ids_of(list(skipping)) == full
    assert len(full) == RECORDS - 1


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_a_batch_whose_map_fails_is_not_skipped_by_the_state(corpus, shuffle):
    full = [ids_of(batch) for batch in
            StreamingJsonl(corpus, shuffle=shuffle, **OPTIONS).map(keeps).batch(16)]
    ds = StreamingJsonl(corpus, shuffle=shuffle, **OPTIONS).map(fails_on_333).batch(16)
    before: list[list[int]] = []
    with pytest.raises(ValueError):
        for batch in ds:
            before.append(ids_of(batch))
    fixed = StreamingJsonl(corpus, shuffle=shuffle, **OPTIONS).map(keeps).batch(16)
    fixed.load_state_dict(ds.state_dict())
    assert before + [ids_of(batch) for batch in fixed] == full


class _CollateFailsOnce:
    """A collate that raises on its `failing`-th call."""

    def __init__(self, failing: int) -> None:
        self.calls = 0
        self.failing = failing

    def __call__(self, batch: list[dict]) -> list[int]:
        self.calls += 1
        if self.calls == self.failing:
            raise RuntimeError("collate failed")
        return ids_of(batch)


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_a_loader_state_after_a_failing_collate_keeps_the_batch(big_records, shuffle):
    def loader(collate):
        return StreamingJsonl(big_records, shuffle=shuffle, seed=1).loader(
            16, num_workers=0, collate=collate)

    full = list(loader(ids_of))
    failing = loader(_CollateFailsOnce(3))
    assert not failing.small_records  # the collate runs in the reader's batch stage
    before: list[list[int]] = []
    with pytest.raises(RuntimeError, match="collate failed"):
        for batch in failing:
            before.append(batch)
    assert len(before) == 2
    fixed = loader(ids_of)
    fixed.load_state_dict(failing.state_dict())
    assert before + list(fixed) == full


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_a_state_after_a_failing_collate_of_length_buckets_keeps_the_batch(corpus, shuffle):
    rule = LengthBuckets(16, buffer_size=256, length=len_of_pad)

    def batches(collate):
        return StreamingJsonl(corpus, shuffle=shuffle, **OPTIONS).batch(rule, collate=collate)

    full = list(batches(ids_of))
    failing = batches(_CollateFailsOnce(20))
    before: list[list[int]] = []
    with pytest.raises(RuntimeError, match="collate failed"):
        for batch in failing:
            before.append(batch)
    fixed = batches(ids_of)
    fixed.load_state_dict(failing.state_dict())
    assert before + list(fixed) == full


def len_of_pad(record: dict) -> int:
    return len(record["pad"])


class _Interrupted:
    """A map interrupted (Ctrl-C) on record `i`."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __call__(self, record: dict) -> dict:
        if record["i"] == self.i:
            raise KeyboardInterrupt
        return record


@pytest.mark.parametrize("batched", [False, True], ids=["records", "batches"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_a_state_after_an_interrupt_inside_a_step_loses_nothing(corpus, shuffle, batched):
    def built(fn):
        ds = StreamingJsonl(corpus, shuffle=shuffle, **OPTIONS).map(fn)
        return ds.batch(16) if batched else ds

    def flat(items):
        return [i for item in items for i in (ids_of(item) if batched else [item["i"]])]

    full = flat(built(keeps))
    ds = built(_Interrupted(FAILING))
    before: list = []
    with pytest.raises(KeyboardInterrupt):
        for item in ds:
            before.append(item)
    fixed = built(keeps)
    fixed.load_state_dict(ds.state_dict())
    assert flat(before) + flat(fixed) == full
