"""`streamds convert` over Parquet and Arrow inputs: the shards read back to exactly the
records `StreamingJsonl` reads from the inputs, in order; reruns resume or refuse changed
inputs; what JSON cannot hold is refused by column; a damaged file is named."""

from __future__ import annotations

import datetime
import decimal
import os
from collections.abc import Callable
from pathlib import Path

import fsspec
import orjson
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from streamds import StreamingJsonl
from streamds.formats.manifest import read_manifest
from streamds.preprocess.command import main as convert_main
from streamds.preprocess.convert import ConversionError, Progress, convert
from streamds.preprocess.identity import InputsChangedError

SMALL = {"shard_size": 2048, "frame_size": 512}  # many shards, cut inside the files


def table(start: int, count: int) -> pa.Table:
    """Rows with ids from `start`: int64 beyond a float's exact range, texts, lists, nulls,
    nested structs, floats."""
    rows = range(start, start + count)
    return pa.table({
        "id": pa.array([2**62 + i for i in rows], pa.int64()),
        "text": pa.array([f"doc {i} " + "w" * ((i * 7919) % 37) for i in rows], pa.string()),
        "tags": pa.array([[i, i + 1] if i % 3 else None for i in rows], pa.list_(pa.int64())),
        "meta": pa.array([{"score": i / 7, "ok": i % 2 == 0} for i in rows],
                         pa.struct([("score", pa.float64()), ("ok", pa.bool_())])),
    })


def write_parquet(directory: Path, files: list[list[int]], first: int = 0) -> None:
    """One Parquet file per entry of `files`, whose entries are its row-group sizes."""
    directory.mkdir(parents=True, exist_ok=True)
    start = first
    for number, groups in enumerate(files):
        path = directory / f"train-{number:05d}-of-{len(files):05d}.parquet"
        with pq.ParquetWriter(path, table(0, 0).schema) as writer:
            for rows in groups:
                writer.write_table(table(start, rows), row_group_size=rows)
                start += rows


def write_arrow(path: Path, batches: list[int], *, stream: bool) -> None:
    schema = table(0, 0).schema
    start = 0
    with pa.OSFile(str(path), "wb") as sink:
        opened = pa.ipc.new_stream if stream else pa.ipc.new_file
        with opened(sink, schema) as writer:
            for rows in batches:
                for batch in table(start, rows).to_batches():
                    writer.write_batch(batch)
                start += rows


def read_back(out: Path) -> list[dict]:
    return list(StreamingJsonl(out))


@pytest.fixture
def folder(tmp_path) -> Path:
    write_parquet(tmp_path / "pq", [[40, 25, 7], [1], [60, 60]])
    return tmp_path / "pq"


def test_a_parquet_folder_converts_to_the_records_streamingjsonl_reads(folder, tmp_path):
    seen: list[Progress] = []
    convert([folder], tmp_path / "out", progress=seen.append, **SMALL)
    want = list(StreamingJsonl(folder))
    assert len(want) == 193 and want[0]["id"] == 2**62
    got = read_back(tmp_path / "out")
    assert got == want  # in order, every value as pyarrow gives it (int64 exact)
    assert all(type(record["id"]) is int for record in got)
    manifest = read_manifest(tmp_path / "out")
    assert manifest.totals["records"] == 193 and len(manifest.shards) > 3
    sizes = sum(path.stat().st_size for path in folder.iterdir())
    assert seen[-1].stored_bytes == sizes and seen[-1].files == 3
    assert seen[-1].files_total == 3  # a folder's bytes are not known before (as for JSONL)
    assert [p.stored_bytes for p in seen] == sorted(p.stored_bytes for p in seen)


def test_a_glob_and_single_files_convert_too(folder, tmp_path):
    files = sorted(folder.iterdir())
    convert([str(folder / "*.parquet")], tmp_path / "glob", **SMALL)
    convert([files[2], files[0]], tmp_path / "files", **SMALL)
    assert read_back(tmp_path / "glob") == list(StreamingJsonl(folder))
    want = list(StreamingJsonl(files[2])) + list(StreamingJsonl(files[0]))  # input order
    assert read_back(tmp_path / "files") == want


def test_a_transform_sees_each_record(folder, tmp_path):
    def short(record):
        return None if record["id"] % 2 else {"id": record["id"], "n": len(record["text"])}

    result = convert([folder], tmp_path / "out", transform=short, **SMALL)
    want = [{"id": r["id"], "n": len(r["text"])} for r in StreamingJsonl(folder)
            if r["id"] % 2 == 0]
    assert read_back(tmp_path / "out") == want
    assert result.manifest.totals["records"] == len(want)


def test_parts_cut_between_files(folder, tmp_path):
    convert([folder], tmp_path / "out", parts=3, **SMALL)
    assert read_back(tmp_path / "out") == list(StreamingJsonl(folder))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "file"])
def test_arrow_ipc_converts(tmp_path, stream):
    path = tmp_path / "data" / "cache-00000.arrow"
    path.parent.mkdir()
    write_arrow(path, [30, 1, 45], stream=stream)
    with open(path, "rb") as file:
        assert (file.read(6) == b"ARROW1") is not stream
    convert([tmp_path / "data"], tmp_path / "out", **SMALL)
    want = list(StreamingJsonl(path))
    assert len(want) == 76 and read_back(tmp_path / "out") == want


@pytest.mark.parametrize("kind", ["parquet", "arrow stream", "arrow file"])
def test_an_interrupted_conversion_resumes_inside_a_row_group(folder, tmp_path, kind):
    if kind != "parquet":
        folder = tmp_path / "arrow"
        folder.mkdir()
        write_arrow(folder / "data.arrow", [50, 3, 70], stream=kind == "arrow stream")
    out = tmp_path / "out"

    class Stop(Exception):
        pass

    def stop_after_two_shards(progress: Progress) -> None:
        if progress.shards >= 2:
            raise Stop

    with pytest.raises(Stop):
        convert([folder], out, progress=stop_after_two_shards, shard_size=2048,
                frame_size=512)
    assert len(list(out.glob("*.jsonl.zst"))) >= 2  # finished shards kept
    convert([folder], out, **SMALL)
    assert read_back(out) == list(StreamingJsonl(folder))  # each record exactly once


def test_a_rerun_after_an_input_changed_is_refused_or_converts_afresh(folder, tmp_path):
    out = tmp_path / "out"
    convert([folder], out, **SMALL)
    write_parquet(tmp_path / "new", [[40, 25, 7]], first=1000)  # same shape, other rows
    os.replace(tmp_path / "new" / "train-00000-of-00001.parquet",
               folder / "train-00000-of-00003.parquet")
    with pytest.raises(InputsChangedError, match=r"train-00000-of-00003\.parquet"):
        convert([folder], out, **SMALL)
    convert([folder], out, overwrite=True, **SMALL)
    got = read_back(out)
    assert got == list(StreamingJsonl(folder)) and got[0]["id"] == 2**62 + 1000


def test_an_input_changed_during_the_conversion_fails_it(folder, tmp_path):
    out = tmp_path / "out"
    first = folder / "train-00000-of-00003.parquet"
    write_parquet(tmp_path / "new", [[40, 25, 7]], first=1000)

    def change_the_first_file(record: dict) -> dict:
        if record["id"] == 2**62 + 72:  # the first file read, the second reading
            os.replace(tmp_path / "new" / "train-00000-of-00001.parquet", first)
        return record

    with pytest.raises(InputsChangedError, match=r"train-00000-of-00003\.parquet"):
        convert([folder], out, transform=change_the_first_file, **SMALL)
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize(("column", "why"), [
    (pa.array([b"\x00\xff"], pa.binary()), "binary .JSON has no bytes"),
    (pa.array([[b"x"]], pa.list_(pa.large_binary())), "binary"),
    (pa.array([datetime.date(2024, 1, 2)], pa.date32()), "date .JSON would hold a string"),
    (pa.array([datetime.datetime(2024, 1, 2)], pa.timestamp("us")), "datetime"),
    (pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64())), "a map"),
    (pa.array([float("nan")], pa.float64()), "NaN or Infinity"),
    (pa.array([decimal.Decimal("1.10")], pa.decimal128(5, 2)), "decimal"),  # the library's
])
def test_a_column_json_cannot_hold_is_refused_by_name(tmp_path, column, why):
    pq.write_table(pa.table({"id": [1], "odd": column}), tmp_path / "odd.parquet")
    with pytest.raises(ConversionError, match=f"odd.parquet: .*column 'odd'.*{why}"):
        convert([tmp_path / "odd.parquet"], tmp_path / "out", **SMALL)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_null_in_such_a_column_converts(tmp_path):
    pq.write_table(pa.table({"id": [1], "raw": pa.array([None], pa.binary())}),
                   tmp_path / "nulls.parquet")
    convert([tmp_path / "nulls.parquet"], tmp_path / "out", **SMALL)
    assert read_back(tmp_path / "out") == [{"id": 1, "raw": None}]


def test_a_damaged_file_is_named(folder, tmp_path, capsys):
    path = folder / "train-00001-of-00003.parquet"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ConversionError, match=f"{path.name}: damaged Parquet file .footer"):
        convert([folder], tmp_path / "out", **SMALL)
    args = [str(folder), "--output", str(tmp_path / "cli"), "--quiet"]
    assert convert_main(args) == 2
    assert f"{path.name}: damaged Parquet file" in capsys.readouterr().err
    # --on-error skip: the rest of the damaged file is one bad record, the others convert
    result = convert([folder], tmp_path / "skip", on_error="skip", **SMALL)
    assert result.manifest.counts["bad"] == 1
    assert len(read_back(tmp_path / "skip")) == 193 - 1


def test_a_damaged_arrow_stream_is_named_with_its_record_batch(tmp_path):
    path = tmp_path / "cache-00000.arrow"
    write_arrow(path, [30, 30, 30], stream=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])  # cut inside the second batch
    with pytest.raises(ConversionError, match=r"cache-00000\.arrow: damaged Arrow IPC file "
                                              r"\(record batch 1\)"):
        convert([path], tmp_path / "out", **SMALL)


def test_the_command_line_converts_a_folder(folder, tmp_path, capsys):
    assert convert_main([str(folder), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    assert read_back(tmp_path / "out") == list(StreamingJsonl(folder))


def test_a_remote_parquet_folder_converts(folder, tmp_path):
    fs = fsspec.filesystem("memory")
    for path in sorted(folder.iterdir()):
        fs.pipe(f"/convertpq/{path.name}", path.read_bytes())
    try:
        convert(["memory://convertpq/"], tmp_path / "out", **SMALL)
    finally:
        fs.rm("/convertpq", recursive=True)
    assert read_back(tmp_path / "out") == list(StreamingJsonl(folder))


def _served_bytes(log: list, path: str, size: int) -> int:
    """Body bytes the loopback server sent for `path` (GETs: ranged or whole)."""
    sent = 0
    for request in log:
        if request.method != "GET" or request.path != path:
            continue
        first, last = (0, size - 1) if request.range is None else (
            int(n) if n else size - 1 for n in request.range[len("bytes="):].split("-"))
        sent += min(last, size - 1) - first + 1
    return sent


def test_a_remote_arrow_stream_is_downloaded_once_and_resumes_inside(tmp_path):
    """A remote Arrow stream (what `save_to_disk` writes) has no footer: convert reads it
    once, counting as it goes (not a pass to count its rows, then another to convert), the
    bar moves with the bytes read, and a rerun resumes inside it with the bytes adding up."""
    pytest.importorskip("aiohttp", reason="HTTP inputs need the 'remote' extra (aiohttp)")
    from testbed.http import serve

    www = tmp_path / "www"
    www.mkdir()
    write_arrow(www / "data-00000-of-00001.arrow", [400] * 12, stream=True)
    size = (www / "data-00000-of-00001.arrow").stat().st_size
    options = {**SMALL, "storage_options": {"block_size": 64 << 10}}  # ~6 blocks in the file
    want = list(StreamingJsonl(www / "data-00000-of-00001.arrow"))

    class Stop(Exception):
        pass

    def stop_after(shards: int) -> Callable[[Progress], None]:
        def progress(p: Progress) -> None:
            seen.append(p)
            if p.shards >= shards:
                raise Stop
        return progress

    with serve(www) as server:
        url = f"{server.url}/data-00000-of-00001.arrow"
        seen: list[Progress] = []
        convert([url], tmp_path / "out", progress=seen.append, **options)
        assert _served_bytes(server.log, "/data-00000-of-00001.arrow", size) == size
        assert read_back(tmp_path / "out") == want
        done = [p.stored_bytes for p in seen]
        assert done == sorted(done) and done[-1] == size
        assert len({n for n in done if 0 < n < size}) >= 3, done  # moves while reading

        seen = []
        with pytest.raises(Stop):
            convert([url], tmp_path / "again", progress=stop_after(40), **options)
        journal = orjson.loads((tmp_path / "again" / ".streamds-convert.json").read_bytes())
        assert journal["shards"][-1]["next"]["offset"] > 0  # the rerun starts inside the file
        seen = []
        convert([url], tmp_path / "again", progress=seen.append, **options)
    assert read_back(tmp_path / "again") == want  # each record once
    assert seen[0].resumed_bytes > 0
    assert seen[-1].resumed_bytes + seen[-1].stored_bytes == size
