"""Parquet and Arrow IPC sources: the guarantees of JSON lines, over row groups and row ranges.

Row-group sizes and the cut points vary under hypothesis (as the JSONL tests vary files and
frames); real DataLoaders run 2 workers x 3 ranks; values come as `to_pylist()` gives them or
are refused by column; a damaged file is named with its row group.
"""

from __future__ import annotations

import builtins
import datetime
import decimal
import errno
import io
import math
import pickle
import tempfile
import threading
import types
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import corpus
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest
import torch.utils.data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume_contract import ids, run_test_save_load_state, stop_ranks_part_way
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import Mix, StreamingJsonl, merge_states
from streamds.errors import CorruptShardError, MissingCodecError
from streamds.formats import columnar, parquet
from streamds.formats.columnar import UnsupportedColumnError

BATCH = 4


def table(start: int, count: int) -> pa.Table:
    """Rows with ids from `start`; texts of varied length, a list and a null now and then."""
    rows = range(start, start + count)
    return pa.table({
        "id": pa.array(list(rows), pa.int64()),
        "text": pa.array([f"doc {i} " + "w" * ((i * 7919) % 37) for i in rows], pa.string()),
        "tags": pa.array([[i, i + 1] if i % 3 else None for i in rows], pa.list_(pa.int64())),
    })


def write_parquet_files(directory: Path, files: list[list[int]]) -> list[int]:
    """One Parquet file per entry of `files`, whose entries are its row-group sizes; returns
    the ids in corpus order."""
    directory.mkdir(parents=True, exist_ok=True)
    start = 0
    for number, groups in enumerate(files):
        path = directory / f"train-{number:05d}-of-{len(files):05d}.parquet"
        with pq.ParquetWriter(path, table(0, 0).schema) as writer:
            for rows in groups:
                writer.write_table(table(start, rows), row_group_size=max(rows, 1))
                start += rows
    return list(range(start))


def fake_worker(worker: int, num_workers: int):
    """Make this process look like DataLoader worker `worker` of `num_workers`."""
    info = types.SimpleNamespace(id=worker, num_workers=num_workers, seed=0, dataset=None)
    return mock.patch.object(torch.utils.data, "get_worker_info", return_value=info)


def read_world(source: Any, world_size: int, num_workers: int, **options: Any) -> list[list]:
    """Each simulated reader's records, readers in (rank, worker) order."""
    readers = []
    for rank in range(world_size):
        ds = StreamingJsonl(source, rank=rank, world_size=world_size, **options)
        for worker in range(max(num_workers, 1)):
            if num_workers == 0:
                readers.append(list(ds))
                continue
            with fake_worker(worker, num_workers):
                readers.append(list(ds))
    return readers


def assert_exactly_once(parts: list[list[int]], expected: list[int]) -> None:
    seen = Counter(i for part in parts for i in part)
    repeated = sorted(i for i, n in seen.items() if n > 1)
    missing = sorted(set(expected) - set(seen))
    assert not repeated and not missing and set(seen) <= set(expected), (
        f"repeated {repeated[:10]} ({len(repeated)}), missing {missing[:10]} ({len(missing)})"
    )


row_groups = st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=4), min_size=1,
                      max_size=3)


# -- exactly once, order, resume: hypothesis over row-group sizes and cuts -----------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=row_groups, world_size=st.integers(1, 3), num_workers=st.integers(0, 2),
       shuffle=st.booleans(), seed=st.integers(0, 100))
def test_every_world_reads_every_row_exactly_once(files, world_size, num_workers, shuffle,
                                                  seed):
    with tempfile.TemporaryDirectory() as tmp:
        expected = write_parquet_files(Path(tmp) / "data", files)
        readers = read_world(Path(tmp) / "data", world_size, num_workers, shuffle=shuffle,
                             seed=seed, buffer_size=7)
        assert_exactly_once([ids(reader) for reader in readers], expected)
        if not shuffle and world_size == 1 and num_workers == 0:  # file order
            assert ids(readers[0]) == expected


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=row_groups, shuffle=st.booleans(), data=st.data())
def test_exact_resume_after_any_record(files, shuffle, data):
    with tempfile.TemporaryDirectory() as tmp:
        expected = write_parquet_files(Path(tmp) / "data", files)
        cuts = data.draw(st.lists(st.integers(0, len(expected)), min_size=1, max_size=4))

        def make():
            return StreamingJsonl(Path(tmp) / "data", shuffle=shuffle, seed=3, buffer_size=9,
                                  columns=["id"])

        whole = run_test_save_load_state(make, cuts)
        assert sorted(ids(whole)) == expected


def test_one_row_group_feeds_every_reader(tmp_path):
    """One file of one row group is split by rows: every worker of every rank gets rows."""
    expected = write_parquet_files(tmp_path, [[600]])
    readers = read_world(tmp_path, 3, 2)
    assert all(readers)
    assert_exactly_once([ids(reader) for reader in readers], expected)


def test_five_files_feed_two_ranks_of_two_workers_evenly(tmp_path):
    expected = write_parquet_files(tmp_path, [[500]] * 5)
    readers = read_world(tmp_path, 2, 2)
    sizes = [len(reader) for reader in readers]
    assert max(sizes) - min(sizes) <= 0.1 * len(expected) / 4  # within a block or two
    assert_exactly_once([ids(reader) for reader in readers], expected)


# -- real loaders: 2 workers x 3 ranks, exact and elastic resume ---------------------------


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> tuple[Path, list[int]]:
    directory = tmp_path_factory.mktemp("pq") / "data"
    return directory, write_parquet_files(directory, [[70, 50], [130], [20, 20, 20]])


def test_real_loaders_two_workers_three_ranks_exactly_once(corpus_dir):
    path, expected = corpus_dir
    out = []
    for rank in range(3):
        ds = StreamingJsonl(path, shuffle=True, seed=4, rank=rank, world_size=3)
        out += corpus.read_all(ds, 2)
    assert sorted(ids(out)) == expected


def test_exact_resume_after_any_batch_with_two_workers(corpus_dir):
    path, expected = corpus_dir

    def make():
        ds = StreamingJsonl(path, shuffle=True, seed=8, buffer_size=11, rank=1, world_size=3)
        return StatefulDataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=ids)

    whole = run_test_save_load_state(make, [0, 1, 5, 9])
    assert 0 < sum(map(len, whole)) < len(expected)


def test_ds_loader_resumes_exactly_after_any_batch_with_two_workers(corpus_dir):
    """`ds.loader` (batches made in the workers) over Parquet, as test_parquet_torchrun runs
    it under torchrun: a state after any batch resumes at the next one."""
    path, expected = corpus_dir

    def make():
        ds = StreamingJsonl(path, shuffle=True, seed=8, buffer_size=11, rank=2, world_size=3)
        return ds.loader(BATCH, num_workers=2, collate=ids)

    whole = run_test_save_load_state(make, [0, 3, 8])
    assert 0 < sum(map(len, whole)) < len(expected)


@pytest.mark.parametrize("shuffle", [False, True])
def test_elastic_resume_from_three_ranks_of_two_workers(corpus_dir, shuffle):
    path, expected = corpus_dir
    consumed, states = stop_ranks_part_way(
        lambda rank: StatefulDataLoader(
            StreamingJsonl(path, shuffle=shuffle, seed=2, buffer_size=8, rank=rank,
                           world_size=3), batch_size=BATCH, num_workers=2, collate_fn=ids),
        [3, 0, 7])
    merged = pickle.loads(pickle.dumps(merge_states(states)))
    rest = []
    for rank in range(2):
        ds = StreamingJsonl(path, shuffle=shuffle, seed=2, buffer_size=8, rank=rank,
                            world_size=2).with_resume(merged)
        rest += ids(corpus.read_all(ds, 1))
    assert_exactly_once([consumed, rest], expected)


def test_even_ranks_give_every_rank_the_same_count(corpus_dir):
    path, _ = corpus_dir
    counts = [len(list(StreamingJsonl(path, rank=rank, world_size=3, even_ranks="drop")))
              for rank in range(3)]
    assert len(set(counts)) == 1 and counts[0] > 0


def test_len_from_the_footers(corpus_dir):
    path, expected = corpus_dir
    assert len(StreamingJsonl(path)) == len(expected)
    assert sum(len(StreamingJsonl(path, rank=r, world_size=3)) for r in range(3)) == len(expected)


def test_mix_of_parquet_and_jsonl_resumes_exactly(corpus_dir, tmp_path):
    path, expected = corpus_dir
    corpus.write(tmp_path / "more.jsonl", [{"id": 10_000 + i} for i in range(50)])

    def make():
        return Mix([StreamingJsonl(path, columns=["id"]), StreamingJsonl(tmp_path)],
                   [0.7, 0.3], seed=1)

    whole = run_test_save_load_state(make, [0, 13, 100])
    seen = ids(whole)
    jsonl = set(range(10_000, 10_050))
    assert len(seen) == len(set(seen))  # no record twice, across both formats
    assert set(seen) <= set(expected) | jsonl
    assert set(seen) & set(expected) and set(seen) & jsonl  # both sources were drawn from


def test_cache_serves_the_same_records(corpus_dir, tmp_path):
    path, expected = corpus_dir
    calls = []

    def double(record):
        calls.append(record["id"])
        return {"n": record["id"] * 2}

    ds = StreamingJsonl(path, shuffle=True, seed=1).map(double)
    cached = ds.cache(tmp_path / "cache", key="double")
    first = list(cached)
    assert first == list(ds) and sorted(calls) == sorted(expected * 2)  # cached and plain
    calls.clear()
    cached.set_epoch(1)
    ds.set_epoch(1)
    second = list(cached)
    assert calls == []  # epoch 1 came from the cache: the map ran for no record
    assert second == list(ds) and sorted(r["n"] for r in second) == sorted(2 * i for i in expected)


# -- columns and values ---------------------------------------------------------------------


def test_columns_reads_only_the_named_columns(corpus_dir):
    path, _ = corpus_dir
    record = next(iter(StreamingJsonl(path, columns=["text", "id"])))
    assert set(record) == {"id", "text"}


def test_columns_naming_a_missing_column_is_refused_in_the_constructor(corpus_dir):
    path, _ = corpus_dir
    with pytest.raises(ValueError, match=r"no column 'abstract'.*fix columns"):
        StreamingJsonl(path, columns=["abstract"])


def test_other_columns_are_another_corpus_for_a_state(corpus_dir):
    path, _ = corpus_dir
    state = StreamingJsonl(path, columns=["id"]).state_dict()
    with pytest.raises(ValueError):
        StreamingJsonl(path, columns=["text"]).load_state_dict(state)


def test_values_are_what_to_pylist_gives(tmp_path):
    big = 2**62 + 1  # exact in int64, not in a float
    values = pa.table({
        "big": pa.array([big, None], pa.int64()),
        "ratio": [0.1, float("nan")],
        "nested": [{"a": [1, 2], "b": "x"}, None],
        "raw": pa.array([b"\x00\xff", None], pa.binary()),
        "day": [datetime.date(2024, 1, 2), None],
        "at": pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5, 6), None], pa.timestamp("us")),
        "flag": [True, None],
    })
    pq.write_table(values, tmp_path / "v.parquet")
    got = list(StreamingJsonl(tmp_path / "v.parquet"))
    want = values.to_pylist()
    assert got[0] == want[0] and got[0]["big"] == big and type(got[0]["big"]) is int
    assert math.isnan(got[1]["ratio"]) and got[1]["nested"] is None and got[1]["raw"] is None
    assert got[0]["raw"] == b"\x00\xff"


@pytest.mark.parametrize(("column", "why"), [
    (pa.array([decimal.Decimal("1.10")], pa.decimal128(5, 2)), "decimal"),
    (pa.array([datetime.datetime(2024, 1, 1)], pa.timestamp("us", tz="Europe/Paris")),
     "time zone"),
    (pa.array([1], pa.timestamp("ns")), "nanoseconds"),
    (pa.array([[decimal.Decimal("1")]], pa.list_(pa.decimal128(3, 0))), "decimal"),
])
def test_values_without_a_plain_form_are_refused_by_column(tmp_path, column, why):
    pq.write_table(pa.table({"id": [1], "odd": column}), tmp_path / "odd.parquet")
    with pytest.raises(UnsupportedColumnError, match=f"odd.parquet: column 'odd' is .*{why}"):
        list(StreamingJsonl(tmp_path))
    assert list(StreamingJsonl(tmp_path, columns=["id"])) == [{"id": 1}]


# -- damaged files, missing pyarrow ---------------------------------------------------------


def test_a_file_without_its_footer_is_named(tmp_path):
    write_parquet_files(tmp_path, [[30]])
    path = next(tmp_path.glob("*.parquet"))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptShardError, match=f"{path.name}: damaged Parquet file .footer."):
        StreamingJsonl(tmp_path)


def test_a_damaged_row_group_is_named(tmp_path):
    write_parquet_files(tmp_path, [[40, 40, 40]])
    path = next(tmp_path.glob("*.parquet"))
    group = pq.ParquetFile(path).metadata.row_group(1).column(1)  # "text" of row group 1
    data = bytearray(path.read_bytes())
    start = group.dictionary_page_offset if group.has_dictionary_page else group.data_page_offset
    data[start + 8 : start + group.total_compressed_size] = b"\xa5" * (
        group.total_compressed_size - 8)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=f"{path.name}: damaged Parquet file .row group 1"):
        list(StreamingJsonl(path))
    # on_error="skip": the damaged block is left, counted; the others are read
    survived = ids(list(StreamingJsonl(path, on_error="skip")))
    assert set(range(40)) <= set(survived) and not set(range(40, 80)) & set(survived)


def test_without_pyarrow_the_error_names_the_extra(tmp_path, monkeypatch):
    write_parquet_files(tmp_path, [[3]])
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(MissingCodecError, match=r"pip install 'streamds\[parquet\]'"):
        StreamingJsonl(tmp_path)


def test_row_blocks_cover_every_row_once():
    layout = columnar.Layout((columnar.Group(10), columnar.Group(0), columnar.Group(25)), ())
    blocks = columnar.row_blocks(layout, 8)
    rows = [row for start, end in blocks for row in range(start, end)]
    assert rows == list(range(35))
    assert all(end - start <= 8 for start, end in blocks)
    assert not any(start < 10 < end for start, end in blocks)  # never across row groups


# -- Arrow IPC: the stream format (datasets' save_to_disk) and the file format ---------------


@pytest.mark.parametrize("kind", ["stream", "file"])
def test_arrow_files_read_exactly_once_and_resume(tmp_path, kind):
    whole = table(0, 300)
    for number in range(2):
        path = tmp_path / f"data-{number:05d}-of-00002.arrow"
        part = whole.slice(150 * number, 150)
        opener = pa.ipc.new_stream if kind == "stream" else pa.ipc.new_file
        with pa.OSFile(str(path), "wb") as sink, opener(sink, whole.schema) as writer:
            for batch in part.to_batches(max_chunksize=40):
                writer.write_batch(batch)
    assert ids(list(StreamingJsonl(tmp_path))) == list(range(300))
    readers = read_world(tmp_path, 3, 2, shuffle=True)
    assert_exactly_once([ids(reader) for reader in readers], list(range(300)))

    def make():
        return StreamingJsonl(tmp_path, shuffle=True, buffer_size=20, columns=["id", "tags"])

    run_test_save_load_state(make, [0, 77, 299])


def test_format_reads_a_file_whose_name_says_nothing(tmp_path):
    pq.write_table(table(0, 50), tmp_path / "data-00000")
    assert ids(list(StreamingJsonl(tmp_path / "data-00000", format="parquet"))) == list(range(50))
    with pytest.raises(ValueError, match="data-00000"):  # read as JSON lines: refused
        list(StreamingJsonl(tmp_path / "data-00000"))
    with pytest.raises(ValueError, match=r"unknown shard format 'parq'.*'parquet'"):
        StreamingJsonl(tmp_path / "data-00000", format="parq")


def test_resume_inside_a_block_of_several_batches(tmp_path):
    """A block longer than one batch of rows (`parquet.BATCH_ROWS`) hands out several chunks;
    a state taken in its second chunk resumes at the exact row."""
    pq.write_table(pa.table({"id": list(range(20_000))}), tmp_path / "one.parquet",
                   row_group_size=20_000)
    ds = StreamingJsonl(tmp_path)
    assert max((b.end or 20_000) - b.start for b in ds._block_list) > parquet.BATCH_ROWS
    cuts = [parquet.BATCH_ROWS, parquet.BATCH_ROWS + 76]  # at the second chunk, inside it
    whole = run_test_save_load_state(lambda: StreamingJsonl(tmp_path), cuts)
    assert ids(whole) == list(range(20_000))


# -- a remote Arrow stream: not counted in the constructor (it has no footer) ---------------


def test_a_remote_arrow_stream_is_one_block_read_exactly_without_a_download_to_plan(tmp_path):
    """Constructing over an Arrow stream served by HTTP reads its schema message only (no
    record batch); the file is one block that one reader counts as it reads; reading, with
    workers and ranks and from any resume point, is exact."""
    pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")
    from testbed.http import serve

    whole = table(0, 3000)
    path = tmp_path / "data-00000-of-00001.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, whole.schema) as writer:
        for batch in whole.to_batches(max_chunksize=700):
            writer.write_batch(batch)
    expected = list(range(3000))
    with serve(tmp_path) as server:
        url = f"{server.url}/{path.name}"
        server.reset_log()
        ds = StreamingJsonl(url, columns=["id", "text"])
        read = [request.range for request in server.log if request.method == "GET"]
        spans = [int(b) - int(a) + 1 for a, b in (r[6:].split("-") for r in read if r)]
        assert None not in read and sum(spans) < 1000, read  # the schema, no record batch
        assert path.stat().st_size > 50_000
        with pytest.raises(TypeError):
            len(ds)

        assert ids(list(ds)) == expected
        readers = read_world(url, 1, 2, shuffle=True, buffer_size=50)  # one reads it all
        assert_exactly_once([ids(reader) for reader in readers], expected)
        run_test_save_load_state(
            lambda: StreamingJsonl(url, shuffle=True, buffer_size=64, columns=["id"]),
            [0, 699, 700, 2999])
        with pytest.raises((KeyError, ValueError), match="nope"):
            StreamingJsonl(url, columns=["nope"])

        # the file format, remote too, is planned from its footer: counted, split
        with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(
                sink, whole.schema) as writer:
            for batch in whole.to_batches(max_chunksize=700):
                writer.write_batch(batch)
        footed = StreamingJsonl(f"{server.url}/file.arrow")
        assert len(footed) == 3000 and len(footed._block_list) > 1
        assert ids(list(footed)) == expected


def test_a_remote_parquet_file_fetches_only_the_columns_read(tmp_path):
    """Over HTTP the read-ahead fetches, per row group, the column chunks of the columns
    asked for (not the row group's whole span, nor a line probe past it), once for all the
    blocks the row group is cut into, and the rows read are exact."""
    pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")
    from testbed.http import serve

    rows = 3000
    pq.write_table(pa.table({"id": list(range(rows)),
                             "text": [f"{i:06d} " * 200 for i in range(rows)]}),
                   tmp_path / "wide.parquet", row_group_size=1000, compression="none")
    size = (tmp_path / "wide.parquet").stat().st_size
    with serve(tmp_path) as server:
        url = f"{server.url}/wide.parquet"
        ds = StreamingJsonl(url, columns=["id"])
        server.reset_log()
        assert ids(list(ds)) == list(range(rows))
        ranges = [request.range for request in server.log if request.method == "GET"]
    served = sum(int(b) - int(a) + 1 for a, b in (r[6:].split("-") for r in ranges if r))
    assert None not in ranges and served < size // 20, (served, size)
    # a row group is cut into several blocks; its chunks are fetched once for all of them
    assert len(ds._block_list) > 3 and len(ranges) == len(set(ranges)), ranges


# -- a reader's row ranges: one decoding per row group, forward ------------------------------


def test_row_ranges_of_one_reader_continue_forward_and_reopen_backward(tmp_path):
    """`parquet.read_rows_through`: row ranges of a row group read one after another by one
    owner (a reader's opener) open the file once, the next range continuing the decoding; a
    range before where the open row group stands (a resume, a re-read) opens it afresh; a
    storage error lets the row group go, so the retry opens it again and reads exactly."""
    path = tmp_path / "one.parquet"
    pq.write_table(table(0, 300), path, row_group_size=300)
    size = path.stat().st_size
    opened = []

    class FailsOnce(io.FileIO):  # at its third read of column chunks: in a batch
        data_reads = 0

        def read(self, n=-1):
            if self.tell() < size // 2:
                self.data_reads += 1
                if self.data_reads == 3:
                    raise OSError(errno.EIO, "Input/output error")
            return super().read(n)

    def opener():
        opened.append(len(opened))
        return FailsOnce(path) if len(opened) == 1 else open(path, "rb")

    def read(start: int, end: int, owner: object) -> list[int]:
        return [record["id"] for _, records in parquet.read_rows_through(
            opener, str(path), start, end, owner=owner, key=("one", size)) for record in records]

    parquet.close_open_row_groups()
    reader = object()
    with pytest.raises(OSError, match="Input/output error") as raised:
        read(0, 100, reader)
    assert not isinstance(raised.value, CorruptShardError) and not parquet.open_row_groups()
    assert read(0, 100, reader) == list(range(100))
    assert read(100, 250, reader) == list(range(100, 250))
    assert len(opened) == 2  # the second range continued the first's decoding
    assert read(50, 80, reader) == list(range(50, 80))  # backward: opened afresh
    assert read(80, 120, object()) == list(range(80, 120))  # another reader: its own
    assert len(opened) == 4
    assert read(80, 300, reader) == list(range(80, 300))  # continues, to the end: closed
    assert len(opened) == 4
    assert all(entry.owner is not reader for entry in parquet.open_row_groups())
    parquet.close_open_row_groups()
    assert not parquet.open_row_groups()


def test_a_thread_letting_its_oldest_row_groups_go_leaves_another_threads_open(tmp_path):
    """Open row groups are kept per thread: a thread that opens more than MAX_OPEN lets its
    own oldest go, never one another thread's reader is in the middle of."""
    path = tmp_path / "one.parquet"
    pq.write_table(table(0, 300), path, row_group_size=300)
    key = ("one", path.stat().st_size)

    def opener():
        return open(path, "rb")

    def first_rows(owner: object) -> list[int]:
        return [record["id"] for _, records in parquet.read_rows_through(
            opener, str(path), 0, 10, owner=owner, key=key) for record in records]

    mine = object()
    assert first_rows(mine) == list(range(10))
    kept = parquet.open_row_groups()[-1]
    other = threading.Thread(target=lambda: [first_rows(object())
                                             for _ in range(parquet.MAX_OPEN + 2)])
    other.start()
    other.join()
    assert parquet.open_row_groups() == [kept] and not kept.rows.file.closed
    rest = parquet.read_rows_through(opener, str(path), 10, 300, owner=mine, key=key)
    assert [record["id"] for _, records in rest for record in records] == list(range(10, 300))
    parquet.close_open_row_groups()
