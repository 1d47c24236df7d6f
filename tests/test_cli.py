"""Tests for the `streamds` command line: convert, inspect, verify, and the bench dispatch."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import orjson
import pytest

from streamds import StreamingJsonl
from streamds.formats.manifest import MANIFEST_NAME, read_manifest
from streamds.preprocess.convert import JOURNAL_NAME
from streamds.preprocess.identity import INPUTS_NAME
from streamds.tools.cli import main
from streamds.tools.synthetic import write_pubmed

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("input") / "train.txt"
    write_pubmed(path, target_bytes=120_000, record_chars=1500)
    return path


@pytest.fixture(scope="module")
def converted(train: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "shards"
    assert main(["convert", str(train), "--output", str(out), "--shard-size", "30KB",
                 "--frame-size", "4KB", "--quiet"]) == 0
    return out


def damaged_copy(converted: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(converted, out)
    return out


def test_convert_prints_a_summary_and_progress_only_when_asked(train, tmp_path, capsys):
    assert main(["convert", str(train), "--output", str(tmp_path / "a"), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    records = sum(1 for line in train.read_bytes().splitlines() if line.strip())
    assert f"in {records:,}  out {records:,}  dropped 0  bad 0" in captured.out
    assert "ratio" in captured.out and "time" in captured.out
    assert main(["convert", str(train), "--output", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "converting" in err and "records" in err and "B/s" in err  # the tqdm bar


def test_convert_bad_input_exits_2_naming_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"a": 1}\n{"a": 2\n')
    assert main(["convert", str(bad), "--output", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: line 2: invalid JSON" in err
    assert main(["convert", str(bad), "--output", str(tmp_path / "skip"), "--quiet",
                 "--on-error", "skip"]) == 0
    assert "bad 1" in capsys.readouterr().out
    assert read_manifest(tmp_path / "skip").counts["bad"] == 1


def test_convert_rejects_bad_sizes_with_usage_error(train, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(train), "--output", str(tmp_path / "o"), "--shard-size", "lots"])
    assert exit_info.value.code == 2
    assert "cannot parse size 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["preprocess", "streamds.preprocess"])
def test_python_dash_m_runs_the_same_conversion(module, train, converted, tmp_path):
    out = tmp_path / "out"
    subprocess.run(  # `-m preprocess` from a checkout; `-m streamds.preprocess` anywhere
        [sys.executable, "-m", module, str(train), "--output", str(out),
         "--shard-size", "30KB", "--frame-size", "4KB", "--quiet", "--workers", "2"],
        cwd=REPO, check=True, capture_output=True,
    )
    # the journal and the record of the inputs are bookkeeping: the latter holds the
    # checksums of inputs modified just before a run (`preprocess.identity`), so it depends
    # on when the run looked
    bookkeeping = (JOURNAL_NAME, INPUTS_NAME)
    names = sorted(p.name for p in converted.iterdir() if p.name not in bookkeeping)
    assert sorted(p.name for p in out.iterdir() if p.name not in bookkeeping) == names
    for name in names:
        assert (out / name).read_bytes() == (converted / name).read_bytes()


def test_inspect_a_converted_directory(converted, capsys):
    assert main(["inspect", str(converted)]) == 0
    out = capsys.readouterr().out
    manifest = read_manifest(converted)
    totals = manifest.totals
    assert f"shards     {totals['shards']}" in out
    assert f"records    {totals['records']:,}" in out
    assert f"frames     {totals['frames']:,}" in out
    assert "seekable   yes" in out and "codec      zst" in out and "ratio" in out
    assert 'sample     {"article_id":"PMC0000000"' in out
    assert manifest.shards[0].name in out


def test_inspect_into_a_closed_pipe_stops_quietly(converted, monkeypatch):
    """`streamds inspect shards/ | head -1`: no BrokenPipeError traceback, SIGPIPE's status."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (head) is gone: every write now fails with EPIPE
    closed = open(write_end, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", closed)
    try:
        assert main(["inspect", str(converted)]) == 141
    finally:
        monkeypatch.undo()
        closed.close()


def test_inspect_arbitrary_jsonl_files(tmp_path, capsys):
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(b"".join(orjson.dumps({"i": i}) + b"\n" for i in range(250)))
    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert main(["inspect", str(plain), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "250" in out and "none" in out and '{"i":0}' in out
    assert main(["inspect", str(packed), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "gz" in out and "250 records" in out and "no " in out  # not seekable
    assert "streamds convert" in out  # the hint for unsplittable compressed files


def test_inspect_prints_big_integers_exactly(tmp_path, capsys):
    """The sample keeps integers beyond 64 bits digit for digit (was: 1.2345678901234568e+29)."""
    plain = tmp_path / "big.jsonl"
    plain.write_bytes(b'{"pmid":123456789012345678901234567890,"n":-18446744073709551617}\n')
    assert main(["inspect", str(plain), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert '{"pmid":123456789012345678901234567890,"n":-18446744073709551617}' in out, out


def test_verify_passes_an_intact_directory(converted, capsys):
    assert main(["verify", str(converted), "--quiet"]) == 0
    assert "OK" in capsys.readouterr().out


def test_verify_catches_a_flipped_byte(converted, tmp_path, capsys):
    out = damaged_copy(converted, tmp_path)
    victim = read_manifest(out).shards[1].name
    data = bytearray((out / victim).read_bytes())
    data[len(data) // 3] ^= 0x01
    (out / victim).write_bytes(bytes(data))
    assert main(["verify", str(out), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert f"DAMAGED {victim}" in captured.out and "checksum" in captured.out
    assert victim in captured.err
    others = [s.name for s in read_manifest(out).shards if s.name != victim]
    assert not any(f"DAMAGED {name}" in captured.out for name in others)


def test_verify_catches_a_truncated_shard(converted, tmp_path, capsys):
    out = damaged_copy(converted, tmp_path)
    victim = read_manifest(out).shards[0].name
    data = (out / victim).read_bytes()
    (out / victim).write_bytes(data[: len(data) - 50])
    assert main(["verify", str(out), "--quiet"]) == 1
    captured = capsys.readouterr().out
    assert f"DAMAGED {victim}" in captured and "seek table" in captured


def test_verify_catches_wrong_record_counts_and_stray_shards(converted, tmp_path, capsys):
    out = damaged_copy(converted, tmp_path)
    text = (out / MANIFEST_NAME).read_text()
    manifest = read_manifest(out)
    first = manifest.shards[0]
    wrong = list(first.records_per_frame)
    wrong[0] += 1
    text = text.replace(
        f'"records_per_frame":{orjson.dumps(list(first.records_per_frame)).decode()}',
        f'"records_per_frame":{orjson.dumps(wrong).decode()}', 1)
    (out / MANIFEST_NAME).write_text(text)
    (out / "extra.jsonl").write_bytes(b'{"x": 1}\n')
    assert main(["verify", str(out), "--quiet"]) == 1
    captured = capsys.readouterr().out
    assert f"{first.name}: frame 0 holds {wrong[0] - 1} records" in captured
    assert "UNLISTED extra.jsonl" in captured


def test_verify_without_a_manifest_says_so(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_bench_dispatches_to_streamds_bench(monkeypatch):
    calls = []
    fake = types.ModuleType("streamds.tools.bench")
    fake.main = lambda argv: calls.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "streamds.tools.bench", fake)
    assert main(["bench", "data/", "--num-workers", "2"]) == 7
    assert calls == [["data/", "--num-workers", "2"]]


def test_unknown_command_and_help(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "convert" in capsys.readouterr().out


def test_verify_and_inspect_tar_shards(train, tmp_path, capsys):
    out = tmp_path / "tar"
    assert main(["convert", str(train), "--output", str(out), "--format", "tar",
                 "--shard-size", "40KB", "--quiet"]) == 0
    assert main(["verify", str(out), "--quiet"]) == 0
    assert main(["inspect", str(out)]) == 0
    assert "format     tar" in capsys.readouterr().out
    victim = read_manifest(out).shards[-1].name
    data = (out / victim).read_bytes()
    (out / victim).write_bytes(data[:700])  # cut inside the first member
    assert main(["verify", str(out), "--quiet"]) == 1
    assert f"DAMAGED {victim}" in capsys.readouterr().out


def test_convert_dispatches_to_the_converters_own_command_line(monkeypatch):
    calls = []
    fake = types.ModuleType("streamds.preprocess.command")
    fake.main = lambda argv, prog: calls.append((argv, prog)) or 5  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "streamds.preprocess.command", fake)
    assert main(["convert", "in.jsonl", "--output", "out"]) == 5
    assert calls == [(["in.jsonl", "--output", "out"], "streamds convert")]


def test_streamds_never_imports_the_writing_side():
    code = (
        "import importlib, pkgutil, sys\n"
        "CONVERTER = 'streamds.preprocess'\n"
        "def load(package):\n"
        "    top = importlib.import_module(package)\n"
        "    for module in pkgutil.iter_modules(top.__path__, prefix=f'{package}.'):\n"
        "        if module.name not in (CONVERTER, f'{package}.__main__'):\n"
        "            importlib.import_module(module.name)\n"
        "def loaded(*names):\n"
        "    return sorted(m for m in sys.modules\n"
        "                  if any(m == n or m.startswith(f'{n}.') for n in names))\n"
        "load('streamds')\n"
        "print(loaded(CONVERTER, 'preprocess'))\n"
        "load(CONVERTER)\n"
        "print(loaded('preprocess'))\n"
        "print(len(loaded(CONVERTER)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=REPO)
    assert done.stdout.split("\n")[:2] == ["[]", "[]"]
    assert int(done.stdout.split("\n")[2]) > 10  # the converter's modules did load


def test_a_users_own_preprocess_module_does_not_shadow_the_converter(train, converted, tmp_path):
    """A `preprocess.py` of the user's, first on sys.path, is not the converter (issue 30):
    the converter is `streamds.preprocess`, also in the processes that convert the parts."""
    work = tmp_path / "project"
    work.mkdir()
    (work / "preprocess.py").write_text("raise ImportError('the user preprocess.py ran')\n")
    out = tmp_path / "out"
    code = ("import sys; from streamds.tools.cli import main; "
            "sys.exit(main(['convert', *sys.argv[1:]]))")
    done = subprocess.run(  # `-c`: the working directory, with preprocess.py, is sys.path[0]
        [sys.executable, "-c", code, str(train), "--output", str(out), "--shard-size", "30KB",
         "--frame-size", "4KB", "--quiet", "--parts", "2", "--executor", "process:2"],
        cwd=work, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert read_manifest(out).counts["records_out"] == read_manifest(converted).counts[
        "records_out"]
    assert list(StreamingJsonl(out)) == list(StreamingJsonl(converted))
