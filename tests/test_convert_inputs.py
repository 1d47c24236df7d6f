"""The converter's refusals of inputs and outputs it cannot convert exactly (issue 27).

A rerun over changed inputs (finished, killed and resumed, in parts, with --part and
--merge), an output that is a file, an earlier output inside an input, inputs that name
nothing, a transform that drops everything, the places of skipped bad lines, and progress
inside one big file.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import shutil
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pytest

from streamds import StreamingJsonl
from streamds.formats.manifest import MANIFEST_NAME
from streamds.preprocess.command import main as convert_main
from streamds.preprocess.convert import (
    ConversionError,
    InputsChangedError,
    Progress,
    convert,
    convert_part,
    merge_parts,
)
from streamds.preprocess.identity import INPUTS_NAME
from streamds.preprocess.job import Job
from streamds.preprocess.journal import JOURNAL_NAME
from streamds.preprocess.parts import PartTask, run_part
from streamds.preprocess.parts_plan import PLAN_NAME, read_plan

OPTIONS: dict[str, Any] = {"shard_size": 4000, "frame_size": 1000}


def records(start: int, count: int, text: str = "x") -> bytes:
    return b"".join(orjson.dumps({"i": i, "text": text * 20}) + b"\n"
                    for i in range(start, start + count))


def read_back(out: Path) -> list[int]:
    return [record["i"] for record in StreamingJsonl(str(out))]


def touch_later(path: Path) -> None:
    """Move the file's mtime a second on: what time passing between runs does (a file's
    mtime ticks coarsely, so two writes in one test may share it)."""
    info = path.stat()
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))


_CRASH = {"after": None, "seen": 0}


def crash_after(record: dict[str, Any]) -> dict[str, Any]:
    """A transform that fails once `_CRASH["after"]` records passed (a kill stand-in)."""
    _CRASH["seen"] += 1
    if _CRASH["after"] is not None and _CRASH["seen"] > _CRASH["after"]:
        raise RuntimeError("simulated crash")
    return record


def crashed_run(inputs: list[Path], out: Path, after: int, **options: Any) -> None:
    _CRASH.update(after=after, seen=0)
    with pytest.raises(ConversionError, match="simulated crash"):
        convert(inputs, out, transform=crash_after, **OPTIONS, **options)
    _CRASH.update(after=None, seen=0)
    assert orjson.loads((out / JOURNAL_NAME).read_bytes())["shards"]  # shards were kept


# -- changed inputs ----------------------------------------------------------------------


def test_a_finished_output_is_not_reused_when_the_input_was_replaced(tmp_path, capsys):
    source, out = tmp_path / "train.jsonl", tmp_path / "out"
    source.write_bytes(records(0, 2000))
    convert([source], out, **OPTIONS)
    source.write_bytes(records(10_000, 300))  # replaced: other records, another size
    with pytest.raises(InputsChangedError, match="--overwrite") as caught:
        convert([source], out, **OPTIONS)
    assert f"1 changed: {source}" in str(caught.value)
    assert read_back(out) == list(range(2000))  # the refusal changed nothing
    args = [str(source), "--output", str(out), "--shard-size", "4000", "--quiet"]
    assert convert_main(args) == 2
    assert f"{source} (" in capsys.readouterr().err
    assert convert_main([*args, "--overwrite"]) == 0
    assert read_back(out) == list(range(10_000, 10_300))
    assert "0 reused" not in capsys.readouterr().out
    assert convert_main(args) == 0  # the same inputs again: reused
    assert "reused" in capsys.readouterr().out


def test_a_killed_run_over_a_shrunk_input_is_refused_not_resumed(tmp_path):
    source, out = tmp_path / "train.jsonl", tmp_path / "out"
    source.write_bytes(records(0, 3000))
    crashed_run([source], out, after=2000)
    source.write_bytes(records(0, 1000))  # shrunk: records 1000.. are gone
    with pytest.raises(InputsChangedError, match=r"bytes\)") as caught:
        convert([source], out, transform=crash_after, **OPTIONS)
    assert str(source) in str(caught.value) and "not resumed" in str(caught.value)
    convert([source], out, transform=crash_after, overwrite=True, **OPTIONS)
    assert read_back(out) == list(range(1000))


def test_a_killed_run_over_an_input_edited_in_place_is_refused(tmp_path):
    source, out = tmp_path / "train.jsonl", tmp_path / "out"
    source.write_bytes(records(0, 3000, "a"))
    crashed_run([source], out, after=1500)
    source.write_bytes(records(0, 3000, "b"))  # the same size, other text
    touch_later(source)
    with pytest.raises(InputsChangedError, match="modified since"):
        convert([source], out, transform=crash_after, **OPTIONS)
    convert([source], out, transform=crash_after, overwrite=True, **OPTIONS)
    texts = {record["text"] for record in StreamingJsonl(str(out))}
    assert texts == {"b" * 20}  # no old record mixed in


def test_files_added_to_or_removed_from_a_folder_are_named(tmp_path):
    folder, out = tmp_path / "data", tmp_path / "out"
    folder.mkdir()
    for k in range(3):
        (folder / f"f{k}.jsonl").write_bytes(records(100 * k, 100))
    convert([folder], out, **OPTIONS)
    (folder / "f3.jsonl").write_bytes(records(300, 100))
    with pytest.raises(InputsChangedError, match=r"1 added: .*f3\.jsonl"):
        convert([folder], out, **OPTIONS)
    (folder / "f3.jsonl").unlink()
    (folder / "f0.jsonl").unlink()
    with pytest.raises(InputsChangedError, match=r"1 no longer there: .*f0\.jsonl"):
        convert([folder], out, **OPTIONS)
    assert read_back(out) == list(range(300))


def test_parts_part_and_merge_refuse_changed_inputs(tmp_path):
    source, out = tmp_path / "big.jsonl", tmp_path / "out"
    source.write_bytes(records(0, 3000))
    options = {**OPTIONS, "parts": 3}
    convert([source], out, **options)
    assert (out / PLAN_NAME).exists() and (out / INPUTS_NAME).exists()
    source.write_bytes(records(0, 2500))  # shrunk
    with pytest.raises(InputsChangedError, match=str(source)):
        convert([source], out, **options)
    with ThreadPoolExecutor(2) as pool, pytest.raises(InputsChangedError):
        convert([source], out, executor=pool, **options)
    with pytest.raises(InputsChangedError, match="without --part or --merge"):
        convert_part([source], out, 1, **options)
    with pytest.raises(InputsChangedError, match="without --part or --merge"):
        merge_parts([source], out, **options)
    assert read_back(out) == list(range(3000))
    convert([source], out, overwrite=True, **options)
    assert read_back(out) == list(range(2500))


def test_a_part_killed_then_the_input_changed_is_refused_by_every_task(tmp_path):
    source, out = tmp_path / "big.jsonl", tmp_path / "out"
    source.write_bytes(records(0, 3000))
    options = {**OPTIONS, "parts": 3}
    convert_part([source], out, 0, **options)  # one task of an array ran, then the edit
    source.write_bytes(records(0, 3000, "y"))
    touch_later(source)
    for part in (1, 2):
        with pytest.raises(InputsChangedError):
            convert_part([source], out, part, **options)
    assert not (out / "part-00001").exists()


def test_a_part_task_that_starts_after_the_input_changed_refuses(tmp_path):
    """A task on a worker (or late in a job array) checks the files of its own part."""
    source, out = tmp_path / "big.jsonl", tmp_path / "out"
    source.write_bytes(records(0, 3000))
    convert_part([source], out, 0, parts=3, **OPTIONS)
    plan = read_plan(out)
    assert plan is not None
    source.write_bytes(records(0, 3000, "y"))
    touch_later(source)
    task = PartTask(Job((str(source),), **OPTIONS), str(out), plan.parts[1], plan.fingerprint)
    with pytest.raises(InputsChangedError, match=f"of this part's: {source}"):
        run_part(task)
    assert not (out / "part-00001").exists()


def test_overwrite_deletes_only_a_conversion(tmp_path):
    source = tmp_path / "train.jsonl"
    source.write_bytes(records(0, 100))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="deletes only what the converter wrote"):
        convert([source], foreign, overwrite=True, **OPTIONS)
    assert (foreign / "notes.txt").read_text() == "mine"
    out = tmp_path / "out"
    convert([source], out, parts=2, **OPTIONS)
    (out / "part-00000" / "notes.txt").write_text("mine too")
    with pytest.raises(ConversionError, match=r"not empty \(part-00000\)"):
        convert([source], out, overwrite=True, **OPTIONS)  # the converter's files went
    assert os.listdir(out) == ["part-00000"]
    assert os.listdir(out / "part-00000") == ["notes.txt"]
    (out / "part-00000" / "notes.txt").unlink()
    convert([source], out, overwrite=True, **OPTIONS)  # now in one part
    assert read_back(out) == list(range(100))
    with pytest.raises(SystemExit) as caught:  # argparse's usage error
        convert_main([str(source), "--output", str(out), "--part", "0", "--overwrite"])
    assert caught.value.code == 2


def rewrite_in_one_tick(path: Path, data: bytes) -> None:
    """Rewrite `path` in place with `data` (of its size) and give it back its modification
    time: what a rewrite within one tick of the file's clock looks like to a stat."""
    info = path.stat()
    assert len(data) == info.st_size
    path.write_bytes(data)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def test_a_rerun_after_a_rewrite_within_one_mtime_tick_is_refused(tmp_path):
    source, out = tmp_path / "train.jsonl", tmp_path / "out"
    source.write_bytes(records(0, 2000, "a"))
    convert([source], out, **OPTIONS)
    rewrite_in_one_tick(source, records(0, 2000, "b"))  # same size, same mtime, other text
    with pytest.raises(InputsChangedError, match=f"1 changed: {source}"):
        convert([source], out, **OPTIONS)
    convert([source], out, overwrite=True, **OPTIONS)
    assert {r["text"] for r in StreamingJsonl(str(out))} == {"b" * 20}
    assert convert([source], out, **OPTIONS).shards_written == 0  # unchanged: reused


def test_an_input_rewritten_during_the_conversion_fails_it_and_is_never_read_mixed(tmp_path):
    """A later input rewritten while an earlier one converts: the run fails naming it, writes
    no manifest (so readers refuse the output), and the rerun is refused until --overwrite."""
    first, second, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "out"
    first.write_bytes(records(0, 1000))
    second.write_bytes(records(1000, 1000))

    def rewrite_b_at_500(record: dict[str, Any]) -> dict[str, Any]:
        if record["i"] == 500:
            second.write_bytes(records(5000, 700))
        return record

    with pytest.raises(InputsChangedError, match=f"changed while they were converted \\({second}"):
        convert([first, second], out, transform=rewrite_b_at_500, **OPTIONS)
    assert not (out / MANIFEST_NAME).exists()
    with pytest.raises(FileNotFoundError, match="unfinished conversion"):
        StreamingJsonl(str(out))
    with pytest.raises(InputsChangedError, match="--overwrite"):
        convert([first, second], out, transform=rewrite_b_at_500, **OPTIONS)
    convert([first, second], out, overwrite=True, **OPTIONS)
    assert read_back(out) == [*range(1000), *range(5000, 5700)]


@pytest.mark.parametrize("parts", [None, 2])
def test_a_file_rewritten_within_one_tick_while_it_is_read_fails_the_run(tmp_path, parts):
    """Rewritten in place at the same size and modification time while its first MiB is
    converted: only its checksum tells (the file is racy: written just before the run)."""
    source, out = tmp_path / "train.jsonl", tmp_path / "out"
    source.write_bytes(records(0, 60_000, "a"))
    assert source.stat().st_size > 2 << 20  # read in pieces: the rest comes after the edit

    def rewrite_at_100(record: dict[str, Any]) -> dict[str, Any]:
        if record["i"] == 100 and record["text"][0] == "a":
            rewrite_in_one_tick(source, records(0, 60_000, "b"))
        return record

    with pytest.raises(InputsChangedError, match=f"changed while they were converted \\({source}"):
        convert([source], out, transform=rewrite_at_100, parts=parts, shard_size=1 << 20)
    assert not (out / MANIFEST_NAME).exists()


# -- the output --------------------------------------------------------------------------


def test_an_output_that_is_a_file_says_what_to_do(tmp_path, capsys):
    source, out = tmp_path / "train.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(records(0, 10))
    out.write_bytes(b"keep me")
    with pytest.raises(ConversionError, match="is a file, not a directory"):
        convert([source], out, **OPTIONS)
    assert convert_main([str(source), "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Errno" not in err and "new or empty directory" in err
    assert out.read_bytes() == b"keep me"


def test_an_earlier_output_inside_an_input_folder_is_refused_naming_it(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_bytes(records(0, 100))
    convert([data / "a.jsonl"], data / "old", **OPTIONS)  # an output beside its input
    with pytest.raises(ConversionError, match="earlier output") as caught:
        convert([data], tmp_path / "out", **OPTIONS)
    assert str(data / "old") in str(caught.value)
    assert not (tmp_path / "out").exists()
    convert([data / "old"], tmp_path / "again", shard_size=2000)  # that output itself: fine
    assert read_back(tmp_path / "again") == list(range(100))
    parts = tmp_path / "parts"
    convert([data / "a.jsonl"], parts, parts=2, **OPTIONS)
    convert([parts], tmp_path / "from-parts", **OPTIONS)  # its part folders are not nested
    assert read_back(tmp_path / "from-parts") == list(range(100))


def test_a_tree_with_its_own_manifest_json_is_no_output(tmp_path):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "manifest.json").write_text('{"about": "my data"}')
    (tree / "sub" / "r1.json").write_text('{"i": 1}')
    convert([tree], tmp_path / "out", **OPTIONS)
    assert read_back(tmp_path / "out") == [1]


# -- nothing to convert ------------------------------------------------------------------


def test_an_empty_folder_or_one_of_txt_files_is_refused_naming_what_it_holds(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConversionError, match="holds no files"):
        convert([empty], tmp_path / "out1", **OPTIONS)
    texts = tmp_path / "texts"
    texts.mkdir()
    for name in ("a.txt", "b.txt"):
        (texts / name).write_bytes(records(0, 5))
    assert convert_main([str(texts), "--output", str(tmp_path / "out2"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "2 files (a.txt, b.txt)" in err and ".jsonl" in err and "*.txt" in err
    with pytest.raises(ConversionError, match="no files match"):
        convert([f"{texts}/*.jsonl"], tmp_path / "out3", **OPTIONS)
    for k in (1, 2, 3):
        assert not (tmp_path / f"out{k}").exists()
    convert([f"{texts}/*.txt"], tmp_path / "out4", **OPTIONS)  # the hint works
    assert read_back(tmp_path / "out4") == [0, 1, 2, 3, 4] * 2


def test_inputs_without_records_are_an_error(tmp_path):
    (tmp_path / "blank.jsonl").write_bytes(b"\n  \n")
    for _ in range(2):  # the rerun refuses again: no empty manifest is ever written
        with pytest.raises(ConversionError, match="hold no records"):
            convert([tmp_path / "blank.jsonl"], tmp_path / "out", **OPTIONS)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def drop_all(record: dict[str, Any]) -> None:
    return None


def test_a_transform_that_drops_every_record_is_an_error(tmp_path, capsys):
    source = tmp_path / "train.jsonl"
    source.write_bytes(records(0, 50))
    with pytest.raises(ConversionError, match=r"drop_all dropped every record: 50 went in"):
        convert([source], tmp_path / "out", transform=drop_all, **OPTIONS)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    with pytest.raises(ConversionError, match="dropped every record: 50 went in"):
        convert([source], tmp_path / "parts", transform=drop_all, parts=2, **OPTIONS)
    assert not (tmp_path / "parts" / MANIFEST_NAME).exists()


# -- what was skipped --------------------------------------------------------------------


def test_on_error_skip_names_the_first_skipped_lines(tmp_path, capsys, caplog):
    lines = [b'{"i": %d}' % i if i % 7 else b'{"i": %d' % i for i in range(1, 200)]
    source = tmp_path / "bad.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    bad = [n for n in range(1, 200) if n % 7 == 0]
    with caplog.at_level(logging.WARNING, logger="streamds.preprocess"):
        result = convert([source], tmp_path / "out", on_error="skip", shard_size=200,
                         frame_size=100)
    assert result.counts.bad == len(bad)
    assert [place.split(": invalid")[0] for place in result.skipped] == [
        f"{source}: line {n}" for n in bad[:10]]
    assert f"{source}: line 7" in caplog.text and f"{len(bad)} bad records in all" in caplog.text
    again = convert([source], tmp_path / "out", on_error="skip", shard_size=200,
                    frame_size=100)  # reused: the journal still names them
    assert again.skipped == result.skipped
    args = [str(source), "--output", str(tmp_path / "cli"), "--on-error", "skip", "--quiet"]
    assert convert_main(args) == 0
    out = capsys.readouterr().out
    assert f"skipped  {len(bad)} bad records" in out and f"{source}: line 14" in out
    assert f"... and {len(bad) - 10} more" in out
    parts = convert([source], tmp_path / "parts", on_error="skip", parts=3, shard_size=200,
                    frame_size=100)
    assert [p.split(": ")[1] for p in parts.skipped][:1] == ["line 7"]
    assert len(parts.skipped) == 10


def test_a_resumed_run_keeps_the_places_skipped_before_the_kill(tmp_path):
    lines = [b'{"i": %d, "t": "%s"}' % (i, b"z" * 50) if i % 50 else b"{oops"
             for i in range(1, 400)]
    source = tmp_path / "bad.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    crashed_run([source], out, after=300, on_error="skip")
    result = convert([source], out, transform=crash_after, on_error="skip", **OPTIONS)
    assert result.shards_reused
    assert [p.split(": invalid")[0] for p in result.skipped] == [
        f"{source}: line {n}" for n in range(50, 400, 50)]


# -- progress ----------------------------------------------------------------------------


@pytest.mark.parametrize("parts", [None, 2])
def test_progress_moves_while_one_big_file_is_read(tmp_path, parts):
    source = tmp_path / "big.jsonl"
    source.write_bytes(records(0, 200, "p" * 1000))  # 4 MB in 200 records: few per MiB
    size = source.stat().st_size
    seen: list[Progress] = []
    convert([source], tmp_path / "out", shard_size=1 << 20, progress=seen.append,
            parts=parts)
    done = [p.resumed_bytes + p.stored_bytes for p in seen]
    assert done == sorted(done) and done[-1] == size
    assert len({n for n in done if 0 < n < size}) >= 3, done  # updates while reading
    assert all(p.bytes_total == size for p in seen)


def test_the_cli_bar_shows_bytes_rate_and_quiet_silences_it(tmp_path, capsys):
    source = tmp_path / "big.jsonl"
    source.write_bytes(records(0, 200, "p" * 1000))
    assert convert_main([str(source), "--output", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "converting" in err and "B/s" in err and "MB" in err
    assert convert_main([str(source), "--output", str(tmp_path / "b"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_progress_moves_while_parts_run_in_a_process_pool(tmp_path):
    """Parts in a pool's worker processes report as they read (through a queue), not only
    when each part ends: a single big file split over workers moves the bar."""
    source = tmp_path / "big.jsonl"
    source.write_bytes(records(0, 400, "p" * 1000))  # 8 MB in 2 parts, read by the MiB
    size = source.stat().st_size
    out = tmp_path / "out"
    seen: list[Progress] = []
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        convert([source], out, shard_size=1 << 20, progress=seen.append, parts=2,
                executor=pool)
    ends = {0, size, *(part.bytes for part in read_plan(out).parts)}  # parts done, or none
    done = [p.resumed_bytes + p.stored_bytes for p in seen]
    assert done == sorted(done) and done[-1] == size
    assert len({n for n in done if n not in ends}) >= 3, done  # within the running parts
    assert seen[-1].parts == 2 and all(p.bytes_total == size for p in seen)


def test_a_part_run_alone_reports_its_progress_out_of_its_planned_bytes(tmp_path):
    source = tmp_path / "big.jsonl"
    source.write_bytes(records(0, 400, "p" * 1000))  # 8 MB: a part of 4 MB, read by the MiB
    out = tmp_path / "out"
    seen: list[Progress] = []
    convert_part([source], out, 1, parts=2, shard_size=1 << 20, progress=seen.append)
    planned = read_plan(out).parts[1].bytes
    done = [p.resumed_bytes + p.stored_bytes for p in seen]
    assert done == sorted(done) and done[-1] == planned
    assert len({n for n in done if 0 < n < planned}) >= 3, done  # updates while reading
    assert all(p.bytes_total == planned for p in seen)


def test_the_cli_bar_moves_with_the_bytes_and_shows_the_rate_and_time_left(tmp_path, capsys):
    """The bar redraws as bytes are read (not on a clock), each time with the bytes read,
    the rate and the time left; a part run alone shows its own bar; --quiet silences it."""
    source = tmp_path / "big.jsonl"
    source.write_bytes(records(0, 400, "p" * 1000))
    for args in ([], ["--parts", "2", "--part", "1"]):
        assert convert_main([str(source), "--output", str(tmp_path / f"out{len(args)}"),
                             *args]) == 0
        frames = capsys.readouterr().err.split("\r")
        shown = [re.search(r"converting: +(\d+)%\|.*\| ([\d.]+[kMG]?)/[\d.]+[kMG]? "
                           r"\[[\d:]+<[\d:?]+, +[\d.]+[kMG]?B/s", frame) for frame in frames]
        percents = {int(match.group(1)) for match in shown if match}
        assert len(percents & set(range(1, 100))) >= 3, frames  # moving while it reads
    assert convert_main([str(source), "--output", str(tmp_path / "q"), "--parts", "2",
                         "--part", "0", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_a_finished_copy_elsewhere_is_no_change(tmp_path):
    """The record of the inputs names them by path under each input, not by where the
    output lies: moving a finished output and rerunning from it reuses it."""
    source = tmp_path / "train.jsonl"
    source.write_bytes(records(0, 100))
    convert([source], tmp_path / "out", **OPTIONS)
    shutil.move(tmp_path / "out", tmp_path / "moved")
    again = convert([source], tmp_path / "moved", **OPTIONS)
    assert again.shards_written == 0 and read_back(tmp_path / "moved") == list(range(100))


def test_a_remote_input_replaced_at_the_same_size_is_refused(tmp_path):
    memory = fsspec.filesystem("memory")
    try:
        memory.pipe("/changed/d/a.jsonl", records(0, 50, "a"))
        for source in ("memory://changed/d/a.jsonl", "memory://changed/d"):
            out = tmp_path / source.rsplit("/", 1)[-1]
            convert([source], out, **OPTIONS)
            memory.pipe("/changed/d/a.jsonl", records(0, 50, "b"))  # a new version
            with pytest.raises(InputsChangedError, match=r"a\.jsonl"):
                convert([source], out, **OPTIONS)
    finally:
        memory.rm("/changed", recursive=True)
