"""An output whose conversion did not finish is refused by every reader (issue 34, item 7),
and two conversions into one output do not get in each other's way.

The journal is there, the manifest is not: `StreamingJsonl`, `streamds inspect` and
`streamds verify` refuse it, naming the command that finishes it; that command then
finishes it and every record reads back once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from streamds import StreamingJsonl
from streamds.formats.manifest import MANIFEST_NAME
from streamds.formats.unfinished import UnfinishedConversionError
from streamds.preprocess.convert import ConversionError, convert
from streamds.preprocess.journal import JOURNAL_NAME
from streamds.preprocess.lock import OutputBusyError
from streamds.preprocess.parts_plan import PLAN_NAME
from streamds.tools.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
OPTIONS: dict[str, Any] = {"shard_size": 4000, "frame_size": 1000}


def records(count: int) -> bytes:
    return b"".join(orjson.dumps({"i": i, "text": "x" * 40}) + b"\n" for i in range(count))


def kill_at_record(record: dict[str, Any]) -> dict[str, Any]:
    """A transform that kills its own process (SIGKILL: no cleanup runs) at record
    ``$KILL_AT``: the converter dies at a known record, with no waiting in the test."""
    if record["i"] == int(os.environ.get("KILL_AT", "-1")):
        os.kill(os.getpid(), signal.SIGKILL)
    return record


def fail_at_record(record: dict[str, Any]) -> dict[str, Any]:
    if record["i"] == 2500:
        raise RuntimeError("simulated failure in one part")
    return record


def test_a_killed_conversion_is_refused_by_every_reader_until_its_command_finishes_it(
        tmp_path, capsys):
    source, out = tmp_path / "train.jsonl", tmp_path / "out"
    source.write_bytes(records(3000))
    command = [sys.executable, "-m", "preprocess", str(source), "--output", str(out),
               "--shard-size", "4000", "--quiet", "--transform",
               "test_convert_unfinished:kill_at_record"]
    env = {**os.environ, "KILL_AT": "2000",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    killed = subprocess.run(command, cwd=REPO, env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    assert (out / JOURNAL_NAME).is_file() and not (out / MANIFEST_NAME).exists()
    assert list(out.glob("shard-*"))  # whole shards a plain listing would read

    with pytest.raises(UnfinishedConversionError, match="unfinished conversion") as caught:
        StreamingJsonl(str(out))
    message = str(caught.value)
    assert f"streamds convert {source} --output {out}" in message
    assert "--transform test_convert_unfinished:kill_at_record" in message
    assert cli_main(["inspect", str(out)]) == 2
    assert "unfinished conversion" in capsys.readouterr().err
    assert cli_main(["verify", str(out)]) == 1
    assert f"streamds convert {source}" in capsys.readouterr().err

    env["KILL_AT"] = "-1"  # the command the message names finishes it
    subprocess.run(command, cwd=REPO, env=env, check=True)
    assert [record["i"] for record in StreamingJsonl(str(out))] == list(range(3000))
    assert cli_main(["verify", str(out)]) == 0


def test_a_conversion_in_parts_with_a_failed_part_is_refused_naming_the_rerun(
        tmp_path, monkeypatch):
    source, out = tmp_path / "train.jsonl", tmp_path / "out"
    source.write_bytes(records(4000))
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    transform = "test_convert_unfinished:fail_at_record"
    with pytest.raises(ConversionError, match="simulated failure in one part"):
        convert([source], out, parts=3, transform=transform, **OPTIONS)
    assert (out / PLAN_NAME).is_file() and not (out / MANIFEST_NAME).exists()
    assert (out / "part-00000" / MANIFEST_NAME).is_file()  # finished parts are whole
    with pytest.raises(UnfinishedConversionError, match="--parts 3") as caught:
        StreamingJsonl(str(out))
    assert f"{out} holds an unfinished conversion: its {PLAN_NAME}" in str(caught.value)
    assert "--merge" in str(caught.value)
    # the failed part's own folder is refused too, naming the conversion it belongs to
    with pytest.raises(UnfinishedConversionError, match=f"one part of the conversion into {out}"):
        StreamingJsonl(str(out / "part-00001"))
    StreamingJsonl(str(out / "part-00000"))  # a finished part reads


def test_a_leftover_journal_without_a_manifest_is_refused_in_a_nested_folder(tmp_path):
    """The state two failed concurrent runs (or a copy without its manifest) leave: found
    at any depth of the folder read."""
    out = tmp_path / "corpus" / "converted"
    convert([_write(tmp_path / "a.jsonl", records(500))], out, **OPTIONS)
    (out / MANIFEST_NAME).unlink()
    (tmp_path / "corpus" / "other.jsonl").write_bytes(records(10))
    with pytest.raises(UnfinishedConversionError, match=str(out)):
        StreamingJsonl(str(tmp_path / "corpus"))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# -- two conversions into one folder ---------------------------------------------------


def test_a_second_conversion_into_a_busy_folder_is_refused_naming_the_first(tmp_path):
    """The first run waits in its transform (an event, no sleep) after shards are written;
    the second is refused at once, naming the first's process; nothing of the first is lost."""
    source, out = tmp_path / "train.jsonl", tmp_path / "out"
    source.write_bytes(records(3000))
    reached, release = threading.Event(), threading.Event()

    def wait_at_2000(record: dict[str, Any]) -> dict[str, Any]:
        if record["i"] == 2000:
            reached.set()
            release.wait(60)
        return record

    first: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: first.update(
        result=convert([source], out, transform=wait_at_2000, **OPTIONS)))
    thread.start()
    try:
        assert reached.wait(60)
        with pytest.raises(OutputBusyError, match=f"pid {os.getpid()} on ") as caught:
            convert([source], out, transform=wait_at_2000, **OPTIONS)
        assert "being converted by another run" in str(caught.value)
        with pytest.raises(OutputBusyError):  # --overwrite deletes nothing under a run
            convert([source], out, overwrite=True, **OPTIONS)
    finally:
        release.set()
        thread.join(60)
    assert first["result"].manifest.totals["records"] == 3000
    assert [record["i"] for record in StreamingJsonl(str(out))] == list(range(3000))
    again = convert([source], out, transform=wait_at_2000, **OPTIONS)  # the lock went with it
    assert again.shards_written == 0
