"""Conversion in parts (streamds.preprocess.parts_plan, .parts): the plan, the executors, resume.

Expected records come from a conversion in one part (itself checked against the plain bytes
by test_convert.py) and from the input bytes; byte identity is checked on every file of the
output but the journals (hidden; they hold timing-dependent progress counters).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tarfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
from test_convert import read_output

from streamds.formats.manifest import read_manifest
from streamds.formats.seekable import SeekableWriter
from streamds.preprocess.command import main as cli_main
from streamds.preprocess.convert import ConversionError, convert, convert_part, merge_parts
from streamds.preprocess.parts_plan import PLAN_NAME, read_plan
from streamds.preprocess.sources import Inputs, Meter
from streamds.tools.synthetic import write_pubmed, write_small_files

REPO = Path(__file__).resolve().parents[1]


def output_files(directory: Path) -> dict[str, bytes]:
    """Every output file by relative path; hidden files (journals) left out."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not any(p.startswith(".") for p in path.relative_to(directory).parts)
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A big JSONL, a seekable zstd file of small frames, a tree of small files."""
    root = tmp_path_factory.mktemp("parts")
    write_pubmed(root / "train.txt", target_bytes=400_000, record_chars=1500)
    lines = [orjson.dumps({"n": n, "text": "x" * (n % 97)}) for n in range(3000)]
    with open(root / "seekable.jsonl.zst", "wb") as f, SeekableWriter(f, frame_size=8000) as w:
        w.write_lines(lines)
    write_small_files(root / "small", records=300, per_folder=40, record_chars=300)
    inputs = [root / "train.txt", root / "seekable.jsonl.zst", root / "small"]
    single = root / "single"
    convert(inputs, single, shard_size=60_000, parts=1)
    return {"root": root, "inputs": inputs, "records": read_output(single)}


def test_plan_cuts_a_big_jsonl_at_line_beginnings_into_similar_parts(corpus):
    train = corpus["root"] / "train.txt"
    data = train.read_bytes()
    out = corpus["root"] / "plan-only"
    convert([train], out, shard_size=60_000, parts=6)
    plan = read_plan(out)
    assert plan is not None and len(plan.parts) == 6
    begins = [part.begin.offset for part in plan.parts]
    assert begins[0] == 0 and begins == sorted(set(begins))
    assert all(data[b - 1:b] == b"\n" for b in begins[1:])
    longest_line = max(len(line) + 1 for line in data.split(b"\n"))
    assert all(abs(part.bytes - len(data) / 6) <= longest_line for part in plan.parts)
    assert [part.end for part in plan.parts[:-1]] == [part.begin for part in plan.parts[1:]]
    assert plan.parts[-1].end is None and sum(part.bytes for part in plan.parts) == len(data)


def test_plan_cuts_a_seekable_zstd_file_at_frame_boundaries(corpus):
    path = corpus["root"] / "seekable.jsonl.zst"
    out = corpus["root"] / "plan-zst"
    convert([path], out, shard_size=60_000, parts=4)
    plan = read_plan(out)
    inside = [part.begin for part in plan.parts[1:]]
    assert all(0 < cut.stored < cut.offset for cut in inside)  # compressed < decoded offset
    assert read_output(out) == [orjson.loads(line) for line in _zstd_lines(path)]
    meter = Meter()  # the last part starts decoding at its frame, not at the file's start
    assert list(Inputs([str(path)]).records(span=plan.parts[-1].span, meter=meter))
    assert meter.stored_bytes == path.stat().st_size - plan.parts[-1].begin.stored


def _zstd_lines(path: Path) -> list[bytes]:
    import zstandard

    reader = zstandard.ZstdDecompressor().stream_reader(path.read_bytes(), read_across_frames=True)
    return [line for line in reader.read().split(b"\n") if line]


@pytest.mark.parametrize("parts", [2, 3, 7, 40])
def test_every_record_once_in_order_for_any_number_of_parts(corpus, tmp_path, parts):
    out = tmp_path / "out"
    result = convert(corpus["inputs"], out, shard_size=60_000, parts=parts)
    assert read_output(out) == corpus["records"]
    assert result.counts.records_out == len(corpus["records"])
    assert len(read_plan(out).parts) == parts
    manifest = read_manifest(out)
    assert manifest.options["parts"] == parts
    names = [entry.name for entry in manifest.shards]
    assert names == sorted(names) and all(name.startswith("part-") for name in names)


def test_more_parts_than_files_leaves_empty_parts(tmp_path):
    tree = tmp_path / "tree"
    write_small_files(tree, records=3, per_folder=2, record_chars=100)
    out = tmp_path / "out"
    convert([tree], out, parts=7)
    plan = read_plan(out)
    empty = [part for part in plan.parts if part.begin is None or part.begin == part.end]
    assert len(empty) >= 4
    assert len(read_output(out)) == 3


def test_streamds_reads_and_verifies_an_output_in_parts(corpus, tmp_path, capsys):
    from streamds import StreamingJsonl
    from streamds.tools.cli import main as streamds_main

    out = tmp_path / "out"
    convert(corpus["inputs"], out, shard_size=60_000, parts=3)
    assert list(StreamingJsonl(out)) == corpus["records"]
    assert streamds_main(["verify", str(out), "-q"]) == 0
    assert streamds_main(["inspect", str(out)]) == 0
    assert "part-00000/shard-000000.jsonl.zst" in capsys.readouterr().out


def test_tar_parts_have_unique_keys_and_read_back(corpus, tmp_path):
    out = tmp_path / "out"
    convert(corpus["inputs"], out, shard_size=60_000, parts=3, format="tar")
    assert read_output(out) == corpus["records"]
    keys = []
    for entry in read_manifest(out).shards:
        with tarfile.open(out / entry.name) as tar:
            keys += [member.name for member in tar.getmembers()]
    assert len(keys) == len(set(keys)) == len(corpus["records"])


def test_process_pool_writes_the_same_bytes_as_in_process(corpus, tmp_path):
    here, pool = tmp_path / "here", tmp_path / "pool"
    convert(corpus["inputs"], here, shard_size=60_000, parts=5)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=context) as executor:
        convert(corpus["inputs"], pool, shard_size=60_000, parts=5, executor=executor)
    assert output_files(pool) == output_files(here)
    assert len(output_files(here)) > 10


def test_rerun_redoes_only_unfinished_parts(corpus, tmp_path):
    out = tmp_path / "out"
    convert(corpus["inputs"], out, shard_size=60_000, parts=4)
    expected = output_files(out)
    shards = len(read_manifest(out).shards)
    (out / "part-00002" / "manifest.json").unlink()  # as if killed before the part finished
    last = sorted((out / "part-00002").glob("shard-*"))[-1]
    last.unlink()
    (out / "manifest.json").unlink()
    result = convert(corpus["inputs"], out, shard_size=60_000, parts=4)
    assert result.shards_written == 1 and result.shards_reused == shards - 1
    assert output_files(out) == expected


def test_a_part_killed_before_its_journal_ended_finishes_on_the_rerun(corpus, tmp_path):
    """Killed after the journal listed the part's last shard and before it wrote its end:
    the rerun has nothing to convert, and must still leave the part finished on disk (it
    used to end the journal in memory only, so every merge refused the part)."""
    out = tmp_path / "out"
    convert(corpus["inputs"], out, shard_size=60_000, parts=4)
    expected = output_files(out)
    folder = out / "part-00001"
    journal = orjson.loads((folder / ".streamds-convert.json").read_bytes())
    assert journal["end"] is not None and journal["shards"][-1]["next"] is None
    (folder / ".streamds-convert.json").write_bytes(orjson.dumps({**journal, "end": None}))
    (folder / "manifest.json").unlink()
    (out / "manifest.json").unlink()
    result = convert(corpus["inputs"], out, shard_size=60_000, parts=4)
    assert result.shards_written == 0
    assert output_files(out) == expected
    ended = orjson.loads((folder / ".streamds-convert.json").read_bytes())
    assert ended["end"] == journal["end"]


def test_other_options_or_parts_are_refused_naming_the_difference(corpus, tmp_path):
    out = tmp_path / "out"
    convert(corpus["inputs"], out, shard_size=60_000, parts=4)
    with pytest.raises(ConversionError, match="shard_size: 60000 -> 50000"):
        convert(corpus["inputs"], out, shard_size=50_000, parts=4)
    with pytest.raises(ConversionError, match="in 4 parts, not 3; pass --parts 4"):
        convert(corpus["inputs"], out, shard_size=60_000, parts=3)
    assert convert(corpus["inputs"], out, shard_size=60_000).shards_written == 0  # parts: 4
    single = tmp_path / "single"
    convert(corpus["inputs"], single, shard_size=60_000, parts=1)
    with pytest.raises(ConversionError, match="in one part"):
        convert(corpus["inputs"], single, shard_size=60_000, parts=2)


@pytest.mark.parametrize("codec", [None, "zst"])
def test_a_malformed_line_in_a_later_part_names_the_file_line(tmp_path, codec):
    """Line 1501 of the file, not its line within the part that holds it (also where the
    part begins at a seekable zstd frame inside a compressed file)."""
    lines = [orjson.dumps({"n": n}) for n in range(2000)]
    lines[1500] = b'{"n": broken'
    data = b"\n".join(lines) + b"\n"
    path = tmp_path / ("bad.jsonl" if codec is None else "bad.jsonl.zst")
    if codec is None:
        path.write_bytes(data)
    else:
        with open(path, "wb") as f, SeekableWriter(f, frame_size=4096) as writer:
            writer.write_lines(lines)
    with pytest.raises(ConversionError, match=rf"{path.name}: line 1501: ") as caught:
        convert([path], tmp_path / "out", parts=4, shard_size=8000)
    plan = read_plan(tmp_path / "out")
    assert plan is not None and plan.parts[3].begin.offset > 0  # the line's part: a cut inside
    assert "of the part" not in str(caught.value)


def test_part_and_merge_from_separate_processes_give_the_same_output(corpus, tmp_path):
    args = [*map(str, corpus["inputs"]), "--shard-size", "60000", "--parts", "3", "-q"]
    here = tmp_path / "here"
    convert(corpus["inputs"], here, shard_size=60_000, parts=3)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "preprocess", *args, "-o", str(out)]
    procs = [subprocess.Popen([*command, "--part", str(k)], env=env, stderr=subprocess.PIPE)
             for k in (0, 2)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    early = subprocess.run([*command, "--merge"], env=env, capture_output=True, text=True)
    assert early.returncode == 2 and "1 of 3 parts are not finished (part-00001)" in early.stderr
    assert subprocess.run([*command, "--part", "1"], env=env).returncode == 0
    assert subprocess.run([*command, "--merge"], env=env).returncode == 0
    assert output_files(out) == output_files(here)


def test_library_part_and_merge_and_their_errors(corpus, tmp_path):
    out = tmp_path / "out"
    for k in range(3):
        part = convert_part(corpus["inputs"], out, k, parts=3, shard_size=60_000)
        assert part.output == out / f"part-{k:05d}"
    assert convert_part(corpus["inputs"], out, 1, shard_size=60_000).shards_written == 0
    with pytest.raises(ConversionError, match="has 3 parts, 0 to 2; part 3 does not exist"):
        convert_part(corpus["inputs"], out, 3, shard_size=60_000)
    merged = merge_parts(corpus["inputs"], out, shard_size=60_000)
    assert read_output(out) == corpus["records"] and merged.manifest.totals["shards"] > 3


def test_cli_parts_executor_and_errors(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    inputs = [*map(str, corpus["inputs"])]
    assert cli_main([*inputs, "-o", str(out), "--parts", "3", "--executor", "local", "-q"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (out / PLAN_NAME).exists()
    with pytest.raises(SystemExit):
        cli_main([*inputs, "-o", str(out), "--executor", "ray"])
    assert "use local, process, process:N (N processes) or dask://HOST:PORT" in (
        capsys.readouterr().err)
    assert cli_main([*inputs, "-o", str(tmp_path / "x"), "--parts", "0"]) == 2
    assert "parts must be" in capsys.readouterr().err


def test_a_worker_that_dies_fails_the_run_and_the_rerun_finishes(corpus, tmp_path):
    marker = tmp_path / "killed-once"
    transform = f"test_parts:exit_once(marker={str(marker)!r}, article='PMC0000150')"
    here = tmp_path / "here"
    marker.touch()
    convert(corpus["inputs"], here, shard_size=60_000, parts=4, transform=transform)
    marker.unlink()
    out = tmp_path / "out"
    context = multiprocessing.get_context("spawn")
    with pytest.raises(ConversionError, match=r"parts failed; the first, part-0000\d"), \
            ProcessPoolExecutor(2, mp_context=context) as executor:
        convert(corpus["inputs"], out, shard_size=60_000, parts=4, transform=transform,
                executor=executor)
    assert marker.exists()
    with ProcessPoolExecutor(2, mp_context=context) as executor:
        convert(corpus["inputs"], out, shard_size=60_000, parts=4, transform=transform,
                executor=executor)
    assert output_files(out) == output_files(here)


def exit_once(marker: str, article: str):
    """A transform that ends its process at `article` the first time (`marker` says when)."""

    def apply(record: dict[str, Any]) -> dict[str, Any]:
        if record.get("article_id") == article and not os.path.exists(marker):
            Path(marker).touch()
            os._exit(3)
        return record

    return apply


def test_inputs_span_reads_exactly_the_part(corpus):
    source = Inputs([str(p) for p in corpus["inputs"]])
    out = corpus["root"] / "span"
    convert(corpus["inputs"], out, shard_size=60_000, parts=5)
    plan = read_plan(out)
    got = [raw.data for part in plan.parts for raw in source.records(span=part.span)]
    assert [orjson.loads(data) for data in got] == corpus["records"]
    shutil.rmtree(out)


def test_dask_executor_without_the_extra_names_it(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed -> ImportError
    argv = [*map(str, corpus["inputs"]), "-o", str(tmp_path / "out"), "--parts", "2",
            "--executor", "dask://127.0.0.1:1"]
    assert cli_main(argv) == 2
    assert "pip install 'streamds[cluster]'" in capsys.readouterr().err


def test_tasks_get_their_files_from_the_plan_and_list_nothing(corpus, tmp_path, monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from streamds.preprocess.listing import ListingWalk

    listed_by: list[str] = []
    original = ListingWalk.list_folder

    def spy(self: ListingWalk, rel: tuple[str, ...]) -> Any:
        listed_by.append(threading.current_thread().name)
        return original(self, rel)

    monkeypatch.setattr(ListingWalk, "list_folder", spy)
    out = tmp_path / "out"
    with ThreadPoolExecutor(2, thread_name_prefix="part") as pool:  # any Executor will do
        convert(corpus["inputs"], out, shard_size=60_000, parts=4, read_ahead=0, executor=pool)
    assert listed_by and not [name for name in listed_by if name.startswith("part")]
    assert read_output(out) == corpus["records"]
