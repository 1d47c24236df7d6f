"""What a listing reads, leaves out and refuses (issue 27): missing manifest shards, wrong
manifest counts under a plain-loader resume, extension spellings, Parquet files, sibling
copies, `streamds verify` of one file, and plain-loader resumes that cannot be exact."""

from __future__ import annotations

import gzip
import logging
import shutil
from pathlib import Path

import orjson
import pytest
from torch.utils.data import DataLoader

from streamds import StreamingJsonl
from streamds.formats.filenames import copy_of, is_record_name
from streamds.formats.manifest import MANIFEST_NAME, MissingShardError, read_manifest
from streamds.preprocess.convert import convert
from streamds.resume.plain_loader import CountMismatchError
from streamds.tools.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def lines(start: int, stop: int) -> bytes:
    return b"".join(orjson.dumps({"id": i, "text": "x" * (i % 50)}) + b"\n"
                    for i in range(start, stop))


def ids(source, **options) -> list[int]:
    return [record["id"] for record in StreamingJsonl(source, **options)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3,000 records converted into shards of one frame each."""
    base = tmp_path_factory.mktemp("shards")
    (base / "in.jsonl").write_bytes(lines(0, 3000))
    convert([base / "in.jsonl"], base / "shards", shard_size=25_000)
    assert len(read_manifest(base / "shards").shards) >= 4
    return base / "shards"


@pytest.fixture
def copy(shards: Path, tmp_path: Path) -> Path:
    out = tmp_path / "shards"
    shutil.copytree(shards, out)
    return out


# -- 1. a shard the manifest lists is missing -----------------------------------------------------


def test_a_missing_listed_shard_is_an_error_naming_it_and_verify(copy: Path) -> None:
    assert sorted(ids(copy)) == list(range(3000))
    (copy / "shard-000002.jsonl.zst").unlink()
    with pytest.raises(MissingShardError, match=r"shard-000002\.jsonl\.zst is listed in .*"
                                                r"manifest\.json \(\d[\d,]* records\) but missing"
                       ) as caught:
        StreamingJsonl(str(copy))
    assert f"streamds verify {copy}" in str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)
    # naming the shards that are there, with a glob, is the user's choice: read as named
    assert len(ids(f"{copy}/*.jsonl.zst")) < 3000


def test_a_folder_whose_shards_are_all_missing_names_them(copy: Path) -> None:
    for shard in copy.glob("*.zst"):
        shard.unlink()
    with pytest.raises(MissingShardError, match=r"shard-000000\.jsonl\.zst is listed .* \(and \d+ "
                                                r"more: shard-000001\.jsonl\.zst"):
        StreamingJsonl(str(copy))


def test_a_missing_shard_of_a_converted_subfolder_is_an_error(copy: Path) -> None:
    (copy / "shard-000000.jsonl.zst").unlink()
    with pytest.raises(MissingShardError, match=r"shard-000000\.jsonl\.zst"):
        StreamingJsonl(str(copy.parent))  # the folder above the converted one


def test_unlisted_and_resized_files_beside_a_manifest_are_read_with_a_warning(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (copy / "extra.jsonl").write_bytes(lines(5000, 5003))
    text = (copy / MANIFEST_NAME).read_text()
    entry = read_manifest(copy).shards[1]
    (copy / MANIFEST_NAME).write_text(
        text.replace(f'"bytes":{entry.bytes},', f'"bytes":{entry.bytes + 1},', 1))
    with caplog.at_level(logging.WARNING, logger="streamds.storage.shards"):
        got = ids(copy)
    assert sorted(got) == [*range(3000), 5000, 5001, 5002]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "does not list 1 record file(s) beside it (extra.jsonl)" in warned
    assert f"{entry.name} with {entry.bytes + 1} bytes, the file has {entry.bytes}" in warned


def test_another_tools_manifest_json_is_not_checked(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a.jsonl").write_bytes(lines(0, 3))
    (tmp_path / MANIFEST_NAME).write_text('{"files": ["gone.jsonl"]}')
    with caplog.at_level(logging.WARNING):
        assert ids(tmp_path) == [0, 1, 2]
    assert not caplog.records


# -- 2. a manifest wrong about a shard's record count ---------------------------------------------


def test_a_wrong_manifest_count_fails_a_plain_loader_resume_naming_shard_and_counts(
    copy: Path,
) -> None:
    first = read_manifest(copy).shards[0]
    held, wrong = first.records, first.records + 32
    text = (copy / MANIFEST_NAME).read_text().replace(
        f'"records":{held},', f'"records":{wrong},', 1).replace(
        f'"records_per_frame":[{held}]', f'"records_per_frame":[{wrong}]', 1)
    (copy / MANIFEST_NAME).write_text(text)
    ds = StreamingJsonl(str(copy))
    with pytest.raises(CountMismatchError) as caught:  # the resume point lies in that shard
        ds.resume_after_batches(held // 10 + 1, batch_size=10, num_workers=0)
    message = str(caught.value)
    assert first.name in message and f"holds {held} records" in message
    assert f"manifest.json says {wrong}" in message
    assert "streamds verify" in message and "StatefulDataLoader" in message
    assert isinstance(caught.value, ValueError)


# -- 3. extension spellings, and what a listing leaves out ----------------------------------------


def spelled(root: Path) -> None:
    root.mkdir()
    (root / "A.JSONL").write_bytes(lines(0, 3))
    (root / "B.JSONL.GZ").write_bytes(gzip.compress(lines(3, 6)))
    (root / "c.jsonl").write_bytes(lines(6, 8))
    (root / "d.Jsonl").write_bytes(lines(8, 11))
    (root / "b.jsonl.gzip").write_bytes(gzip.compress(lines(11, 14)))
    (root / "e.NDJSON.ZSTD").write_bytes(__import__("zstandard").compress(lines(14, 16)))
    (root / "f.jsonlines").write_bytes(lines(16, 17))
    (root / "notes.txt").write_text("not records")
    (root / "_SUCCESS").write_text("")


def test_extensions_match_in_any_case_and_common_spelling(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    spelled(tmp_path / "d")
    with caplog.at_level(logging.DEBUG, logger="streamds.storage.shards"):
        assert sorted(ids(tmp_path / "d")) == list(range(17))
    logged = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert "notes.txt" in logged and "not a JSON lines name" in logged
    assert "_SUCCESS" in logged and "starts with '_'" in logged
    assert all(is_record_name(n) for n in ("x.JSON", "x.Jsonl.Gz", "x.ldjson.bzip2", "x.TGZ"))


def test_inspect_lists_the_files_a_folder_listing_left_out(tmp_path: Path, capsys) -> None:
    spelled(tmp_path / "d")
    (tmp_path / "d" / ".ipynb_checkpoints").mkdir()
    assert main(["inspect", str(tmp_path / "d"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "left out   3 files or folders" in out
    assert "notes.txt: not a JSON lines name" in out
    assert ".ipynb_checkpoints: hidden folder" in out
    assert "b.jsonl.gzip" in out and "7 files" in out


# -- 4. Parquet ---------------------------------------------------------------------------------


def test_a_folder_of_parquet_files_is_read_and_a_damaged_one_named(tmp_path: Path) -> None:
    # Parquet files are sources now (tests/test_parquet.py); bytes that are no Parquet file
    # are named as damaged, with what to do
    (tmp_path / "part-0.parquet").write_bytes(b"PAR1\x00\x00PAR1")
    with pytest.raises(OSError, match=r"part-0\.parquet: damaged Parquet file \(footer\).*"
                                      r"write the file again"):
        StreamingJsonl(str(tmp_path))


def test_feather_beside_json_lines_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a.jsonl").write_bytes(lines(0, 2))
    (tmp_path / "b.feather").write_bytes(b"ARROW1\x00\x00")
    with caplog.at_level(logging.WARNING, logger="streamds.storage.shards"):
        assert ids(tmp_path) == [0, 1]
    assert len(caplog.records) == 1
    assert "b.feather" in caplog.text and "reads JSON lines" in caplog.text


@pytest.mark.parametrize("named", ["data.parquet", "*.parquet", "DATA.PQ"])
def test_a_parquet_file_named_or_matched_is_read_by_its_footer(
    tmp_path: Path, named: str
) -> None:
    (tmp_path / "data.parquet").write_bytes(b"PAR1\x00\x00PAR1")
    (tmp_path / "DATA.PQ").write_bytes(b"PAR1\x00\x00PAR1")
    with pytest.raises(OSError, match=r"damaged Parquet file \(footer\)"):
        StreamingJsonl(str(tmp_path / named))


# -- 5. sibling copies --------------------------------------------------------------------------


def copy_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "look like copies" in r.getMessage()]


def test_the_same_name_with_another_codec_warns_once_naming_both(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a.jsonl").write_bytes(lines(0, 5))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines(0, 5)))
    (tmp_path / "b.jsonl").write_bytes(lines(5, 6))
    with caplog.at_level(logging.WARNING, logger="streamds.storage.shards"):
        assert len(ids(tmp_path)) == 11
    [warning] = copy_warnings(caplog)
    assert "a.jsonl' and '" in warning and "a.jsonl.gz' (the same name, another codec)" in warning
    assert "b.jsonl" not in warning


@pytest.mark.parametrize("name", ["train (1).jsonl", "Copy of train.jsonl", "train copy.jsonl",
                                  "train - Copy (2).jsonl", "train(1).jsonl.gz"])
def test_a_copy_with_the_same_first_records_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    (tmp_path / "train.jsonl").write_bytes(lines(0, 50))
    data = lines(0, 60)  # a copy that grew: the same first records
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with caplog.at_level(logging.WARNING, logger="streamds.storage.shards"):
        StreamingJsonl(str(tmp_path))
    [warning] = copy_warnings(caplog)
    assert f"train.jsonl' and '{tmp_path / name}' (a copy's name, the same first records)" in (
        warning)
    assert copy_of(name) is not None


def test_no_copy_warning_for_different_records_or_files_named_explicitly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "train.jsonl").write_bytes(lines(0, 5))
    (tmp_path / "train (1).jsonl").write_bytes(lines(5, 10))  # a real second part
    (tmp_path / "part (1).jsonl").write_bytes(lines(10, 11))
    with caplog.at_level(logging.WARNING, logger="streamds.storage.shards"):
        assert sorted(ids(tmp_path)) == list(range(11))
        (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress(lines(0, 5)))
        StreamingJsonl([str(tmp_path / "train.jsonl"), str(tmp_path / "train.jsonl.gz")])
    assert copy_warnings(caplog) == []


# -- 6. verify one file -------------------------------------------------------------------------


def test_verify_of_one_intact_shard_succeeds(shards: Path, capsys) -> None:
    entry = read_manifest(shards).shards[1]
    assert main(["verify", str(shards / entry.name), "--quiet"]) == 0
    assert f"OK, {entry.records:,} records" in capsys.readouterr().out
    assert main(["verify", str(shards / MANIFEST_NAME), "--quiet"]) == 0  # its folder


def test_verify_of_one_damaged_shard_fails_naming_it(copy: Path, capsys) -> None:
    entry = read_manifest(copy).shards[0]
    path = copy / entry.name
    path.write_bytes(path.read_bytes()[:-20])
    assert main(["verify", str(path), "--quiet"]) == 1
    assert f"DAMAGED {entry.name}" in capsys.readouterr().out


def test_verify_of_a_file_without_manifest_reads_every_record(tmp_path: Path, capsys) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_bytes(lines(0, 7))
    bad.write_bytes(lines(0, 3) + b'{"id": 3,\n')
    assert main(["verify", str(good)]) == 0
    assert "OK, 7 records decoded and parsed; no manifest.json" in capsys.readouterr().out
    assert main(["verify", str(bad)]) == 1
    assert "line 4" in capsys.readouterr().out


# -- 7. plain-loader resumes that cannot be exact ---------------------------------------------


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_bytes(lines(0, 200))
    return path


def drop_tens(record: dict) -> bool:
    return record["id"] % 10 != 0


def maybe(record: dict) -> dict | None:
    return None if record["id"] % 10 == 0 else record


@pytest.mark.parametrize("build", [
    lambda p: StreamingJsonl(str(p)).filter(drop_tens),
    lambda p: StreamingJsonl(str(p)).map(maybe),
    lambda p: StreamingJsonl(str(p)).map(maybe),
    lambda p: StreamingJsonl(str(p), on_error="skip"),
], ids=["filter", "map", "transform", "skip"])
def test_a_resume_after_batches_that_cannot_be_exact_is_refused(plain: Path, build) -> None:
    ds = build(plain)
    with pytest.raises(ValueError, match=r"StatefulDataLoader and save and load its "
                                         r"state_dict\(\).*every_line_yields=True"):
        ds.resume_after_batches(9, batch_size=10, num_workers=0)


def test_a_mix_plain_loader_resume_over_a_dropping_source_is_refused(plain: Path) -> None:
    from streamds import Mix

    mix = Mix([StreamingJsonl(str(plain)), StreamingJsonl(str(plain)).filter(drop_tens)],
              [0.5, 0.5], seed=0)
    with pytest.raises(ValueError, match=r"a \.filter\(\) step.*every_line_yields=True"):
        mix.resume_after_batches(3, batch_size=10, num_workers=0)
    rest = Mix([StreamingJsonl(str(plain)), StreamingJsonl(str(plain))], [0.5, 0.5], seed=0)
    assert list(rest.resume_after_batches(3, batch_size=10, num_workers=0))  # no drop: allowed


@pytest.mark.parametrize("workers", [0, 3])
def test_a_plain_loader_resume_under_another_worker_count_is_refused(
    plain: Path, workers: int
) -> None:
    # computed for 2 workers: another count would leave shares unread or read them twice
    rest = StreamingJsonl(str(plain)).resume_after_batches(3, batch_size=10, num_workers=2)
    loader = DataLoader(rest, batch_size=10, num_workers=workers, collate_fn=list)
    with pytest.raises(ValueError, match="computed for a loader with 2 reader"):
        next(iter(loader))


def test_every_line_yields_lets_a_map_that_keeps_every_record_resume(plain: Path) -> None:
    ds = StreamingJsonl(str(plain)).map(lambda r: {**r, "seen": True})
    rest = ds.resume_after_batches(9, batch_size=10, num_workers=0, every_line_yields=True)
    got = [record["id"] for record in rest]
    assert got == list(range(90, 200))
    assert len(got) == 110  # the dropping filter gave 130 here: refused above


def test_a_missing_listed_shard_of_a_remote_folder_is_an_error(shards: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        for path in shards.iterdir():
            fs.pipe(f"/issue27/{path.name}", path.read_bytes())
        assert len(ids("memory://issue27")) == 3000
        fs.rm("/issue27/shard-000001.jsonl.zst")
        with pytest.raises(MissingShardError, match=r"memory:///issue27/shard-000001\.jsonl\.zst "
                                                    r"is listed in memory:///issue27/manifest"):
            StreamingJsonl("memory://issue27")
    finally:
        fs.rm("/issue27", recursive=True)
