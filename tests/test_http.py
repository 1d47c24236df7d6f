"""Streaming over HTTP from a real server on 127.0.0.1 that honours Range requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from torch.utils.data import DataLoader, get_worker_info

from streamds import Storage, StreamingJsonl
from streamds.formats.seekable import SeekableWriter
from testbed.http import RangeServer, serve

pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")

RECORDS = [{"id": i, "text": "word " * (i % 40)} for i in range(4000)]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[RangeServer, Path]]:
    root = tmp_path_factory.mktemp("www")
    lines = [orjson.dumps(record) + b"\n" for record in RECORDS]
    (root / "big.jsonl").write_bytes(b"".join(lines))
    with (root / "big.jsonl.zst").open("wb") as f, SeekableWriter(f, frame_size=8 << 10) as w:
        w.write_lines(lines)
    with serve(root) as server:
        yield server, root


@pytest.mark.parametrize("name", ["big.jsonl", "big.jsonl.zst"])
def test_http_file_streams_in_order_with_one_reader(served, name):
    server, _ = served
    ds = StreamingJsonl(f"{server.url}/{name}", storage=Storage(block_size=64 << 10))
    assert [record["id"] for record in ds] == [record["id"] for record in RECORDS]


def with_worker(record: dict) -> dict:
    """The record and the DataLoader worker that read it."""
    info = get_worker_info()
    return {**record, "worker": None if info is None else info.id}


@pytest.mark.parametrize("name", ["big.jsonl", "big.jsonl.zst"])
def test_http_file_splits_across_workers_exactly_once(served, name):
    server, _ = served
    ds = StreamingJsonl(f"{server.url}/{name}",
                        storage=Storage(block_size=64 << 10)).map(with_worker)
    assert len(ds.shards[0].frames or ()) > 1 or name == "big.jsonl"
    server.reset_log()
    loader = DataLoader(ds, batch_size=64, num_workers=2, collate_fn=list)
    by_worker: dict[int, set[int]] = {0: set(), 1: set()}
    count = 0
    for batch in loader:
        for record in batch:
            by_worker[record["worker"]].add(record["id"])
            count += 1
    # each worker read its own non-empty part; together the parts are the corpus, once
    assert by_worker[0] and by_worker[1], {w: len(ids) for w, ids in by_worker.items()}
    assert not by_worker[0] & by_worker[1]
    assert by_worker[0] | by_worker[1] == set(range(len(RECORDS)))
    assert count == len(RECORDS)
    assert any(r.status == 206 for r in server.log)  # really read by ranges, not one download


def test_http_list_of_urls_matches_local_reading(served):
    server, root = served
    base = server.url
    remote = StreamingJsonl([f"{base}/big.jsonl", f"{base}/big.jsonl.zst"], shuffle=True, seed=3)
    local = StreamingJsonl([root / "big.jsonl", root / "big.jsonl.zst"], shuffle=True, seed=3)
    assert [r["id"] for r in remote] == [r["id"] for r in local]


def test_http_missing_file_names_the_url(served):
    server, _ = served
    with pytest.raises(FileNotFoundError, match=r"nothere\.jsonl"):
        StreamingJsonl(f"{server.url}/nothere.jsonl")


def test_http_folder_url_and_nested_glob_read_the_folders_files(tmp_path):
    """A folder's URL is its listing page to HTTP, and a glob keeps the URL's "//": both name
    the record files below, by the rule local folders and the converter use."""
    for part in ("a", "b"):
        (tmp_path / "t" / part).mkdir(parents=True)
        (tmp_path / "t" / part / "x.jsonl").write_bytes(
            b"".join(orjson.dumps({"id": f"{part}{i}"}) + b"\n" for i in range(3)))
    expected = [f"{part}{i}" for part in ("a", "b") for i in range(3)]
    with serve(tmp_path) as server:
        for source in (f"{server.url}/t/", f"{server.url}/t/*/*.jsonl"):
            assert [r["id"] for r in StreamingJsonl(source)] == expected, source


def test_a_folder_shared_with_python_http_server_reads_exactly_once(served):
    """The standard library's server (`python -m http.server`) ignores Range: each file is
    read as one stream by one reader, every record once, with workers too."""
    import functools
    import http.server
    import threading

    _, root = served

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            pass  # the probe hangs up after the status line: the stdlib prints BrokenPipe

    handler = functools.partial(Quiet, directory=str(root))
    with Server(("127.0.0.1", 0), handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{httpd.server_address[1]}"
            sources = [f"{url}/big.jsonl", f"{url}/big.jsonl.zst"]
            ds = StreamingJsonl(sources, storage=Storage(block_size=64 << 10))
            assert not any(shard.ranged for shard in ds.shards)
            assert [r["id"] for r in ds] == [r["id"] for r in RECORDS] * 2
            loader = DataLoader(ds, batch_size=64, num_workers=2, collate_fn=list)
            ids = sorted(record["id"] for batch in loader for record in batch)
            assert ids == sorted([r["id"] for r in RECORDS] * 2)
        finally:
            httpd.shutdown()
