"""Remote failures say what happened, for the reader and the converter alike: an HTTP 403, a
refused connection, a storage option the filesystem does not take and a server that ignores
Range each get their own error naming the URL (credentials redacted) and the fix, never
"does not exist"; and a cached copy is never served once the server says the file changed.

Everything runs against the loopback server of `testbed.http`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from streamds import Storage, StreamingJsonl
from streamds.formats.seekable import SeekableWriter
from streamds.preprocess.convert import convert
from streamds.retry import RangeNotSupportedError, RetryPolicy, UnreachableError
from testbed.http import Faults, RangeServer, serve

pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")

PASSWORD = "PWsecret9"
RECORDS = [{"id": i, "text": "word " * (i % 30)} for i in range(3000)]
LINES = [orjson.dumps(record) + b"\n" for record in RECORDS]
FAST = RetryPolicy(attempts=2, backoff=0.001, jitter=0.0)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("www")
    (root / "a.jsonl").write_bytes(b"".join(LINES))
    with (root / "s.jsonl.zst").open("wb") as f, SeekableWriter(f, frame_size=8 << 10) as w:
        w.write_lines(LINES)  # a seekable .zst: its seek table is read from the file's end
    import zstandard

    (root / "f.jsonl.zst").write_bytes(zstandard.compress(b"".join(LINES)))  # a foreign .zst
    return root


@pytest.fixture
def server(root) -> Iterator[RangeServer]:
    with serve(root) as server:
        yield server


def with_password(url: str) -> str:
    return url.replace("http://", f"http://reader:{PASSWORD}@")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read(source: str, **storage) -> list[dict]:
    """The records of `source`; `storage`: `Storage` settings beside the quick retry."""
    return list(StreamingJsonl(source, storage=Storage(retry=FAST, **storage)))


def convert_into(tmp_path: Path, source: str, **options) -> None:
    convert([source], tmp_path / "out", progress=None, retry=FAST, **options)


OPENERS = {"reader": lambda tmp_path, url, storage_options=None: read(url,
                                                                      options=storage_options),
           "convert": convert_into}


def _message(err: BaseException) -> str:
    text = str(err)
    assert PASSWORD not in text, text
    return text


@pytest.mark.parametrize("opener", sorted(OPENERS))
def test_http_403_is_access_denied_not_missing(server, tmp_path, opener):
    server.faults.status_for["/a.jsonl"] = 403
    with pytest.raises(PermissionError) as caught:
        OPENERS[opener](tmp_path, with_password(f"{server.url}/a.jsonl"))
    text = _message(caught.value)
    assert "a.jsonl" in text and "403" in text and "access denied" in text
    assert "does not exist" not in text


def test_a_file_refused_inside_a_listed_folder_is_named_with_the_reason(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "d" / name).write_bytes(b"".join(LINES[:5]))
    with serve(tmp_path) as server:
        server.faults.status_for["/d/b.jsonl"] = 403
        with pytest.raises(PermissionError) as caught:
            read(with_password(f"{server.url}/d/"))
    text = _message(caught.value)
    assert "b.jsonl" in text and "403" in text and "access denied" in text


@pytest.mark.parametrize("opener", sorted(OPENERS))
def test_a_refused_connection_says_it_could_not_connect(tmp_path, opener):
    url = with_password(f"http://127.0.0.1:{free_port()}/a.jsonl")
    with pytest.raises(UnreachableError) as caught:
        OPENERS[opener](tmp_path, url)
    text = _message(caught.value)
    assert "could not connect" in text and "a.jsonl" in text and "does not exist" not in text


@pytest.mark.parametrize("opener", sorted(OPENERS))
def test_an_unknown_storage_option_is_named(server, tmp_path, opener):
    with pytest.raises(TypeError) as caught:
        OPENERS[opener](tmp_path, with_password(f"{server.url}/a.jsonl"),
                        storage_options={"bogus_option": "VALUEsecret"})
    text = _message(caught.value)
    assert "bogus_option" in text and "storage_options" in text
    assert "VALUEsecret" not in text and "does not exist" not in text


@pytest.mark.parametrize("source", ["a.jsonl", ""])
def test_a_listing_that_fails_follows_the_retry_policy(server, source):
    """A source answering 500 is retried as `Storage(retry=...)` says (2 attempts here), not
    for the default 5 minutes."""
    from streamds.retry import GaveUpError

    server.faults.status_for[f"/{source}"] = 500
    with pytest.raises(GaveUpError, match="failed 2 times") as caught:
        StreamingJsonl(with_password(f"{server.url}/{source}"), storage=Storage(retry=FAST))
    _message(caught.value)
    looks = [r for r in server.log if r.path == f"/{source}"]  # fsspec: a HEAD, then a GET
    assert 0 < len(looks) <= 2 * FAST.attempts


@pytest.mark.parametrize("opener", sorted(OPENERS))
@pytest.mark.parametrize("options", [{"headers": "Authorization: Bearer HDRsecret"},
                                     {"client_kwargs": {"headers": "HDRsecret"}}])
def test_headers_given_as_a_string_are_refused_naming_the_option(server, tmp_path, opener,
                                                                 options):
    with pytest.raises(TypeError, match=r"\['headers'\] must be a dict.*'Authorization'"
                       ) as caught:
        OPENERS[opener](tmp_path, f"{server.url}/a.jsonl", storage_options=options)
    text = str(caught.value)
    assert "HDRsecret" not in text and "does not exist" not in text


@pytest.mark.parametrize("opener", sorted(OPENERS))
def test_a_missing_file_still_does_not_exist(server, tmp_path, opener):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*does not exist") as caught:
        OPENERS[opener](tmp_path, with_password(f"{server.url}/nope.jsonl"))
    _message(caught.value)


NO_RANGE_NAMES = ["s.jsonl.zst", "f.jsonl.zst", "a.jsonl"]


@pytest.mark.parametrize("name", NO_RANGE_NAMES)
def test_a_server_that_ignores_range_is_read_as_one_stream(server, name):
    """`python -m http.server` answers every ranged GET with the whole file: each file is one
    block, read as one stream (one GET) by the one reader that owns it."""
    server.faults.ignore_range = True
    ds = StreamingJsonl(f"{server.url}/{name}", storage=Storage(retry=FAST, block_size=64 << 10))
    server.reset_log()
    assert list(ds) == RECORDS
    gets = [r for r in server.log if r.method == "GET"]
    assert len(gets) == 1 and gets[0].range is None, gets


@pytest.mark.parametrize("name", NO_RANGE_NAMES)
def test_a_stream_from_a_server_without_range_resumes_exactly(server, name):
    server.faults.ignore_range = True
    storage = Storage(retry=FAST, block_size=64 << 10)
    first = StreamingJsonl(f"{server.url}/{name}", storage=storage)
    records = iter(first)
    head = [next(records) for _ in range(1234)]
    state = first.state_dict()
    again = StreamingJsonl(f"{server.url}/{name}", storage=storage)
    again.load_state_dict(state)
    assert head + list(again) == RECORDS


def test_files_from_a_server_without_range_are_dealt_whole_to_workers(server):
    from torch.utils.data import DataLoader

    server.faults.ignore_range = True
    ds = StreamingJsonl([f"{server.url}/{name}" for name in NO_RANGE_NAMES], shuffle=True,
                        storage=Storage(retry=FAST, block_size=64 << 10))
    server.reset_log()
    loader = DataLoader(ds, batch_size=100, num_workers=2, collate_fn=list)
    ids = sorted(record["id"] for batch in loader for record in batch)
    assert ids == sorted(list(range(len(RECORDS))) * len(NO_RANGE_NAMES))
    assert all(r.range is None for r in server.log if r.method == "GET")


def test_a_split_a_server_without_range_cannot_give_is_refused_naming_the_fix(server):
    """Two ranks with even_ranks='drop' over one file that cannot be split: refused, saying
    that the server ignores Range and what to do."""
    server.faults.ignore_range = True
    ds = StreamingJsonl(f"{server.url}/a.jsonl", rank=1, world_size=2, even_ranks="drop",
                        storage=Storage(retry=FAST, block_size=64 << 10))
    with pytest.raises(ValueError, match=r"ignores HTTP Range.*honours Range"):
        next(iter(ds))


@pytest.mark.parametrize("name", ["s.jsonl.zst", "a.jsonl"])
def test_a_server_that_stops_honouring_range_is_named_with_the_fix(server, name):
    """A server that answered ranges when the dataset was made and ignores them later: the
    blocks were cut by ranges, so the read is refused, naming the fix. (A small foreign .zst
    is read in one request, which such a server answers right.)"""
    ds = StreamingJsonl(with_password(f"{server.url}/{name}"),
                        storage=Storage(retry=FAST, block_size=64 << 10))
    server.faults.ignore_range = True
    with pytest.raises(RangeNotSupportedError) as caught:
        list(ds)
    text = _message(caught.value)
    assert name in text and "ignores HTTP Range" in text and "block_size=0" not in text
    assert "make the dataset again" in text and "download" in text  # the fixes


def test_a_small_file_from_a_server_that_ignores_range_still_reads(tmp_path):
    """One request asks for the whole file: a server without Range answers it right."""
    (tmp_path / "small.jsonl").write_bytes(b"".join(LINES[:20]))
    with serve(tmp_path, Faults(ignore_range=True)) as server:
        assert read(f"{server.url}/small.jsonl") == RECORDS[:20]


# -- the cache and a file changed at the same size ---------------------------------------------


def _wait_for_copies() -> None:
    for thread in threading.enumerate():
        if thread.name == "streamds-cache":
            thread.join()


def _rewrite_same_size(path: Path, records: list[dict]) -> None:
    """New content of exactly the old size, with a later modification time."""
    old = path.stat()
    data = b"".join(orjson.dumps(record) + b"\n" for record in records)
    assert len(data) == old.st_size
    path.write_bytes(data)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns + 5_000_000_000))


def _flipped(records: list[dict]) -> list[dict]:
    """Records of the same encoded size, other values."""
    return [{"id": record["id"], "text": record["text"].replace("word", "WORD")}
            for record in records]


@pytest.mark.parametrize("validators", [("ETag", "Last-Modified"), ("Last-Modified",)])
def test_a_file_changed_at_the_same_size_is_read_anew_not_from_the_cache(tmp_path, validators):
    www = tmp_path / "www"
    www.mkdir()
    (www / "c.jsonl").write_bytes(b"".join(LINES[:500]))
    cache = tmp_path / "cache"
    storage = Storage(cache_dir=cache)
    with serve(www, Faults(validators=validators)) as server:
        url = f"{server.url}/c.jsonl"
        assert list(StreamingJsonl(url, storage=storage)) == RECORDS[:500]
        _wait_for_copies()
        assert len([p for p in cache.rglob("*c.jsonl") if p.is_file()]) == 1  # cached
        assert list(StreamingJsonl(url, storage=storage)) == RECORDS[:500]  # from the copy
        _rewrite_same_size(www / "c.jsonl", _flipped(RECORDS[:500]))
        assert list(StreamingJsonl(url, storage=storage)) == _flipped(RECORDS[:500])


def test_a_server_without_validators_is_not_cached(tmp_path, caplog):
    www = tmp_path / "www"
    www.mkdir()
    (www / "c.jsonl").write_bytes(b"".join(LINES[:500]))
    cache = tmp_path / "cache"
    storage = Storage(cache_dir=cache)
    with serve(www, Faults(validators=())) as server, caplog.at_level(logging.WARNING):
        url = f"{server.url}/c.jsonl"
        assert list(StreamingJsonl(url, storage=storage)) == RECORDS[:500]
        _wait_for_copies()
        _rewrite_same_size(www / "c.jsonl", _flipped(RECORDS[:500]))
        assert list(StreamingJsonl(url, storage=storage)) == _flipped(RECORDS[:500])
    assert not [p for p in cache.rglob("*") if p.is_file() and p.name.endswith(".jsonl")]
    assert any("not cached" in r.getMessage() and "ETag" in r.getMessage()
               for r in caplog.records)
