"""`streamds.parse_later`: a worker's `.batch(n)` of plain records crosses as JSON lines and the
main process parses them: the same records, in the same order, exactly once, resumable; blank
lines, byte-order marks and malformed lines handled as the worker would."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import corpus
import pytest
from resume_contract import run_test_save_load_state
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import CorruptRecordError, LengthBuckets, RecordBatch, StreamingJsonl, counts_of
from streamds.parse import LineNumbers, Parse
from streamds.parse_later import LineBatch, ParseLater, UnreadableBatch
from streamds.plan import make_blocks
from streamds.shards import resolve_shards
from streamds.train import shm_ring

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


def no_parsing(self: Parse, chunk: Any) -> Any:
    raise AssertionError("a worker parsed lines the main process was to parse")


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_workers_leave_the_lines_to_the_main_process(
    lines_only: Path, shuffle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make() -> StreamingJsonl:
        return StreamingJsonl(str(lines_only), shuffle=shuffle, seed=4, buffer_size=50).batch(6)

    in_main = records(batches(make(), 0))
    reference = batches(make(), WORKERS)  # the workers' own order, parsed in the workers
    monkeypatch.setattr(Parse, "parse", no_parsing)  # the workers fork with this
    got = batches(make(), WORKERS)
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
    lines_only: Path, how: str
) -> None:
    ds = StreamingJsonl(str(lines_only), on_error="skip" if how == "skip" else "raise")
    if how == "map":
        ds = ds.map(add_one)
    batched = ds.batch(LengthBuckets(4, buffer_size=64, length=long_text) if how == "rule"
                       else 4)
    got = records(batches(batched, WORKERS))
    assert len(got) == 540 and all(isinstance(r, dict) for r in got)
    if how == "map":
        assert all(r["plus"] == r["id"] + 1 for r in got)


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
    monkeypatch.setattr(Parse, "parse", no_parsing)
    loader = StatefulDataLoader(StreamingJsonl(str(path)).batch(7), batch_size=None,
                                num_workers=WORKERS)
    got = [r["id"] for batch in loader for r in batch]
    assert sorted(got) == every
    assert counts_of(loader.state_dict())["blank"] == blank


def test_a_malformed_line_raises_when_its_batch_is_used_naming_file_and_offset(
    tmp_path: Path,
) -> None:
    good = corpus.jsonl(corpus.make_records(30))
    bad = b'{"id": 30, "text": oops}\n'
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good + bad + corpus.jsonl(corpus.make_records(10, start=31)))
    got = batches(StreamingJsonl(str(path)).batch(4), WORKERS)
    broken = [batch for batch in got if isinstance(batch, UnreadableBatch)]
    assert len(broken) == 1 and "invalid JSON" in repr(broken[0])
    with pytest.raises(CorruptRecordError) as caught:
        len(broken[0])
    err = caught.value
    assert err.url.endswith("bad.jsonl") and err.offset == len(good)
    assert f"byte offset {len(good)}" in str(err) and "parsed in the main process" in str(err)
    assert "on_error='skip'" in str(err) and "oops" in str(err)
    fine = [r["id"] for batch in got if batch is not broken[0] for r in batch]
    assert sorted(fine) == [i for i in range(41) if i not in range(28, 32)]


def test_lines_cross_the_pipe_when_shared_memory_is_full(
    lines_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expect = sorted(r["id"] for r in records(batches(StreamingJsonl(str(lines_only)).batch(9), 0)))
    monkeypatch.setattr(shm_ring, "put", lambda *pieces: None)  # forked into the workers
    monkeypatch.setattr(Parse, "parse", no_parsing)
    before = shm_ring.batches_taken()
    got = batches(StreamingJsonl(str(lines_only), shuffle=True, seed=1).batch(9), WORKERS)
    assert shm_ring.batches_taken() == before
    assert all(type(batch) is RecordBatch for batch in got)
    assert sorted(r["id"] for r in records(got)) == expect


def test_batches_parsed_in_the_main_process_resume_exactly(
    lines_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Parse, "parse", no_parsing)

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
    good = LineBatch([(b'{"a": 1}', 0, 0), (b'{"b": 2}', 0, 9)], where)
    assert len(good) == 2 and good.records == [{"a": 1}, {"b": 2}]
    assert pickle.loads(pickle.dumps(good)) == RecordBatch([{"a": 1}, {"b": 2}])
    bad = LineBatch([(b'{"a": 1}', 0, 0), (b"nope", 0, 18)], where)
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
    from streamds.chunks import Chunk

    chunks = [Chunk(0, 3, [0, 10, 11, 20], [b'{"x": 1}', b"", b'{"x": 2}'], False)]
    stage = ParseLater(Lines(chunks))
    out = list(stage)
    assert out[0].items[0] == (b'{"x": 1}', 3, 0) and out[0].items[2] == (b'{"x": 2}', 3, 11)
    assert not out[0].clean
    parse = Parse(Lines([]), [], [])
    assert stage.get_state().keys() == parse.get_state().keys()
    assert stage.get_state()["counts"] == {"bad": 0, "blank": 1}
    stage.reset(stage.get_state())
    assert stage.counts["blank"] == 1
