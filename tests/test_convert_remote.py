"""Conversion straight from a URL or a slow mount: fsspec inputs, read-ahead, retries, resume.

Each conversion here is compared byte for byte with a conversion of the same files from local
disk, one file at a time (``read_ahead=0``): the shards and the manifest (but for the inputs
it lists) must not depend on where the files are, how many are read at once, or what failed
on the way. Remote inputs are fsspec's ``memory://`` and a loopback HTTP server
(`testbed.http`); nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pytest

import streamds.preprocess.files_ahead as files_ahead
import streamds.preprocess.sources as sources
from streamds.formats.manifest import MANIFEST_NAME
from streamds.formats.trees import directory_walk, glob_walk
from streamds.preprocess.command import main
from streamds.preprocess.convert import ConversionError, convert
from streamds.preprocess.files_ahead import FilesAhead
from streamds.preprocess.listing import ListingWalk
from streamds.preprocess.sources import Inputs, Leaf
from streamds.retry import RetryPolicy
from streamds.tools.synthetic import write_pubmed, write_small_files
from testbed.http import Faults, serve

pytest.importorskip("aiohttp", reason="HTTP inputs need the 'remote' extra (aiohttp)")

OPTIONS: dict[str, Any] = {"shard_size": 20_000, "frame_size": 4000}
FAST_RETRY = RetryPolicy(backoff=0.0)
MEMORY_ROOT = "/convert-remote"


# -- the corpus, local and remote ----------------------------------------------------------


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def www(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``www/tree``: 8 folders of 30 small ``.json`` files and every odd case a tree holds;
    ``www/big.jsonl``: one JSONL file of ~80 records."""
    www = tmp_path_factory.mktemp("www")
    tree = www / "tree"
    write_small_files(tree, records=240, per_folder=30, record_chars=300)
    (tree / "part_010").mkdir()  # natural order: after part_007, not after part_001
    (tree / "part_010" / "7.json").write_text('{"id": "seven"}')
    (tree / "part_010" / "10.json").write_text('{"id": "ten"}')  # natural order: after 7
    deep = tree / "part_003" / "deeper" / "x"
    deep.mkdir(parents=True)
    (deep / "pretty.json").write_text(json.dumps({"a": [1, 2], "b": {"c": "d"}}, indent=2))
    (tree / "array.json").write_text('[{"x": 1}, {"x": 2}, {"x": 3}]')
    (tree / "lines.json").write_text('{"y": 1}\n\n{"y": 2}\n')
    lines = b"".join(orjson.dumps({"z": i, "text": "w " * i}) + b"\n" for i in range(40))
    (tree / "part_002" / "more.jsonl.gz").write_bytes(gzip.compress(lines, mtime=0))
    members = [(f"{i:03d}.json", orjson.dumps({"t": i})) for i in range(12)]
    (tree / "wds.tar").write_bytes(tar_bytes(members))
    (tree / "README.txt").write_text("not a record")
    (tree / "_skipped.json").write_text('{"skipped": true}')
    (tree / ".ipynb_checkpoints").mkdir()
    (tree / ".ipynb_checkpoints" / "00000000.json").write_text('{"stale": true}')
    write_pubmed(www / "big.jsonl", target_bytes=120_000, record_chars=1500)
    return www


@pytest.fixture(scope="module")
def memory(www: Path) -> Iterator[str]:
    """The same files in fsspec's memory filesystem; yields the URL of the folder."""
    fs = fsspec.filesystem("memory")
    for path in www.rglob("*"):
        if path.is_file():
            fs.pipe(f"{MEMORY_ROOT}/{path.relative_to(www).as_posix()}", path.read_bytes())
    yield f"memory://{MEMORY_ROOT}"
    fs.rm(MEMORY_ROOT, recursive=True)


@pytest.fixture(scope="module")
def server(www: Path):
    with serve(www, Faults(latency=0.0)) as running:
        yield running


@pytest.fixture(scope="module")
def s3(www: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The same files in a bucket of moto's S3 server on 127.0.0.1; yields (URL, options)."""
    pytest.importorskip("moto", reason="S3 tests need moto[server] (the 'dev' extra)")
    pytest.importorskip("s3fs", reason="S3 tests need s3fs (the 'dev' extra)")
    from testbed.s3 import serve_s3, upload_folder

    with serve_s3() as (endpoint_url, options):
        upload_folder(www, "convert-remote", endpoint_url=endpoint_url)
        yield "s3://convert-remote", options


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, www: Path):
    """Local conversions, one file at a time, by input list (made once each)."""
    made: dict[tuple[str, ...], Path] = {}

    def get(inputs: list[str]) -> Path:
        key = tuple(inputs)
        if key not in made:
            out = tmp_path_factory.mktemp("reference") / "out"
            convert(inputs, out, read_ahead=0, **OPTIONS)
            made[key] = out
        return made[key]

    return get


def files_of(directory: Path) -> dict[str, bytes]:
    """Shard bytes, and the manifest without the inputs it lists (they name other places)."""
    found = {}
    for path in sorted(directory.iterdir()):
        if path.name == MANIFEST_NAME:
            manifest = json.loads(path.read_bytes())
            del manifest["inputs"]
            found[path.name] = orjson.dumps(manifest)
        elif not path.name.startswith("."):
            found[path.name] = path.read_bytes()
    return found


def same_output(out: Path, ref: Path) -> None:
    got, want = files_of(out), files_of(ref)
    assert len(want) > 5  # several shards: order and cuts are really compared
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs"


@pytest.fixture
def pooled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start the read-ahead threads at once (local files are never slow enough to)."""
    monkeypatch.setattr(files_ahead, "SLOW_IN_A_ROW", 0)


# -- URLs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["memory", "http"])
@pytest.mark.parametrize("spelling", ["tree", "tree/", "tree/part_*/*.json", "tree/**/*.json"])
def test_a_remote_tree_converts_to_the_bytes_of_the_local_tree(
    www, memory, server, reference, tmp_path, where, spelling
):
    base = memory if where == "memory" else server.url
    url = f"{base}/{spelling}"
    result = convert([url], tmp_path / "out", **OPTIONS)
    same_output(tmp_path / "out", reference([f"{www}/{spelling}"]))
    assert result.manifest.inputs == (url,)


@pytest.mark.parametrize("spelling", ["tree/", "tree/part_*/*.json", "big.jsonl"])
def test_s3_converts_to_the_bytes_of_local_files(www, s3, reference, tmp_path, spelling):
    base, options = s3
    convert([f"{base}/{spelling}"], tmp_path / "out", storage_options=options, **OPTIONS)
    same_output(tmp_path / "out", reference([f"{www}/{spelling}"]))


def test_remote_single_files_convert_like_local_ones(www, memory, server, reference, tmp_path):
    names = ["big.jsonl", "tree/part_002/more.jsonl.gz", "tree/array.json", "tree/wds.tar"]
    urls = [f"{server.url}/{names[0]}", f"{memory}/{names[1]}", f"{server.url}/{names[2]}",
            f"{memory}/{names[3]}"]
    convert(urls, tmp_path / "out", **OPTIONS)
    same_output(tmp_path / "out", reference([str(www / name) for name in names]))


def test_a_remote_file_named_twice_is_refused_before_writing(memory, tmp_path):
    inside = f"{memory}/tree/part_000/00000000.json"
    with pytest.raises(ValueError, match="more than once"):
        convert([f"{memory}/tree", inside], tmp_path / "out", **OPTIONS)
    assert not list((tmp_path / "out").glob("shard-*"))


def test_a_missing_url_is_named(server, memory, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere"):
        convert([f"{memory}/nothere/"], tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="nothing-matches"):
        convert([f"{server.url}/tree/nothing-matches*/*.json"], tmp_path / "b")


# -- read-ahead ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"read_ahead": 64}, {"read_ahead": 3, "read_ahead_bytes": 1},
     {"read_ahead": 16, "workers": 2}],
    ids=["64 threads", "3 threads, no byte budget", "16 threads, 2 shard workers"],
)
def test_read_ahead_writes_the_bytes_of_one_file_at_a_time(www, reference, tmp_path, pooled,
                                                          options):
    convert([www / "tree"], tmp_path / "out", **OPTIONS, **options)
    same_output(tmp_path / "out", reference([str(www / "tree")]))


def test_read_ahead_keeps_many_opens_in_flight_across_folders(www, memory, reference, tmp_path,
                                                             pooled, monkeypatch):
    """The first 8 reads wait for each other: they only finish if 8 are in flight at once,
    and the folders they come from show the spread."""
    gate = threading.Barrier(8, timeout=30)
    folders: list[Any] = []
    fetch = sources.fetch_json

    def gated(leaf: Leaf, policy: RetryPolicy) -> Any:
        if len(folders) < 8:
            folders.append(leaf.rel[:-1] if leaf.rel else None)
            gate.wait()
        return fetch(leaf, policy)

    monkeypatch.setattr(sources, "fetch_json", gated)
    convert([f"{memory}/tree"], tmp_path / "out", read_ahead=8, **OPTIONS)
    assert len(set(folders)) >= 4, folders  # not 8 files of one folder
    same_output(tmp_path / "out", reference([str(www / "tree")]))


def _folder(item: int) -> int:
    return item // 10


def test_read_ahead_stops_at_its_byte_budget_while_the_next_file_is_slow():
    """Item 0 hangs until item 1 starts; meanwhile the other thread reads ahead, in other
    folders, only while less than `max_bytes` is held, then takes the near item 1."""
    first_may_finish = threading.Event()
    started: list[int] = []

    def fetch(item: int) -> bytes:
        started.append(item)
        if item == 0:
            assert first_may_finish.wait(30)
        if item == 1:
            first_may_finish.set()
        return bytes(100)

    ahead = FilesAhead(list(range(40)), fetch, wants=lambda item: True, group=_folder,
                      size=len, threads=2, max_bytes=250)
    slow_in_a_row = files_ahead.SLOW_IN_A_ROW
    files_ahead.SLOW_IN_A_ROW = 0
    try:
        got = [(item, outcome.result()) for item, outcome in ahead]  # type: ignore[union-attr]
    finally:
        files_ahead.SLOW_IN_A_ROW = slow_in_a_row
    assert [item for item, _ in got] == list(range(40))
    assert all(data == bytes(100) for _, data in got)
    before_one = started[: started.index(1)]
    assert {_folder(item) for item in before_one} - {0}  # it read ahead in another folder
    assert len(before_one) <= 1 + 3  # item 0, then 3 x 100 bytes reach the 250-byte budget
    assert ahead.peak_held <= 250 + 2 * 2 * 100


def test_read_ahead_raises_a_failed_read_at_its_place(monkeypatch):
    monkeypatch.setattr(files_ahead, "SLOW_IN_A_ROW", 0)

    def fetch(item: int) -> int:
        if item == 25:
            raise OSError(errno.ENOENT, "gone")
        return item

    ahead = FilesAhead(list(range(40)), fetch, wants=lambda item: item % 7 != 3,
                      group=_folder, size=lambda value: 8, threads=4, max_bytes=1000)
    seen = []
    with pytest.raises(OSError, match="gone"):
        for item, outcome in ahead:
            seen.append(item if outcome is None else outcome.result())
    assert seen == list(range(25))


def test_one_at_a_time_until_reads_are_slow(monkeypatch):
    """Fast reads stay in the consumer's thread; slow ones start the pool."""
    threads: set[str] = set()

    def fetch(item: int) -> int:
        threads.add(threading.current_thread().name)
        return item

    def run() -> list[int]:
        ahead = FilesAhead(list(range(30)), fetch, wants=lambda item: True, group=_folder,
                          size=lambda value: 8, threads=4, max_bytes=1000)
        return [outcome.result() for _, outcome in ahead]  # type: ignore[union-attr]

    assert run() == list(range(30))
    assert threads == {threading.current_thread().name}
    monkeypatch.setattr(files_ahead, "SLOW_FETCH", -1.0)  # every read counts as slow
    assert run() == list(range(30))
    assert any(name.startswith("streamds-read") for name in threads)


# -- listing -------------------------------------------------------------------------------


@pytest.fixture
def messy(tmp_path: Path) -> Path:
    """Folders in natural order, hidden ones, links to files and folders, and a loop."""
    root = tmp_path / "messy"
    for folder in ("a", "b", "c", "c/d", "part_2", "part_10", ".hidden", "e"):
        (root / folder).mkdir(parents=True)
        for name in ("1.json", "2.jsonl", "10.json", ".x.json", "notes.txt"):
            (root / folder / name).write_text("{}\n")
    (root / "b" / "link.json").symlink_to(root / "a" / "1.json")
    (root / "c" / "to_e").symlink_to(root / "e", target_is_directory=True)
    (root / "c" / "d" / "up").symlink_to(root / "c", target_is_directory=True)
    return root


def test_listing_ahead_walks_exactly_as_the_reader(messy):
    for walk in (directory_walk(str(messy)), glob_walk(f"{messy}/*/*.json"),
                 glob_walk(f"{messy}/**/*.json"), glob_walk(f"{messy}/.hidden/*")):
        expected = list(walk.files())
        ahead = ListingWalk(walk, threads=8)
        assert list(ahead.files()) == expected
        for start in expected:  # resuming from any file
            assert list(ahead.files(start)) == list(walk.files(start))
    ahead = ListingWalk(directory_walk(str(messy)), threads=8)
    list(ahead.files())
    assert {("b", "link.json"), ("c", "to_e"), ("c", "d", "up")} <= ahead.links


def test_listing_ahead_lists_several_folders_at_once(messy, monkeypatch):
    gate = threading.Barrier(3, timeout=30)
    waited: list[tuple[str, ...]] = []
    list_folder = ListingWalk.list_folder

    def gated(self: ListingWalk, rel: tuple[str, ...]) -> Any:
        if rel and len(waited) < 3:
            waited.append(rel)
            gate.wait()
        return list_folder(self, rel)

    monkeypatch.setattr(ListingWalk, "list_folder", gated)
    walk = directory_walk(str(messy))
    assert list(ListingWalk(walk, threads=4).files()) == list(walk.files())
    assert len(set(waited)) == 3


# -- faults --------------------------------------------------------------------------------


class _Flaky:
    """Counts calls; every `every`-th fails with EIO (Drive's "[Errno 5]")."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.calls = 0
        self.failed = 0
        self.lock = threading.Lock()

    def check(self, what: str) -> None:
        with self.lock:
            self.calls += 1
            fail = self.calls % self.every == 0
            self.failed += fail
        if fail:
            raise OSError(errno.EIO, f"Input/output error ({what})")


class _FlakyFile(io.RawIOBase):
    """A file whose reads return at most 4 KiB and fail per `flaky`."""

    def __init__(self, raw: Any, flaky: _Flaky) -> None:
        self.raw = raw
        self.flaky = flaky

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        self.flaky.check("read")
        return self.raw.read(min(size, 4096) if size >= 0 else 4096)  # short reads: many

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def close(self) -> None:
        self.raw.close()
        super().close()


@pytest.mark.parametrize(("remote", "read_ahead"), [("big.jsonl", 0), ("tree", 8)])
def test_transient_errors_on_open_and_read_are_retried_to_the_same_bytes(
    www, memory, reference, tmp_path, monkeypatch, remote, read_ahead
):
    local = [str(www / "tree"), str(www / "big.jsonl")]
    expected = reference(local)  # made before the faults start
    opens, reads = _Flaky(every=4), _Flaky(every=3)
    leaf_open = Leaf.open

    def flaky_open(self: Leaf) -> Any:
        opens.check(f"open {self.path}")
        return _FlakyFile(leaf_open(self), reads)

    memory_fs = fsspec.filesystem("memory")
    cat_file = type(memory_fs).cat_file

    def flaky_cat(self: Any, path: str, *args: Any, **kwargs: Any) -> bytes:
        opens.check(f"cat {path}")
        return cat_file(self, path, *args, **kwargs)

    monkeypatch.setattr(Leaf, "open", flaky_open)
    monkeypatch.setattr(type(memory_fs), "cat_file", flaky_cat)
    monkeypatch.setattr(files_ahead, "SLOW_IN_A_ROW", 0)
    inputs = [f"{memory}/{remote}" if path.endswith(remote) else path for path in local]
    convert(inputs, tmp_path / "out", read_ahead=read_ahead, retry=FAST_RETRY, **OPTIONS)
    assert opens.failed > 50 and reads.failed > 10
    same_output(tmp_path / "out", expected)


def test_without_retries_the_same_faults_stop_the_conversion(www, tmp_path, monkeypatch):
    """The check above is not vacuous: these faults do reach the converter."""
    opens = _Flaky(every=4)
    leaf_open = Leaf.open

    def flaky_open(self: Leaf) -> Any:
        opens.check(f"open {self.path}")
        return leaf_open(self)

    monkeypatch.setattr(Leaf, "open", flaky_open)
    with pytest.raises((OSError, ConversionError), match="Input/output error"):
        convert([www / "tree"], tmp_path / "out", retry=RetryPolicy(attempts=1, backoff=0.0),
                **OPTIONS)


def test_http_errors_are_retried_to_the_same_bytes(www, server, reference, tmp_path):
    expected = reference([f"{www}/tree/", str(www / "big.jsonl")])
    server.faults = Faults(fail_every=3)
    server.reset_log()
    try:
        convert([f"{server.url}/tree/", f"{server.url}/big.jsonl"], tmp_path / "out",
                read_ahead=8, retry=FAST_RETRY, **OPTIONS)
    finally:
        server.faults = Faults()
    assert sum(request.status == 503 for request in server.log) > 10
    same_output(tmp_path / "out", expected)


# -- resume --------------------------------------------------------------------------------

_BOMB = {"after": None, "seen": 0}


def explode_after(record: dict[str, Any]) -> dict[str, Any]:
    """A transform that fails once `_BOMB["after"]` records have passed (a crash stand-in)."""
    _BOMB["seen"] += 1
    if _BOMB["after"] is not None and _BOMB["seen"] > _BOMB["after"]:
        raise RuntimeError("simulated crash")
    return record


@pytest.mark.parametrize("crash_at", [0.4, 0.95])  # in the tree; in the HTTP file
@pytest.mark.parametrize("read_ahead", [0, 8])
def test_an_interrupted_conversion_from_urls_resumes(memory, server, tmp_path, pooled,
                                                     read_ahead, crash_at):
    inputs = [f"{memory}/tree", f"{server.url}/big.jsonl"]
    options = {**OPTIONS, "transform": explode_after, "read_ahead": read_ahead}
    _BOMB.update(after=None, seen=0)
    reference = convert(inputs, tmp_path / "ref", **options)
    total = reference.counts.records_in
    out = tmp_path / "out"
    _BOMB.update(after=int(total * crash_at), seen=0)
    with pytest.raises(ConversionError, match="simulated crash"):
        convert(inputs, out, **options)
    journal = json.loads((out / ".streamds-convert.json").read_text())
    assert journal["shards"] and not (out / MANIFEST_NAME).exists()
    _BOMB.update(after=None, seen=0)
    server.reset_log()
    resumed = convert(inputs, out, **options)
    assert resumed.shards_reused == len(journal["shards"])
    last = journal["shards"][-1]
    assert _BOMB["seen"] == total - last["counts"]["records_in"]  # only the rest read again
    same_output(out, tmp_path / "ref")
    if crash_at > 0.5:  # resumed inside the HTTP file: by a range from the middle
        assert last["next"]["input"] == 1 and last["next"]["offset"] > 0
        ranges = [r.range for r in server.log if r.path == "/big.jsonl" and r.range]
        assert ranges and not any(r.startswith("bytes=0-") for r in ranges)


# -- the command line ----------------------------------------------------------------------


def test_cli_takes_urls_read_ahead_and_storage_options(www, memory, reference, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([f"{memory}/tree", "--output", str(out), "--shard-size", "20000",
                 "--frame-size", "4000", "--read-ahead", "4", "--read-ahead-bytes", "1MB",
                 "--storage-options", "{}", "--quiet"]) == 0
    same_output(out, reference([str(www / "tree")]))
    assert main([str(www / "tree"), "--output", str(tmp_path / "bar")]) == 0
    assert " files" in capsys.readouterr().err  # a tree's progress counts files


def test_cli_passes_storage_options_to_s3(www, s3, reference, tmp_path):
    base, options = s3
    out = tmp_path / "out"
    assert main([f"{base}/tree/", "--output", str(out), "--shard-size", "20000",
                 "--frame-size", "4000", "--storage-options", json.dumps(options),
                 "--quiet"]) == 0
    same_output(out, reference([str(www / "tree")]))
    manifest = (out / MANIFEST_NAME).read_text()
    assert options["key"] not in manifest and "endpoint_url" not in manifest  # not recorded


def test_cli_refuses_bad_storage_options_and_missing_urls(memory, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main([f"{memory}/tree", "--output", str(tmp_path / "a"), "--storage-options", "[1]"])
    assert exited.value.code == 2
    assert "JSON object" in capsys.readouterr().err
    assert main([f"{memory}/missing", "--output", str(tmp_path / "b"), "--quiet"]) == 2
    assert "memory://" in capsys.readouterr().err


def test_bad_read_ahead_fails_early_naming_it(www, tmp_path):
    with pytest.raises(ValueError, match="read_ahead must be"):
        convert([www / "tree"], tmp_path / "a", read_ahead=-1)
    with pytest.raises(ValueError, match="read_ahead_bytes must be"):
        convert([www / "tree"], tmp_path / "b", read_ahead_bytes=-5)


def test_inputs_counts_files_without_a_request_per_file(www, memory):
    files, size = Inputs([f"{memory}/tree"]).totals()
    local_files, local_size = Inputs([www / "tree"]).totals()
    assert files == local_files > 240
    assert local_size is None  # unknown without a stat per file
    assert size == sum(os.path.getsize(leaf.path) for leaf in Inputs([www / "tree"]).leaves())


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_resume_whose_file_is_gone_goes_on_with_the_next(tmp_path, where):
    """Resuming at a file deleted since: the next file in the walk's order, local or remote."""
    tree = tmp_path / "tree"
    for name in ("1.json", "2.json", "3.json", "10.json"):
        (tree / "d").mkdir(parents=True, exist_ok=True)
        (tree / "d" / name).write_text(json.dumps({"name": name}))
    source = str(tree)
    if where == "memory":
        fs = fsspec.filesystem("memory")
        source = f"memory://{MEMORY_ROOT}-gone/tree"
        for path in tree.rglob("*.json"):
            fs.pipe(f"{MEMORY_ROOT}-gone/tree/d/{path.name}", path.read_bytes())
    try:
        inputs = Inputs([source])
        assert [orjson.loads(r.data)["name"] for r in inputs.records()] == [
            "1.json", "2.json", "3.json", "10.json"]
        start = sources.Position(0, ("d", "3.json"), 0, 1)
        if where == "memory":
            fs.rm(f"{MEMORY_ROOT}-gone/tree/d/3.json")
        else:
            (tree / "d" / "3.json").unlink()
        rest = [orjson.loads(r.data)["name"] for r in Inputs([source]).records(start)]
        assert rest == ["10.json"]
    finally:
        if where == "memory":
            fs.rm(f"{MEMORY_ROOT}-gone", recursive=True)


def test_a_url_without_its_library_or_credentials_says_what_to_do(memory, monkeypatch, tmp_path,
                                                                  capsys):
    def no_library(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("HTTPFileSystem requires 'aiohttp' to be installed")

    with monkeypatch.context() as patch:
        patch.setattr(sources, "url_to_fs", no_library)
        with pytest.raises(ImportError, match=r"streamds\[remote\]"):
            Inputs(["https://example.invalid/tree/"])

    def no_credentials(*args: Any) -> Any:
        raise RuntimeError("Unable to locate credentials")  # botocore's is no OSError

    monkeypatch.setattr(sources, "remote_tree", no_credentials)
    assert main([f"{memory}/tree", "--output", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot be listed" in err and "credentials" in err and f"{memory}/tree" in err
