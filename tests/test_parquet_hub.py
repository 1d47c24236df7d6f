"""`hf://datasets/OWNER/NAME/PATH` sources through huggingface_hub's HfFileSystem, against a
loopback server standing in for the Hub's few endpoints: the repository's info, the tree
listing, paths-info, and ranged reads of files (``/resolve/``). Nothing leaves 127.0.0.1.

What is checked: a Hub-layout Parquet folder reads exactly once under 2 workers x 3 ranks and
resumes exactly; reads are ranged (never the whole file for a row group); the token reaches
the server and never a message, a repr, a log record or a state.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, unquote, urlparse

import corpus
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from resume_contract import ids, run_test_save_load_state
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import Storage, StreamingJsonl

TOKEN = "hf_" + "Zx9" * 12  # what a user's token looks like; never to appear in text
REPO = "ccdv/pubmed-like"
SHA = "a" * 40


def parquet_bytes(start: int, count: int, group: int) -> bytes:
    sink = io.BytesIO()
    rows = range(start, start + count)
    pq.write_table(pa.table({"id": list(rows), "article": [f"article {i} " * 3 for i in rows],
                             "abstract": [f"abstract {i}" for i in rows]}),
                   sink, row_group_size=group)
    return sink.getvalue()


class Server(ThreadingHTTPServer):
    # the listen queue of socketserver's default (5) overflows when the read-ahead and the
    # shard cache's copier connect at once on a busy machine, refusing connections
    request_queue_size = 128


class Hub(BaseHTTPRequestHandler):
    """The Hub's endpoints HfFileSystem calls, over `files` (path in repo -> bytes)."""

    files: ClassVar[dict[str, bytes]] = {}
    seen: ClassVar[list[tuple[str, str, str | None, str | None]]] = []  # method, path, range, auth

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _entry(self, path: str) -> dict[str, Any]:
        if path in self.files:
            data = self.files[path]
            return {"type": "file", "path": path, "size": len(data),
                    "oid": hashlib.sha1(data).hexdigest()}
        return {"type": "directory", "path": path, "size": 0, "oid": "d" * 40}

    def _children(self, folder: str, recursive: bool) -> list[dict[str, Any]]:
        prefix = f"{folder}/" if folder else ""
        found: dict[str, dict[str, Any]] = {}
        for path in sorted(self.files):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            for depth in range(1, len(parts) + 1 if recursive else 2):
                name = prefix + "/".join(parts[:depth])
                found[name] = self._entry(name)
        return list(found.values())

    def _json(self, value: Any) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        self.seen.append((self.command, path, self.headers.get("Range"),
                          self.headers.get("Authorization")))
        api = f"/api/datasets/{REPO}"
        if path in (api, f"{api}/revision/main"):
            self._json({"id": REPO, "sha": SHA, "private": False,
                        "siblings": [{"rfilename": name} for name in sorted(self.files)]})
            return
        tree = re.fullmatch(rf"{api}/tree/[^/]+/?(.*)", path)
        if tree:
            folder = tree.group(1).strip("/")
            recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
            self._json(self._children(folder, recursive))
            return
        resolve = re.fullmatch(rf"/datasets/{REPO}/resolve/[^/]+/(.+)", path)
        if resolve and resolve.group(1) in self.files:
            data = self.files[resolve.group(1)]
            headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": SHA,
                       "Accept-Ranges": "bytes"}
            ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
            if ranged:
                first = int(ranged.group(1))
                last = int(ranged.group(2)) if ranged.group(2) else len(data) - 1
                last = min(last, len(data) - 1)
                headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
                self._send(206, data[first:last + 1], headers)
            else:
                self._send(200, data, headers)
            return
        self._send(404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"})

    def do_POST(self) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        self.seen.append((self.command, path, None, self.headers.get("Authorization")))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        if re.fullmatch(rf"/api/datasets/{REPO}/paths-info/[^/]+", path):
            asked = parse_qs(body).get("paths", [])
            self._json([self._entry(name) for name in asked
                        if name in self.files or any(f.startswith(name + "/")
                                                     for f in self.files)])
            return
        self._send(404, b'{"error": "not found"}')


@pytest.fixture(scope="module")
def hub():
    files = {"README.md": b"# a card\n"}
    start = 0
    for number, (rows, group) in enumerate([(300, 100), (250, 250), (90, 30)]):
        files[f"document/train-{number:05d}-of-00003.parquet"] = parquet_bytes(start, rows,
                                                                               group)
        start += rows
    Hub.files = files
    server = Server(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", list(range(start))
    server.shutdown()
    server.server_close()


def hub_dataset(endpoint: str, **options: Any) -> StreamingJsonl:
    storage = Storage(options={"endpoint": endpoint, "token": TOKEN})
    return StreamingJsonl(f"hf://datasets/{REPO}/document", storage=storage,
                          columns=["id", "abstract"], **options)


def test_a_hub_parquet_folder_reads_exactly_once_with_two_workers_and_three_ranks(hub):
    endpoint, expected = hub
    Hub.seen.clear()
    out = []
    for rank in range(3):
        out += corpus.read_all(hub_dataset(endpoint, rank=rank, world_size=3, shuffle=True),
                               2)
    assert sorted(ids(out)) == expected
    assert set(out[0]) == {"id", "abstract"}
    reads = [seen for seen in Hub.seen if "/resolve/" in seen[1] and seen[0] == "GET"]
    assert reads and all(seen[2] is not None for seen in reads)  # ranged, never whole files
    assert all(seen[3] == f"Bearer {TOKEN}" for seen in Hub.seen)  # the token reached it


def test_hub_order_and_len(hub):
    endpoint, expected = hub
    ds = hub_dataset(endpoint)
    assert len(ds) == len(expected)
    assert ids(list(ds)) == expected


def test_hub_exact_resume_after_any_batch(hub):
    endpoint, _ = hub

    def make():
        return StatefulDataLoader(hub_dataset(endpoint, shuffle=True, seed=3, buffer_size=40),
                                  batch_size=16, num_workers=2, collate_fn=ids)

    run_test_save_load_state(make, [0, 7, 30])


def test_the_token_is_never_shown(hub, caplog):
    endpoint, _ = hub
    with caplog.at_level(logging.DEBUG):
        ds = hub_dataset(endpoint)
        iterator = iter(ds)
        next(iterator)
        state = ds.state_dict()
        iterator.close()  # its read-ahead stops now, not after the server has gone
        with pytest.raises(FileNotFoundError) as missing:
            StreamingJsonl(f"hf://datasets/{REPO}/nothing-here",
                           storage=Storage(options={"endpoint": endpoint, "token": TOKEN}))
    texts = [repr(ds), str(pickle.dumps(state)), caplog.text, str(missing.value),
             repr(missing.value.__cause__), repr(ds._shards)]
    assert all(TOKEN not in text for text in texts)


def test_a_hub_token_is_masked_in_any_text():
    from streamds.redact import redact

    shown = redact(f"401 for https://127.0.0.1/api (Authorization: Bearer {TOKEN})")
    assert TOKEN not in shown and "hf_***" in shown


def test_without_huggingface_hub_the_error_names_the_extra(monkeypatch):
    def no_hub(url: str, **options: Any):  # what fsspec raises without huggingface_hub
        raise ImportError("Install huggingface_hub to access HfFileSystem")

    monkeypatch.setattr("streamds.storage.shards.url_to_fs", no_hub)
    with pytest.raises(ImportError, match=r"pip install 'streamds\[hub\]'"):
        StreamingJsonl(f"hf://datasets/{REPO}/document")


def test_hub_files_are_read_once_through_the_shard_cache(hub, tmp_path):
    endpoint, expected = hub
    storage = Storage(options={"endpoint": endpoint, "token": TOKEN}, cache_dir=tmp_path)
    ds = StreamingJsonl(f"hf://datasets/{REPO}/document", storage=storage, columns=["id"])
    assert ids(list(ds)) == expected
    # what the first epoch left in flight ends first: the copies (the columns not read,
    # fetched by the copier) and the read-ahead's fetches (a request retried by
    # huggingface_hub's backoff would land in the second epoch's record)
    for thread in threading.enumerate():
        if thread.name in ("streamds-cache", "streamds-readahead"):
            thread.join(timeout=60)
            assert not thread.is_alive(), f"{thread.name} still runs after its epoch"
    Hub.seen.clear()
    assert ids(list(ds)) == expected  # the second epoch: from the local copies
    assert not [seen for seen in Hub.seen if "/resolve/" in seen[1] and seen[0] == "GET"]
