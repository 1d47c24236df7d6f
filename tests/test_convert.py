"""Tests for the shard converter (preprocess.convert, sources, writers) and the manifest.

Corpora are generated per module with streamds.tools.synthetic plus hand-written odd cases
(pretty-printed JSON, tar shards, every codec). Expected records are computed independently
of the converter: from the plain bytes, and file order from a natural sort of full paths.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamds.formats.manifest import MANIFEST_NAME, read_manifest
from streamds.formats.seekable import decompress_frames, read_seek_table
from streamds.preprocess import convert as convert_module
from streamds.preprocess.convert import JOURNAL_NAME, ConversionError, convert, convert_part
from streamds.preprocess.identity import INPUTS_NAME
from streamds.preprocess.sources import Inputs
from streamds.storage.shards import natural_key
from streamds.tools.synthetic import write_pubmed, write_small_files, write_small_lines

REPO = Path(__file__).resolve().parents[1]
ZSTD = shutil.which("zstd")


def lines_of(data: bytes) -> list[bytes]:
    return [line for line in data.split(b"\n") if line.strip()]


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every input kind, each with the records it must yield, in order."""
    root = tmp_path_factory.mktemp("corpus")
    expected: dict[str, list[Any]] = {}

    write_pubmed(root / "train.txt", target_bytes=150_000, record_chars=1500)
    expected["train.txt"] = [orjson.loads(x) for x in lines_of((root / "train.txt").read_bytes())]

    write_small_lines(root / "lines.jsonl", target_bytes=40_000)
    plain = (root / "lines.jsonl").read_bytes()
    records = [orjson.loads(x) for x in lines_of(plain)]
    (root / "lines.jsonl.gz").write_bytes(gzip.compress(plain, mtime=0))
    (root / "lines.jsonl.bz2").write_bytes(bz2.compress(plain))
    (root / "lines.jsonl.xz").write_bytes(lzma.compress(plain))
    (root / "lines.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain))
    for name in ("lines.jsonl", "lines.jsonl.gz", "lines.jsonl.bz2", "lines.jsonl.xz",
                 "lines.jsonl.zst"):
        expected[name] = records

    small = root / "small"
    write_small_files(small, records=120, per_folder=25, record_chars=300)
    deep = small / "part_004" / "deeper" / "x"
    deep.mkdir(parents=True)
    pretty = {"article_id": "pretty", "article_text": ["a .", "b ."], "nested": {"k": [1, 2]}}
    (deep / "00000001.json").write_text(json.dumps(pretty, indent=2))
    (small / "part_010").mkdir()  # natural order: after part_004, not between 001 and 002
    (small / "part_010" / "7.json").write_text('{"id": "ten"}')
    (small / "README.txt").write_text("not a record")  # skipped in a directory walk
    (small / ".hidden.json").write_text("{broken")  # skipped: hidden
    (small / ".ipynb_checkpoints").mkdir()  # skipped: a hidden directory
    (small / ".ipynb_checkpoints" / "00000000.json").write_text('{"copy": 1}')
    files = sorted((p for p in small.rglob("*.json") if ".ipynb_checkpoints" not in str(p)
                    and not p.name.startswith(".")), key=lambda p: natural_key(str(p)))
    expected["small"] = [orjson.loads(p.read_bytes()) for p in files]

    tar_records = [{"key": i, "text": f"record {i}"} for i in range(40)]
    members = [(f"{i:05d}.json", orjson.dumps(r)) for i, r in enumerate(tar_records)]
    members.insert(3, ("00002.txt", b"not json, ignored"))
    (root / "wds.tar").write_bytes(tar_bytes(members))
    expected["wds.tar"] = tar_records
    jsonl_tar = [(f"part{i}.jsonl", b"".join(orjson.dumps(r) + b"\n" for r in chunk))
                 for i, chunk in enumerate((tar_records[:15], tar_records[15:]))]
    (root / "lines.tar").write_bytes(tar_bytes(jsonl_tar))
    expected["lines.tar"] = tar_records
    return {"root": root, "expected": expected}


def zstd_decode(data: bytes) -> bytes:
    """Every frame of a zstd file (skippable frames, such as the seek table, add nothing)."""
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    return reader.read()


def read_output(directory: Path) -> list[Any]:
    """Every record of a converted directory, in shard order, read without streamds."""
    manifest = read_manifest(directory)
    records = []
    for entry in manifest.shards:
        data = (directory / entry.name).read_bytes()
        if manifest.shard_format == "tar":
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                records += [orjson.loads(tar.extractfile(m).read()) for m in tar.getmembers()]
        else:
            records += [orjson.loads(x) for x in lines_of(zstd_decode(data))]
    return records


def files_of(directory: Path) -> dict[str, bytes]:
    """Shard and manifest bytes (the journal holds timing-independent state, not output)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if not p.name.startswith(".")}


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["train.txt", "lines.jsonl", "lines.jsonl.gz", "lines.jsonl.bz2", "lines.jsonl.xz",
     "lines.jsonl.zst", "small", "wds.tar", "lines.tar"],
)
def test_round_trip_every_input_kind(corpus, tmp_path, name):
    out = tmp_path / "out"
    result = convert([corpus["root"] / name], out, shard_size=30_000, frame_size=4096)
    expected = corpus["expected"][name]
    assert read_output(out) == expected  # same records, same order
    assert result.counts.records_in == result.counts.records_out == len(expected)
    assert result.manifest.totals["records"] == len(expected)
    assert {p.name for p in out.iterdir()} == {
        MANIFEST_NAME, JOURNAL_NAME, INPUTS_NAME, *(s.name for s in result.manifest.shards)
    }


def test_mixed_inputs_keep_the_given_order(corpus, tmp_path):
    names = ["wds.tar", "train.txt", "small", "lines.jsonl.gz"]
    out = tmp_path / "out"
    convert([corpus["root"] / n for n in names], out, shard_size=50_000, frame_size=8192)
    assert read_output(out) == [r for n in names for r in corpus["expected"][n]]


def test_globs_match_files_in_natural_order(corpus, tmp_path):
    small = corpus["root"] / "small"
    flat = sorted(small.glob("part_*/*.json"), key=lambda p: natural_key(str(p)))
    convert([f"{small}/part_*/*.json"], tmp_path / "a", shard_size=10**6)
    assert read_output(tmp_path / "a") == [orjson.loads(p.read_bytes()) for p in flat]
    convert([f"{small}/**/*.json"], tmp_path / "b", shard_size=10**6)
    assert read_output(tmp_path / "b") == corpus["expected"]["small"]
    convert([f"{small}/part_00[13]"], tmp_path / "c", shard_size=10**6)  # matched directories
    dirs = [p for p in flat if p.parent.name in ("part_001", "part_003")]
    assert read_output(tmp_path / "c") == [orjson.loads(p.read_bytes()) for p in dirs]


def test_resume_positions_restart_exactly_at_every_record(corpus):
    """The journal's contract: records(start=position of record k) yields records k, k+1, ..."""
    root = corpus["root"]
    inputs = Inputs([root / "wds.tar", root / "lines.jsonl.gz", root / "small",
                     root / "lines.tar", root / "lines.jsonl"])
    everything = [(raw.data, raw.position) for raw in inputs.records()]
    rng = random.Random(0)
    picks = [*sorted(rng.sample(range(len(everything)), 25)), 0, len(everything) - 1]
    for k in picks:
        rest = [raw.data for raw in inputs.records(everything[k][1])]
        assert rest == [data for data, _ in everything[k:]], k


def test_an_output_inside_an_input_folder_is_refused_naming_both(corpus, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(corpus["root"] / "small", tree)
    for output in (tree / "shards", tree / "part_001" / "shards", tree):
        with pytest.raises(ConversionError, match="lies inside the input") as caught:
            convert([tree], output, shard_size=4000, frame_size=1000)
        assert str(output) in str(caught.value) and str(tree) in str(caught.value)
        assert output == tree or not output.exists()  # refused before the output is made
    # a glob that cannot reach the output does not read it: allowed
    lines = tmp_path / "lines"
    lines.mkdir()
    shutil.copy(corpus["root"] / "lines.jsonl", lines / "a.jsonl")
    convert([f"{lines}/*.jsonl"], lines / "shards", shard_size=4000, frame_size=1000)
    assert read_output(lines / "shards") == corpus["expected"]["lines.jsonl"]
    with pytest.raises(ConversionError, match="lies inside the input"):
        convert([f"{lines}/*"], lines / "more", shard_size=4000)


# -- the shard format --------------------------------------------------------------------


@pytest.mark.skipif(ZSTD is None, reason="the zstd command is not installed")
def test_zstd_command_reads_every_shard(corpus, tmp_path):
    out = tmp_path / "out"
    result = convert([corpus["root"] / "train.txt"], out, shard_size=40_000, frame_size=5000)
    assert len(result.manifest.shards) > 2
    for entry in result.manifest.shards:
        decoded = subprocess.run([ZSTD, "-dc", out / entry.name], capture_output=True,
                                 check=True).stdout
        assert len(decoded) == entry.decoded_bytes
        assert decoded.count(b"\n") == entry.records
        for line in decoded.splitlines():
            orjson.loads(line)


def test_seek_table_is_right_for_frames_of_varying_sizes(tmp_path):
    rng = random.Random(1)
    records = [{"i": i, "pad": "x" * rng.choice([10, 200, 3000, 9000])} for i in range(300)]
    source = tmp_path / "varied.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    out = tmp_path / "out"
    result = convert([source], out, shard_size=200_000, frame_size=4096)
    sizes = set()
    for entry in result.manifest.shards:
        path = out / entry.name
        with open(path, "rb") as f:
            frames = read_seek_table(f, path.stat().st_size, name=entry.name)
            assert frames is not None
            assert tuple((fr.compressed_size, fr.decompressed_size) for fr in frames) == \
                entry.frame_sizes
            decoded = list(decompress_frames(f, frames, name=entry.name))
        for data, count in zip(decoded, entry.records_per_frame, strict=True):
            assert data.endswith(b"\n")  # frames hold whole lines
            assert data.count(b"\n") == count
            sizes.add(len(data))
    assert len(sizes) > 5  # the frames really vary
    assert max(sizes) > 4096  # a line longer than frame_size gets a frame of its own
    assert read_output(out) == records


def test_converted_shards_split_by_frames_across_two_dataloader_workers(corpus, tmp_path):
    from torch.utils.data import DataLoader

    from streamds import StreamingJsonl

    out = tmp_path / "out"
    convert([corpus["root"] / "train.txt"], out, shard_size=10**6, frame_size=2048)
    assert read_manifest(out).totals["shards"] == 1
    ds = StreamingJsonl(out).map(_tag_worker)
    seen = list(DataLoader(ds, batch_size=None, num_workers=2))
    workers = {record["worker"] for record in seen}
    assert workers == {0, 1}  # one shard still feeds both workers
    ids = sorted(record["article_id"] for record in seen)
    assert ids == sorted(r["article_id"] for r in corpus["expected"]["train.txt"])


def _tag_worker(record: dict[str, Any]) -> dict[str, Any]:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return {"article_id": record["article_id"], "worker": None if info is None else info.id}


def test_shards_are_cut_by_uncompressed_bytes(corpus, tmp_path):
    out = tmp_path / "out"
    result = convert([corpus["root"] / "lines.jsonl"], out, shard_size=10_000, frame_size=2000)
    shards = result.manifest.shards
    assert len(shards) > 3
    assert all(s.decoded_bytes <= 10_000 for s in shards)
    line = 300  # write_small_lines' line size: a shard closes only when the next line won't fit
    assert all(s.decoded_bytes > 10_000 - line for s in shards[:-1])


def test_manifest_lists_counts_options_and_checksums(corpus, tmp_path):
    import xxhash

    out = tmp_path / "out"
    convert([corpus["root"] / "train.txt"], out, shard_size=40_000, level=5, frame_size=3000)
    manifest = read_manifest(out)
    doc = json.loads((out / MANIFEST_NAME).read_text())
    assert doc["checksum"] == "xxh64" and doc["version"] == 1
    assert doc["options"] == {"format": "jsonl.zst", "shard_size": 40_000, "level": 5,
                              "frame_size": 3000, "transform": None, "on_error": "raise"}
    for entry in manifest.shards:
        assert entry.checksum == xxhash.xxh64((out / entry.name).read_bytes()).hexdigest()
        assert entry.bytes == (out / entry.name).stat().st_size
    assert doc["totals"]["records"] == doc["counts"]["records_out"] == sum(
        s["records"] for s in doc["shards"])
    assert doc["counts"]["input_bytes"] == (corpus["root"] / "train.txt").stat().st_size


def test_shards_py_takes_frames_from_the_manifest(corpus, tmp_path, monkeypatch):
    from streamds.formats import jsonl_zst
    from streamds.storage import shards as shards_module

    out = tmp_path / "out"
    convert([corpus["root"] / "train.txt"], out, shard_size=40_000, frame_size=3000)
    reference = shards_module.resolve_shards(str(out))
    opened = []
    real = jsonl_zst.read_seek_table
    monkeypatch.setattr(jsonl_zst, "read_seek_table",
                        lambda *a, **k: opened.append(a) or real(*a, **k))
    assert shards_module.resolve_shards(str(out)) == reference
    assert opened == []  # no shard opened for its seek table
    manifest = read_manifest(out)
    for shard, entry in zip(reference, manifest.shards, strict=True):
        assert shard.frames == entry.seek_frames()
    (out / MANIFEST_NAME).write_text("{not json")  # fallback: read the seek tables
    fallback = shards_module.resolve_shards(str(out))
    assert [s.frames for s in fallback] == [s.frames for s in reference]
    assert len(opened) == len(reference)


# -- determinism and workers -------------------------------------------------------------


def test_same_input_and_options_give_identical_bytes(corpus, tmp_path):
    inputs = [corpus["root"] / "small", corpus["root"] / "train.txt"]
    a = convert(inputs, tmp_path / "a", shard_size=25_000, frame_size=4000)
    convert(inputs, tmp_path / "b", shard_size=25_000, frame_size=4000)
    assert len(a.manifest.shards) > 3
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")


@pytest.mark.parametrize("fmt", ["jsonl.zst", "tar"])
def test_two_workers_write_the_same_bytes_as_one(corpus, tmp_path, fmt):
    inputs = [corpus["root"] / "small", corpus["root"] / "train.txt",
              corpus["root"] / "lines.jsonl.gz"]
    one = convert(inputs, tmp_path / "one", shard_size=20_000, frame_size=3000, format=fmt)
    convert(inputs, tmp_path / "two", shard_size=20_000, frame_size=3000, format=fmt,
            workers=2)
    assert len(one.manifest.shards) > 5
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")


# -- tar output --------------------------------------------------------------------------


def test_tar_output_is_read_by_streamds_and_webdataset(corpus, tmp_path):
    import webdataset

    from streamds import StreamingJsonl

    out = tmp_path / "out"
    result = convert([corpus["root"] / "train.txt"], out, shard_size=40_000, format="tar")
    expected = corpus["expected"]["train.txt"]
    assert len(result.manifest.shards) > 2
    assert list(StreamingJsonl(out)) == expected
    urls = [str(out / s.name) for s in result.manifest.shards]
    samples = list(webdataset.WebDataset(urls, shardshuffle=False, empty_check=False))
    assert [orjson.loads(s["json"]) for s in samples] == expected
    assert [s["__key__"] for s in samples] == [f"{i:010d}" for i in range(len(expected))]


@pytest.mark.parametrize("name", ["bom.jsonl", "bom.jsonl.gz", "bom.json", "lone-bom.jsonl"])
def test_a_byte_order_mark_follows_the_readers_rule(tmp_path, name):
    """A file that starts with a UTF-8 byte-order mark converts to the records streamds
    reads from it (the BOM is cut from the file's first line only; a lone BOM is a blank
    line); the converter used to refuse line 1 as invalid JSON."""
    from streamds import StreamingJsonl

    lines = b'{"i": 1}\n{"i": 2}\n'
    text = b"\xef\xbb\xbf" + (b"\n" + lines if name.startswith("lone") else lines)
    source = tmp_path / name
    source.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    convert([source], tmp_path / "out")
    expected = list(StreamingJsonl(str(source)))
    assert expected == [{"i": 1}, {"i": 2}]
    assert list(StreamingJsonl(str(tmp_path / "out"))) == expected


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(st.sampled_from([b'{"i": 1}', b'{"s": "a b"}', b"", b"  ", b"\r", b"\t"]),
                   max_size=12),
    bom=st.booleans(),
    final_newline=st.booleans(),
    codec=st.sampled_from(["", ".gz", ".zst"]),
)
def test_the_converter_reads_json_lines_as_streamds_does(tmp_path, lines, bom, final_newline,
                                                         codec):
    """One reader of JSON lines: whatever blank or whitespace lines, byte-order mark, final
    newline or codec, the shards hold the records `StreamingJsonl` reads from the input."""
    from streamds import StreamingJsonl

    text = (b"\xef\xbb\xbf" if bom else b"") + b"\n".join(lines)
    text += b"\n" if final_newline and lines else b""
    data = {"": text, ".gz": gzip.compress(text),
            ".zst": zstandard.ZstdCompressor().compress(text)}[codec]
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    source = work / f"in.jsonl{codec}"
    source.write_bytes(data)
    expected = list(StreamingJsonl(str(source)))
    if not expected:
        with pytest.raises(ConversionError, match="hold no records"):
            convert([source], work / "out")
        return
    convert([source], work / "out")
    assert list(StreamingJsonl(str(work / "out"))) == expected


def test_a_damaged_tar_header_stops_the_conversion_naming_the_file(tmp_path):
    """The converter reads tar shards with the library's reader: a damaged header after the
    first member is an error naming the file (Python's tarfile alone stops there silently,
    dropping every later record), or, with on_error="skip", the rest of the file counted bad."""
    members = [(f"s{i}.json", orjson.dumps({"i": i})) for i in range(3)]
    data = bytearray(tar_bytes(members))
    second = 512 + 512  # the first member's header and its data, padded to one block
    data[second + 148:second + 156] = b"garbage!"  # the second header's checksum field
    source = tmp_path / "damaged.tar"
    source.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match=r"damaged\.tar: truncated or damaged tar header"):
        convert([source], tmp_path / "out")
    good = tmp_path / "good.jsonl"
    good.write_bytes(b'{"i": 9}\n')
    result = convert([source, good], tmp_path / "skip", on_error="skip")
    assert (result.counts.records_out, result.counts.bad) == (2, 1)  # s0.json and good.jsonl


def test_tar_output_without_webdataset_names_the_extra_before_writing(corpus, tmp_path,
                                                                      monkeypatch, capsys):
    from streamds.preprocess.command import main
    from streamds.preprocess.writers import TarShard

    monkeypatch.setitem(sys.modules, "webdataset", None)  # as if not installed
    out = tmp_path / "out"
    with pytest.raises(ImportError, match=r"pip install 'streamds\[tar\]'"):
        convert([corpus["root"] / "train.txt"], out, format="tar")
    assert not out.exists()  # refused before any output was made
    assert main([str(corpus["root"] / "train.txt"), "--output", str(out), "--format", "tar",
                 "--quiet"]) == 2
    assert "pip install 'streamds[tar]'" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ImportError, match=r"pip install 'streamds\[tar\]'"):
        convert_part([corpus["root"] / "train.txt"], out, 0, format="tar")
    assert not out.exists()
    with pytest.raises(ImportError, match=r"pip install 'streamds\[tar\]'"):
        TarShard(tmp_path, "shard-000000.tar", first_record=0)  # the writer itself says so too
    assert not list(tmp_path.iterdir())  # not even its temporary file


# -- safety: interruption and resume -----------------------------------------------------

_BOMB = {"after": None, "seen": 0}


def explode_after(record: dict[str, Any]) -> dict[str, Any]:
    """A transform that fails once `_BOMB["after"]` records have passed (a crash stand-in)."""
    _BOMB["seen"] += 1
    if _BOMB["after"] is not None and _BOMB["seen"] > _BOMB["after"]:
        raise RuntimeError("simulated crash")
    return record


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_conversion_resumes_without_redoing_finished_shards(
    corpus, tmp_path, workers
):
    inputs = [corpus["root"] / "small", corpus["root"] / "lines.jsonl.bz2"]
    options = {"shard_size": 15_000, "frame_size": 4000, "transform": explode_after,
               "workers": workers}
    _BOMB.update(after=None, seen=0)
    reference = convert(inputs, tmp_path / "ref", **options)
    out = tmp_path / "out"
    _BOMB.update(after=reference.counts.records_in // 2, seen=0)
    with pytest.raises(ConversionError, match="simulated crash"):
        convert(inputs, out, **options)
    journal = json.loads((out / JOURNAL_NAME).read_text())
    finished = [item["shard"]["name"] for item in journal["shards"]]
    assert finished and not (out / MANIFEST_NAME).exists()
    before = {name: (out / name).stat() for name in finished}
    _BOMB.update(after=None, seen=0)
    resumed = convert(inputs, out, **options)
    assert resumed.shards_reused == len(finished)
    assert _BOMB["seen"] < reference.counts.records_in  # only the rest was read again
    for name, stat in before.items():
        assert (out / name).stat().st_ino == stat.st_ino
        assert (out / name).stat().st_mtime_ns == stat.st_mtime_ns
    assert files_of(out) == files_of(tmp_path / "ref")


def test_a_damaged_finished_shard_is_redone_on_rerun(corpus, tmp_path):
    inputs = [corpus["root"] / "train.txt"]
    convert(inputs, tmp_path / "ref", shard_size=30_000, frame_size=4000)
    out = tmp_path / "out"
    shutil.copytree(tmp_path / "ref", out)
    victim = out / "shard-000001.jsonl.zst"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    (out / "shard-000099.jsonl.zst").write_bytes(b"stray")  # not in the journal: removed
    (out / ".shard-000002.jsonl.zst.tmp").write_bytes(b"half")
    result = convert(inputs, out, shard_size=30_000, frame_size=4000)
    assert result.shards_reused == 1
    assert files_of(out) == files_of(tmp_path / "ref")
    assert not (out / ".shard-000002.jsonl.zst.tmp").exists()


def test_rerunning_a_finished_conversion_changes_nothing(corpus, tmp_path):
    out = tmp_path / "out"
    first = convert([corpus["root"] / "train.txt"], out, shard_size=30_000)
    before = files_of(out)
    again = convert([corpus["root"] / "train.txt"], out, shard_size=30_000)
    assert again.shards_written == 0 and again.shards_reused == len(first.manifest.shards)
    assert files_of(out) == before


def test_other_options_or_a_foreign_directory_are_refused(corpus, tmp_path):
    out = tmp_path / "out"
    convert([corpus["root"] / "train.txt"], out, shard_size=30_000)
    with pytest.raises(ConversionError, match=r"shard_size: 30000 -> 40000"):
        convert([corpus["root"] / "train.txt"], out, shard_size=40_000)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        convert([corpus["root"] / "train.txt"], foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def block_at_record(record: dict[str, Any]) -> dict[str, Any]:
    """A transform that blocks for good at record ``$BLOCK_AT``, opening the FIFO
    ``$BLOCK_FIFO`` that nobody writes: the converter then waits at a known record."""
    if record["i"] == int(os.environ.get("BLOCK_AT", "-1")):
        with open(os.environ["BLOCK_FIFO"], "rb") as f:
            f.read()
    return record


@pytest.mark.parametrize("workers", [1, 2])
def test_kill_9_then_rerun_gives_the_exact_set(tmp_path, workers, monkeypatch):
    """Kill the CLI while its transform blocks, after shards are journaled; rerun; compare."""
    data = b"".join(orjson.dumps({"i": i, "text": "w" * (i % 97)}) + b"\n" for i in range(4000))
    source = tmp_path / "input.jsonl"
    source.write_bytes(data)
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    monkeypatch.delenv("BLOCK_AT", raising=False)
    args = ["--shard-size", "20000", "--frame-size", "4096", "--workers", str(workers),
            "--transform", "test_convert:block_at_record"]
    options = {"shard_size": 20000, "frame_size": 4096, "workers": workers,
               "transform": "test_convert:block_at_record"}
    convert([str(source)], tmp_path / "ref", **options)
    block_at = 2400  # the converter blocks on this record, 3/5 of the way
    reference = json.loads((tmp_path / "ref" / JOURNAL_NAME).read_bytes())["shards"]
    offset = data.index(orjson.dumps({"i": block_at, "text": "w" * (block_at % 97)}))
    closable = sum(1 for item in reference if item["next"] and item["next"]["offset"] < offset)
    assert 3 <= closable < len(reference)

    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    env = {**os.environ, "BLOCK_AT": str(block_at), "BLOCK_FIFO": str(fifo),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "preprocess", str(source), "--output", str(out), "--quiet",
         *args], cwd=REPO, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        # Wait until every shard before the blocking record is journaled and the next one is
        # open, under whatever name: the converter then waits in the transform.
        journaled: list[str] = []
        while len(journaled) < closable or len(list(out.glob("*shard-*"))) <= closable:
            assert time.monotonic() < deadline and proc.poll() is None
            try:
                journal = json.loads((out / JOURNAL_NAME).read_bytes())
                journaled = [item["shard"]["name"] for item in journal["shards"]]
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        proc.kill()  # SIGKILL: no cleanup handlers run
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / MANIFEST_NAME).exists()
    # the shard being written lives under a hidden temporary name; named shards are whole
    assert any(p.name.startswith(".shard-") and p.name.endswith(".tmp") for p in out.iterdir())
    for path in out.glob("shard-*"):
        with open(path, "rb") as f:
            assert read_seek_table(f, path.stat().st_size, name=path.name) is not None
    stats = {name: (out / name).stat().st_mtime_ns for name in journaled}
    resumed = convert([str(source)], out, **options)
    assert resumed.shards_reused >= len(journaled)
    assert {name: (out / name).stat().st_mtime_ns for name in journaled} == stats
    assert files_of(out) == files_of(tmp_path / "ref")
    assert read_output(out) == [orjson.loads(x) for x in lines_of(data)]


# -- bad input ---------------------------------------------------------------------------


def noise_lines(count: int) -> bytes:
    """JSON lines that barely compress, so a cut compressed file loses real data."""
    rng = random.Random(2)
    return b"".join(orjson.dumps({"b": rng.getrandbits(64)}) + b"\n" for _ in range(count))


def test_malformed_inputs_name_the_file_and_place(tmp_path):
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_bytes(b'{"a": 1}\n\n{"a": 2}\n{"a": oops}\n{"a": 4}\n')
    with pytest.raises(ConversionError, match=rf"{bad_line}: line 4: invalid JSON"):
        convert([bad_line], tmp_path / "o1")
    tree = tmp_path / "tree" / "sub"
    tree.mkdir(parents=True)
    (tree / "1.json").write_text('{"ok": true}')
    (tree / "2.json").write_text('{"ok": ')
    with pytest.raises(ConversionError, match=r"tree/sub/2\.json: invalid JSON"):
        convert([tmp_path / "tree"], tmp_path / "o2")
    tar = tmp_path / "bad.tar"
    tar.write_bytes(tar_bytes([("a.json", b"{}"), ("b.json", b"[1,")]))
    with pytest.raises(ConversionError, match=r"bad\.tar: member b\.json \(record 2\)"):
        convert([tar], tmp_path / "o3")
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress(noise_lines(5000))[:-200])
    with pytest.raises(ConversionError, match=r"cut\.jsonl\.gz: corrupt or truncated"):
        convert([truncated], tmp_path / "o4")
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        convert([tmp_path / "missing.jsonl"], tmp_path / "o5")


def test_on_error_skip_counts_bad_records_and_files(tmp_path):
    bad_line = tmp_path / "a.jsonl"
    bad_line.write_bytes(b'{"a": 1}\n{"a": oops}\n{"a": 3}\n')
    truncated = tmp_path / "b.jsonl.gz"
    truncated.write_bytes(gzip.compress(noise_lines(5000))[:-200])
    after = tmp_path / "c.jsonl"
    after.write_bytes(b'{"c": 1}\n')
    out = tmp_path / "out"
    result = convert([bad_line, truncated, after], out, on_error="skip")
    counts = result.counts
    assert counts.bad == 2  # one line, one unreadable file rest
    records = read_output(out)
    assert records[:2] == [{"a": 1}, {"a": 3}] and records[-1] == {"c": 1}
    assert counts.records_out == len(records)
    assert counts.records_in == counts.records_out + counts.dropped + counts.bad
    assert read_manifest(out).counts["bad"] == 2


def test_transform_drops_and_rewrites_records(corpus, tmp_path):
    out = tmp_path / "out"
    result = convert([corpus["root"] / "train.txt"], out,
                     transform="streamds.preprocess.text:summarisation(max_words=20, min_words=1)")
    records = read_output(out)
    assert set(records[0]) == {"id", "text", "summary"}
    assert all(len(r["text"].split()) <= 20 for r in records)
    assert result.manifest.options["transform"] == (
        "streamds.preprocess.text:summarisation(max_words=20, min_words=1)")
    dropped = convert([corpus["root"] / "lines.jsonl"], tmp_path / "d",
                      transform=_keep_even_labels)
    expected = [r for r in corpus["expected"]["lines.jsonl"] if r["label"] % 2 == 0]
    assert read_output(tmp_path / "d") == expected
    assert dropped.counts.dropped == len(corpus["expected"]["lines.jsonl"]) - len(expected)


def _keep_even_labels(record: dict[str, Any]) -> dict[str, Any] | None:
    return record if record["label"] % 2 == 0 else None


def _nan_score(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "score": float("nan") if record["label"] == 3 else 0.5}


def test_a_transform_that_returns_nan_is_refused_naming_the_line(corpus, tmp_path):
    """orjson writes NaN and Infinity as null: the converter refuses them instead of changing
    the value, naming the file and line of the record."""
    lines = corpus["root"] / "lines.jsonl"
    first = next(i for i, r in enumerate(corpus["expected"]["lines.jsonl"]) if r["label"] == 3)
    with pytest.raises(ConversionError, match=rf"lines\.jsonl: line {first + 1}: .*NaN"):
        convert([lines], tmp_path / "nan", transform=_nan_score)


def test_bad_options_fail_early_naming_the_parameter(corpus, tmp_path):
    train = corpus["root"] / "train.txt"
    for kwargs, match in [({"shard_size": 0}, "shard_size"), ({"format": "zip"}, "format"),
                          ({"workers": 0}, "workers"), ({"on_error": "ignore"}, "on_error"),
                          ({"transform": "nomodule"}, "module:function"),
                          ({"transform": "json:nosuch"}, "cannot load")]:
        with pytest.raises(ValueError, match=match):
            convert([train], tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_journal_is_not_a_record_file(corpus, tmp_path):
    from streamds import StreamingJsonl

    out = tmp_path / "out"
    convert([corpus["root"] / "lines.jsonl"], out, shard_size=8000)
    assert list(StreamingJsonl(out)) == corpus["expected"]["lines.jsonl"]
    assert convert_module.JOURNAL_NAME.startswith(".")


def test_transform_spec_as_the_readme_writes_it():
    from streamds.preprocess.text import Summarisation, to_summarisation
    from streamds.spec import load_function

    pair = load_function("streamds.preprocess.text:summarisation(max_words=512)")
    assert isinstance(pair, Summarisation) and pair.max_words == 512
    assert load_function("streamds.preprocess.text:to_summarisation") is to_summarisation


def test_docstring_examples():
    import doctest

    from streamds.preprocess import command, commit, journal, recovery, run, sources, writers

    modules = (convert_module, command, commit, journal, recovery, run, sources, writers)
    results = [doctest.testmod(module) for module in modules]
    assert sum(r.attempted for r in results) >= 2 and sum(r.failed for r in results) == 0


def test_a_run_killed_before_its_first_shard_is_resumed_not_refused(corpus, tmp_path):
    train = corpus["root"] / "train.txt"
    expected = tmp_path / "expected"
    convert([train], expected, shard_size=40_000)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".shard-000000.jsonl.zst.tmp").write_bytes(b"half a shard")  # killed mid-write
    (out / ".streamds-convert.json.tmp").write_bytes(b"{")
    convert([train], out, shard_size=40_000)
    assert files_of(out) == files_of(expected)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / ".notes.tmp").write_bytes(b"")  # not the converter's: refused
    with pytest.raises(ConversionError, match="is not empty"):
        convert([train], tmp_path / "foreign", shard_size=40_000)
