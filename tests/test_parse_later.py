"""`streamds.stages.parse_later`: a worker's `.batch(n)` of plain records crosses as JSON lines
and the main process parses them: the same records, in the same order, exactly once, resumable;
blank lines, byte-order marks and malformed lines handled as the worker would."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import corpus
import pytest
from resume_contract import run_test_save_load_state
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import (
    CorruptRecordError,
    LengthBuckets,
    RecordBatch,
    StreamingJsonl,
    counts_of,
    merge_states,
    stateful_loader,
)
from streamds.handover import shm_ring
from streamds.stages.parse import BLANK, LineNumbers, Parse
from streamds.stages.parse_later import LineBatch, ParseLater
from streamds.storage.plan import make_blocks
from streamds.storage.shards import resolve_shards

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

WORKERS = 2


@pytest.fixture(scope="module")
def lines_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JSONL shards only (plain, gzip, seekable zstd), several blocks each."""
    directory = tmp_path_factory.mktemp("later")
    corpus.write_plain(directory / "a.jsonl", corpus.jsonl(corpus.make_records(300)))
    corpus.write_gz(directory / "b.jsonl.gz", corpus.jsonl(corpus.make_records(40, start=1000)))
    corpus.write_seekable_zst(directory / "c.jsonl.zst",
                              corpus.jsonl(corpus.make_records(200, start=2000)))
    return directory


def batches(ds: StreamingJsonl, num_workers: int, **loader: Any) -> list[Any]:
    return list(DataLoader(ds, batch_size=None, num_workers=num_workers, **loader))


def records(batches_: list[Any]) -> list[Any]:
    return [record for batch in batches_ for record in batch]


def no_parsing(*args: Any) -> Any:
    raise AssertionError("a worker parsed lines the main process was to parse")


def refuse_parsing_in_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers fork with these: neither the parse stage nor a batch may parse there."""
    monkeypatch.setattr(Parse, "parse", no_parsing)
    monkeypatch.setattr(LineBatch, "_parse", no_parsing)


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_workers_leave_the_lines_to_the_main_process(
    lines_only: Path, shuffle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make(on_error: str = "raise") -> StreamingJsonl:
        return StreamingJsonl(str(lines_only), shuffle=shuffle, seed=4, buffer_size=50,
                              on_error=on_error).batch(6)

    in_main = records(batches(make(), 0))
    reference = batches(make("skip"), WORKERS)  # skip: parsed in the workers, as before
    refuse_parsing_in_workers(monkeypatch)
    before = shm_ring.batches_taken()
    got = batches(make(), WORKERS)
    assert shm_ring.batches_taken() - before == len(got)  # every batch through shared memory
    assert all(type(batch) is RecordBatch for batch in got)
    assert [batch.records for batch in got] == [batch.records for batch in reference]
    assert sorted(r["id"] for r in records(got)) == sorted(r["id"] for r in in_main)
    assert len(records(got)) == 540
    if not shuffle:
        assert records(got) != in_main or len(got) == 1  # two workers interleave batches


def ids_of(batch: Any) -> list[int]:
    return [record["id"] for record in batch]


def test_a_collate_fn_in_the_worker_sees_parsed_records(
    lines_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Parse, "parse", no_parsing)  # the records parse as the collate asks
    got = batches(StreamingJsonl(str(lines_only)).batch(8), WORKERS, collate_fn=ids_of)
    assert all(isinstance(batch, list) for batch in got)
    assert sorted(i for batch in got for i in batch) == sorted(range(300)) + sorted(
        [*range(1000, 1040), *range(2000, 2200)])


def add_one(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "plus": record["id"] + 1}


def long_text(record: dict[str, Any]) -> int:
    return len(record["text"])


@pytest.mark.parametrize("how", ["map", "skip", "rule"])
def test_what_needs_the_values_in_the_worker_still_parses_there(
    lines_only: Path, how: str, tmp_path: Path
) -> None:
    source = [str(lines_only)]
    if how == "skip":  # a malformed line, skipped and counted in the worker
        (tmp_path / "bad.jsonl").write_bytes(b'{"id": -1}\nnot json\n')
        source.append(str(tmp_path / "bad.jsonl"))
    ds = StreamingJsonl(source, on_error="skip" if how == "skip" else "raise")
    if how == "map":
        ds = ds.map(add_one)
    batched = ds.batch(LengthBuckets(4, buffer_size=64, length=long_text) if how == "rule"
                       else 4)
    # (streamds' loader: its state after the epoch holds each worker's end, so it counts all)
    loader = stateful_loader(batched, batch_size=None, num_workers=WORKERS)
    got = [record for batch in loader for record in batch]
    assert len(got) == 540 + (how == "skip") and all(isinstance(r, dict) for r in got)
    if how == "map":
        assert all(r["plus"] == r["id"] + 1 for r in got)
    if how == "skip":
        assert counts_of(loader.state_dict())["bad"] == 1


@pytest.fixture()
def messy(tmp_path: Path) -> tuple[Path, list[int], int]:
    """A file with a byte-order mark, CRLF line ends, blank and whitespace-only lines."""
    lines = [b"\xef\xbb\xbf" + b'{"id": 0}']
    blank = 0
    for i in range(1, 120):
        lines.append(b'{"id": %d}\r' % i if i % 3 else b'{"id": %d}' % i)
        if i % 17 == 0:
            lines += [b"", b"   ", b"\t\r"]
            blank += 3
    path = tmp_path / "messy.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, list(range(120)), blank


def test_blank_lines_and_a_byte_order_mark_as_the_worker_would_count_them(
    messy: tuple[Path, list[int], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, every, blank = messy
    refuse_parsing_in_workers(monkeypatch)
    loader = StatefulDataLoader(StreamingJsonl(str(path)).batch(7), batch_size=None,
                                num_workers=WORKERS)
    got = [r["id"] for batch in loader for r in batch]
    assert sorted(got) == every
    assert counts_of(loader.state_dict())["blank"] == blank


def test_a_malformed_line_raises_from_next_before_the_state_counts_its_batch(
    tmp_path: Path,
) -> None:
    good = corpus.jsonl(corpus.make_records(30))
    bad = b'{"id": 30, "text": oops}\n'
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good + bad + corpus.jsonl(corpus.make_records(10, start=31)))

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(StreamingJsonl(str(path)).batch(4), batch_size=None,
                                  num_workers=1)

    loader = make()
    seen: list[int] = []
    with pytest.raises(CorruptRecordError) as caught:
        for batch in loader:
            seen += [r["id"] for r in batch]
    err = caught.value
    assert err.url.endswith("bad.jsonl") and err.offset == len(good)
    assert err.line == 31 and "line 31 (" in str(err)  # a local file: counted in the main process
    assert f"byte offset {len(good)}" in str(err) and "parsed in the main process" in str(err)
    assert "on_error='skip'" in str(err) and "oops" in str(err)
    assert seen == list(range(28))  # the batches before the bad one: 7 of 4 records
    # the state taken at the error stands before the bad batch: a resume meets it again,
    # and one with on_error="skip" (parsed in the worker) skips and counts just that line
    state = loader.state_dict()
    again = make()
    again.load_state_dict(state)
    with pytest.raises(CorruptRecordError):
        next(iter(again))
    skipping = stateful_loader(StreamingJsonl(str(path), on_error="skip").batch(4),
                               batch_size=None, num_workers=1)  # counts to each worker's end
    skipping.load_state_dict(state)
    rest = [r["id"] for batch in skipping for r in batch]
    assert seen + rest == [i for i in range(41) if i != 30]
    assert counts_of(skipping.state_dict())["bad"] == 1


def test_a_malformed_line_of_a_remote_file_is_named_by_its_line() -> None:
    """The worker's message carries the file's URL only; the main process counts the line
    through the shard it listed (a remote file's storage stays in the main process)."""
    import fsspec

    good = corpus.jsonl(corpus.make_records(25))
    fs = fsspec.filesystem("memory")
    with fs.open("/parse-later/remote.jsonl", "wb") as f:
        f.write(good + b'{"id": "cut\n' + corpus.jsonl(corpus.make_records(5, start=26)))
    try:
        loader = DataLoader(StreamingJsonl("memory://parse-later/remote.jsonl").batch(8),
                            batch_size=None, num_workers=1)
        with pytest.raises(CorruptRecordError) as caught:
            for _ in loader:
                pass
    finally:
        fs.rm("/parse-later", recursive=True)
    assert caught.value.line == 26 and "line 26 (" in str(caught.value)
    assert f"byte offset {len(good)}" in str(caught.value)


def test_lines_cross_the_pipe_when_shared_memory_is_full(
    lines_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expect = sorted(r["id"] for r in records(batches(StreamingJsonl(str(lines_only)).batch(9), 0)))
    monkeypatch.setattr(shm_ring, "put", lambda *pieces: None)  # forked into the workers
    refuse_parsing_in_workers(monkeypatch)
    before = shm_ring.batches_taken()
    got = batches(StreamingJsonl(str(lines_only), shuffle=True, seed=1).batch(9), WORKERS)
    assert shm_ring.batches_taken() == before
    assert all(type(batch) is RecordBatch for batch in got)
    assert sorted(r["id"] for r in records(got)) == expect


def test_batches_parsed_in_the_main_process_resume_exactly(
    lines_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_parsing_in_workers(monkeypatch)

    def make() -> StatefulDataLoader:
        ds = StreamingJsonl(str(lines_only), shuffle=True, seed=2, buffer_size=32).batch(5)
        return StatefulDataLoader(ds, batch_size=None, num_workers=WORKERS)

    reference = run_test_save_load_state(make, [0, 4, 13, 60])
    assert len([r for batch in reference for r in batch]) == 540


# -- the pieces, in this process --------------------------------------------------------------

def one_file(tmp_path: Path, data: bytes) -> LineNumbers:
    path = tmp_path / "one.jsonl"
    path.write_bytes(data)
    shards = resolve_shards(str(path))
    return LineNumbers(shards, make_blocks(shards))


def test_a_line_batch_parses_where_it_is_used_with_line_numbers(tmp_path: Path) -> None:
    where = one_file(tmp_path, b'{"a": 1}\n{"b": 2}\nnope\n')
    good = LineBatch([b'{"a": 1}', b'{"b": 2}'], [0, 0], [0, 9], where)
    assert len(good) == 2 and good.records == [{"a": 1}, {"b": 2}]
    assert pickle.loads(pickle.dumps(good)) == RecordBatch([{"a": 1}, {"b": 2}])
    bad = LineBatch([b'{"a": 1}', b"nope"], [0, 0], [0, 18], where)
    with pytest.raises(CorruptRecordError, match=r"one\.jsonl: line 3 \(byte offset 18\)"):
        list(bad)


class Lines:
    """A source of raw-line chunks, for the stage alone."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks

    def reset(self, state: Any = None) -> None:
        pass

    def get_state(self) -> dict[str, Any]:
        return {"fake": 1}

    @property
    def counts(self) -> dict[str, int]:
        return {}

    def __iter__(self) -> Any:
        return iter(self.chunks)


def test_the_stage_keeps_the_state_shape_of_parse() -> None:
    from streamds.stages.chunks import Chunk

    chunks = [Chunk(0, 3, [0, 10, 11, 20], [b'{"x": 1}', b"", b'{"x": 2}'], False)]
    stage = ParseLater(Lines(chunks))
    out = list(stage)
    assert out[0].items == [b'{"x": 1}', BLANK, b'{"x": 2}'] and not out[0].clean
    parse = Parse(Lines([]), [], [])
    assert stage.get_state().keys() == parse.get_state().keys()
    assert stage.get_state()["counts"] == {"bad": 0, "blank": 1}
    stage.reset(stage.get_state())
    assert stage.counts["blank"] == 1


def test_a_state_from_workers_that_parse_later_merges_into_another_world(
    lines_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dataset(**more: Any) -> StreamingJsonl:
        return StreamingJsonl(str(lines_only), shuffle=True, seed=8, buffer_size=40, **more)

    with monkeypatch.context() as patched:
        refuse_parsing_in_workers(patched)
        loader = StatefulDataLoader(dataset().batch(6), batch_size=None, num_workers=WORKERS)
        batches_ = iter(loader)
        consumed = [r["id"] for _ in range(9) for r in next(batches_)]
        state = loader.state_dict()
        del batches_, loader
    merged = merge_states([state])
    rest = [r["id"] for r in dataset().with_resume(merged)]  # 0 workers, 1 reader
    assert sorted(consumed + rest) == sorted(r["id"] for r in dataset())


@pytest.mark.parametrize("mode", ["pad", "drop"])
def test_even_ranks_with_workers_that_parse_later(
    lines_only: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def per_rank(on_error: str) -> list[list[int]]:
        return [[r["id"] for r in records(batches(
            StreamingJsonl(str(lines_only), rank=rank, world_size=3, even_ranks=mode,
                           on_error=on_error).batch(5), WORKERS))] for rank in range(3)]

    parsed_in_workers = per_rank("skip")
    refuse_parsing_in_workers(monkeypatch)
    got = per_rank("raise")
    assert got == parsed_in_workers  # each rank: the same records in the same order
    assert len({len(ids) for ids in got}) == 1  # every rank the same number
    every = [i for ids in got for i in ids]
    if mode == "drop":
        assert len(every) == len(set(every))
    else:
        assert len(set(every)) == 540
