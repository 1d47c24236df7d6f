"""Streaming over HTTP from a real server on 127.0.0.1 that honours Range requests."""

from __future__ import annotations

import functools
import http.server
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from torch.utils.data import DataLoader

from streamds import StreamingJsonl
from streamds.formats.seekable import SeekableWriter

pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")

RECORDS = [{"id": i, "text": "word " * (i % 40)} for i in range(4000)]


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single-range `Range: bytes=a-b` support, as object stores serve."""

    ranges_served = 0

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def send_head(self):
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = Path(self.translate_path(self.path))
        if match is None or not path.is_file():
            return super().send_head()
        size = path.stat().st_size
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
        if start >= size:
            self.send_error(416)
            return None
        handle = path.open("rb")
        handle.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        type(self).ranges_served += 1
        self._remaining = end - start + 1
        return handle

    def copyfile(self, source, outputfile) -> None:
        remaining = getattr(self, "_remaining", None)
        if remaining is None:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(remaining))
        self._remaining = None
        return None


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("www")
    lines = [orjson.dumps(record) + b"\n" for record in RECORDS]
    (root / "big.jsonl").write_bytes(b"".join(lines))
    with (root / "big.jsonl.zst").open("wb") as f, SeekableWriter(f, frame_size=8 << 10) as w:
        w.write_lines(lines)
    handler = functools.partial(RangeHandler, directory=os.fspath(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        thread.join()


def _ids(ds, num_workers: int) -> list[int]:
    loader = DataLoader(ds, batch_size=64, num_workers=num_workers, collate_fn=list)
    return [record["id"] for batch in loader for record in batch]


@pytest.mark.parametrize("name", ["big.jsonl", "big.jsonl.zst"])
def test_http_file_streams_in_order_with_one_reader(served, name):
    base, _ = served
    ds = StreamingJsonl(f"{base}/{name}", block_size=64 << 10)
    assert [record["id"] for record in ds] == [record["id"] for record in RECORDS]


@pytest.mark.parametrize("name", ["big.jsonl", "big.jsonl.zst"])
def test_http_file_splits_across_workers_exactly_once(served, name):
    base, _ = served
    ds = StreamingJsonl(f"{base}/{name}", block_size=64 << 10)
    assert len(ds.shards[0].frames or ()) > 1 or name == "big.jsonl"
    before = RangeHandler.ranges_served
    ids = _ids(ds, num_workers=2)
    assert sorted(ids) == list(range(len(RECORDS)))
    assert RangeHandler.ranges_served > before  # really read by ranges, not one download


def test_http_list_of_urls_matches_local_reading(served):
    base, root = served
    remote = StreamingJsonl([f"{base}/big.jsonl", f"{base}/big.jsonl.zst"], shuffle=True, seed=3)
    local = StreamingJsonl([root / "big.jsonl", root / "big.jsonl.zst"], shuffle=True, seed=3)
    assert [r["id"] for r in remote] == [r["id"] for r in local]


def test_http_missing_file_names_the_url(served):
    base, _ = served
    with pytest.raises(FileNotFoundError, match=r"nothere\.jsonl"):
        StreamingJsonl(f"{base}/nothere.jsonl")
