"""Arrow IPC file-format files are counted from their footer and each record batch's message
header (`arrow.footer_layout`), never their data: the same row counts as reading every batch
with pyarrow, for every kind of file pyarrow writes; over HTTP the constructor fetches the
footer and the headers only; a damaged footer is refused naming the file."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume_contract import ids, run_test_save_load_state

from streamds import StreamingJsonl
from streamds.errors import CorruptShardError
from streamds.formats import arrow


def rows_table(start: int, count: int, text: int = 20, dictionary: bool = False) -> pa.Table:
    words = pa.array([f"w{i % 7}" for i in range(start, start + count)])
    return pa.table({
        "id": pa.array(range(start, start + count), pa.int64()),
        "text": [f"{i:>{text}}" for i in range(start, start + count)],
        "word": words.dictionary_encode() if dictionary else words,
        "tags": [[i] * (i % 3) for i in range(start, start + count)],
    })


def file_bytes(batches: list[int], *, options: pa.ipc.IpcWriteOptions | None = None,
               dictionary: bool = False, text: int = 20, metadata: bool = False) -> bytes:
    """An Arrow IPC file of record batches of `batches` rows (ids 0, 1, ... through them)."""
    whole = rows_table(0, sum(batches), text, dictionary)
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, whole.schema, options=options) as writer:
        first = 0
        for rows in batches:
            batch = pa.RecordBatch.from_arrays(  # slices: one dictionary for all batches
                [column.chunk(0).slice(first, rows) for column in whole.columns],
                schema=whole.schema)
            writer.write_batch(batch, custom_metadata={"rows": str(rows)} if metadata else None)
            first += rows
    return sink.getvalue()


def read_by_pyarrow(data: bytes) -> tuple[list[int], tuple[str, ...]]:
    """What counting by reading every batch gives (`arrow.layout`, the way before)."""
    counted = arrow.layout(io.BytesIO(data), "x.arrow")
    return [group.rows for group in counted.groups], counted.columns


def from_footer(data: bytes) -> arrow.Layout:
    return arrow.footer_layout(lambda start, end: data[start:end], len(data), "x.arrow")


KINDS = {
    "plain": {},
    "before 0.15 (no continuation marker)": {
        "options": pa.ipc.IpcWriteOptions(use_legacy_format=True)},
    "metadata V4": {"options": pa.ipc.IpcWriteOptions(metadata_version=pa.ipc.MetadataVersion.V4)},
    "zstd buffers": {"options": pa.ipc.IpcWriteOptions(compression="zstd")},
    "lz4 buffers": {"options": pa.ipc.IpcWriteOptions(compression="lz4")},
    "dictionary column": {"dictionary": True},
    "batch metadata": {"metadata": True},
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batches", [[300, 0, 41, 1000], [], [0], [7] * 300, [5000]],
                         ids=["mixed", "no-batches", "one-empty", "many-small", "one"])
def test_footer_counts_equal_reading_every_batch(kind, batches):
    data = file_bytes(batches, **KINDS[kind])
    counted = from_footer(data)
    assert ([group.rows for group in counted.groups], counted.columns) == read_by_pyarrow(data)
    assert [group.rows for group in counted.groups] == batches
    # each group's stored bytes are its batch's: message and body, in file order, apart
    spans = [(group.start, group.end) for group in counted.groups]
    assert all(8 <= start < end <= len(data) for start, end in spans)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.integers(0, 400), max_size=40), gap=st.sampled_from([0, 600, 1 << 20]),
       run=st.sampled_from([1, 5000, 8 << 20]))
def test_footer_counts_hold_however_headers_are_grouped_into_requests(
    monkeypatch, batches, gap, run
):
    monkeypatch.setattr(arrow, "HEADER_GAP", gap)  # every header apart ... all in one request
    monkeypatch.setattr(arrow, "HEADER_RUN", run)
    monkeypatch.setattr(arrow, "TAIL_READ", 64)  # the footer in a second read
    data = file_bytes(batches)
    reads: list[tuple[int, int]] = []

    def read_exact(start: int, end: int) -> bytes:
        reads.append((start, end))
        return data[start:end]

    counted = arrow.footer_layout(read_exact, len(data), "x.arrow")
    assert [group.rows for group in counted.groups] == read_by_pyarrow(data)[0] == batches
    if gap == 0 and batches:
        assert len(reads) == 2 + len(batches)  # the tail, the footer, each header apart


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_of_file_reads_the_rows_pyarrow_reads(tmp_path, kind):
    """Each block reads its batch from the bytes the footer places it at (a file with
    dictionary-encoded columns through pyarrow's file reader): the records are pyarrow's."""
    data = file_bytes([300, 0, 41, 1000], **KINDS[kind])
    (tmp_path / "k.arrow").write_bytes(data)
    expected = pa.ipc.open_file(pa.BufferReader(data)).read_all().to_pylist()
    assert list(StreamingJsonl(tmp_path / "k.arrow")) == expected


def test_a_local_arrow_file_reads_exactly_once_and_resumes(tmp_path):
    (tmp_path / "a.arrow").write_bytes(file_bytes([120, 0, 75, 300, 5]))
    ds = StreamingJsonl(tmp_path / "a.arrow")
    assert len(ds) == 500 and ids(list(ds)) == list(range(500))
    run_test_save_load_state(lambda: StreamingJsonl(tmp_path, shuffle=True, buffer_size=30),
                             [0, 119, 120, 499])


def served_bytes(log, path: str, size: int) -> int:
    total = 0
    for request in log:
        if request.path != path or request.method != "GET":
            continue
        first, last = (request.range or f"bytes=0-{size - 1}").removeprefix("bytes=").split("-")
        total += min(int(last), size - 1) - int(first) + 1
    return total


def test_a_remote_arrow_file_is_planned_from_its_footer_and_headers_and_reads_exactly(tmp_path):
    """Building the dataset fetches the file's first bytes, its last TAIL_READ bytes (the
    footer) and each record batch's header, none of the batches' data; the rows read are
    exact, split across readers, and resume."""
    pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")
    from testbed.http import serve

    batches = [30_000, 30_000, 30_000, 1_000]  # batches of ~1.5 MB: headers far apart
    data = file_bytes(batches, text=40)
    (tmp_path / "big.arrow").write_bytes(data)
    headers = 4096 * len(batches)  # each header is a few hundred bytes
    with serve(tmp_path) as server:
        url = f"{server.url}/big.arrow"
        server.reset_log()
        ds = StreamingJsonl(url, columns=["id", "word"])
        served = served_bytes(server.log, "/big.arrow", len(data))
        assert served <= 8 + 1 + arrow.TAIL_READ + headers, server.log  # + the range probe
        assert len(data) > 50 * served
        assert len(ds) == sum(batches) and len(ds._block_list) > len(batches)
        expected = list(range(sum(batches)))
        assert ids(list(ds)) == expected
        run_test_save_load_state(
            lambda: StreamingJsonl(url, shuffle=True, buffer_size=64, columns=["id"]),
            [0, 29_999, 30_000, 90_999])


def test_reading_a_batch_fetches_that_batch_not_the_files_start(tmp_path):
    """A block's reader goes to its batch (the plan knows the file is in the file format, so
    its first bytes are not read for the magic: that read fetched a request's worth, 4 MiB,
    from the file's start for every block), and the read-ahead fetches that batch's bytes."""
    pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")
    from testbed.http import serve

    batches = [30_000, 30_000, 30_000]
    data = file_bytes(batches, text=40)
    (tmp_path / "big.arrow").write_bytes(data)
    widest = max(group.end - group.start for group in from_footer(data).groups)
    with serve(tmp_path) as server:
        ds = StreamingJsonl(f"{server.url}/big.arrow", columns=["id"])
        server.reset_log()
        assert ids(list(ds)) == list(range(sum(batches)))
        ranged = [r for r in server.log if r.method == "GET" and r.range is not None]
        assert not [r for r in ranged if r.range.startswith("bytes=0-")], ranged
        footer = len(data) - max(group.end for group in from_footer(data).groups)
        blocks = len(ds._block_list)
        assert served_bytes(server.log, "/big.arrow", len(data)) <= blocks * (widest + footer)


def test_a_reader_of_many_blocks_reads_the_footer_once(tmp_path):
    """The footer lists every batch, so reading it per block would cost blocks x footer
    bytes (quadratic in the batches); a reader reads it once per file."""
    pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")
    from testbed.http import serve

    batches = [10] * 600  # a footer of ~15 KB, a block per batch
    data = file_bytes(batches)
    (tmp_path / "many.arrow").write_bytes(data)
    with serve(tmp_path) as server:
        ds = StreamingJsonl(f"{server.url}/many.arrow")
        assert len(ds._block_list) == len(batches)
        server.reset_log()
        assert ids(list(ds)) == list(range(sum(batches)))
        assert served_bytes(server.log, "/many.arrow", len(data)) < 3 * len(data)


DAMAGE = {
    "truncated": lambda data: data[: len(data) - 30],
    "footer length too large": lambda data: data[:-10] + (len(data)).to_bytes(4, "little")
    + data[-6:],
    "footer length zero": lambda data: data[:-10] + b"\0\0\0\0" + data[-6:],
    "footer garbled": lambda data: data[: len(data) - 120] + b"\xa5" * 110 + data[-10:],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_footer_is_refused_naming_the_file(tmp_path, damage):
    data = file_bytes([100, 100, 100])
    path = tmp_path / "broken.arrow"
    path.write_bytes(DAMAGE[damage](data))
    with pytest.raises(CorruptShardError, match=r"broken\.arrow: damaged Arrow IPC file "
                       r"\((footer|record batch \d's header)\): .*; copy or write the file again"):
        StreamingJsonl(path)


def test_a_batch_header_that_is_not_a_record_batch_is_refused(tmp_path):
    data = bytearray(file_bytes([100, 100]))
    second = from_footer(bytes(data)).groups[1]
    assert second.start is not None
    data[second.start : second.start + 8] = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # length 0
    (tmp_path / "broken.arrow").write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=r"broken\.arrow: damaged Arrow IPC file "
                       r"\(record batch 1's header\)"):
        StreamingJsonl(tmp_path / "broken.arrow")


def _batch_table(data: bytes, index: int) -> tuple[int, int]:
    """(position in the file of batch `index`'s RecordBatch table, of its field list)."""
    def table(buf: bytes, at: int) -> tuple[int, int]:
        return at, at - int.from_bytes(buf[at : at + 4], "little", signed=True)

    def field(buf: bytes, tbl: tuple[int, int], i: int) -> int:
        at, vtable = tbl
        return at + int.from_bytes(buf[vtable + 4 + 2 * i : vtable + 6 + 2 * i], "little")

    group = from_footer(data).groups[index]
    message = data[group.start + 8 :]  # after the continuation marker and the length
    root = table(message, int.from_bytes(message[:4], "little"))
    header = field(message, root, 2)  # Message.header: the RecordBatch
    at, vtable = table(message, header + int.from_bytes(message[header : header + 4], "little"))
    return group.start + 8 + at, group.start + 8 + vtable


@pytest.mark.parametrize("damage", ["length left out", "length 34", "length 2**40 + 50"])
def test_a_damaged_row_count_in_a_batch_header_is_refused(tmp_path, damage):
    """A row count that disagrees with the batch's columns is the header's damage: planning
    it would lose the batch's rows (a count left out reads as 0) or count rows not there."""
    data = bytearray(file_bytes([50, 50, 50]))
    at, vtable = _batch_table(bytes(data), 1)
    if damage == "length left out":
        data[vtable] = 4  # the field list holds no field: every field at its default
    else:
        length = at + int.from_bytes(data[vtable + 4 : vtable + 6], "little")
        data[length : length + 8] = (34 if damage == "length 34" else 2**40 + 50).to_bytes(
            8, "little")
    (tmp_path / "broken.arrow").write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=r"broken\.arrow: damaged Arrow IPC file "
                       r"\(record batch 1's header\)"):
        StreamingJsonl(tmp_path / "broken.arrow")


def test_stream_format_files_are_still_counted_by_reading(tmp_path):
    whole = rows_table(0, 90)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, whole.schema) as writer:
        for batch in whole.to_batches(max_chunksize=40):
            writer.write_batch(batch)
    (tmp_path / "s.arrow").write_bytes(sink.getvalue())
    ds = StreamingJsonl(tmp_path / "s.arrow")
    assert len(ds) == 90 and ids(list(ds)) == list(range(90))
    assert Path(tmp_path / "s.arrow").read_bytes()[:6] != arrow.FILE_MAGIC
