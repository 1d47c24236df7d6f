"""`streamds.storage.readahead`: a closed read-ahead stops its work. Against a loopback HTTP
server that logs every request: after `close`, no piece queued behind the one in progress is
requested, and the fetch in progress is not retried."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from streamds import StreamingJsonl
from streamds.retry import RetryPolicy
from streamds.storage.readahead import ReadAhead
from testbed.http import Request, serve

pytest.importorskip("aiohttp", reason="HTTP needs the 'remote' extra (aiohttp)")

WAIT = 30.0  # seconds a thread or request may take (a bound for a hung test, not a pacing sleep)
QUICK_RETRIES = RetryPolicy(backoff=0.01, max_backoff=0.01, jitter=0, give_up_after=600)


def _lines(count: int, width: int) -> bytes:
    return b"".join(b'{"id": %d, "text": "%s"}\n' % (i, b"x" * width) for i in range(count))


def _new_readahead_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate()
            if thread not in before and thread.name.startswith("streamds-readahead")]


def test_a_closed_readahead_neither_retries_nor_starts_fetches(tmp_path: Path) -> None:
    ok = _lines(20, 30)  # one small piece, read by the reader before it closes
    (tmp_path / "ok.jsonl").write_bytes(ok)
    (tmp_path / "bad.jsonl").write_bytes(_lines(10_000, 100))  # ~1 MiB: several pieces
    with serve(tmp_path) as server:
        ds = StreamingJsonl([f"{server.url}/ok.jsonl", f"{server.url}/bad.jsonl"])
        first, second = sorted(ds.shards, key=lambda shard: not shard.url.endswith("ok.jsonl"))
        assert first.ranged and second.ranged and second.size > 1 << 20
        server.faults.status_for["/bad.jsonl"] = 503  # fails, and is retried, until closed
        server.reset_log()
        before = set(threading.enumerate())
        # one thread: the first piece of bad.jsonl in progress, the ones after it queued
        ahead = ReadAhead([(first, 0, first.size), (second, 0, second.size)],
                          budget=1 << 20, retry=QUICK_RETRIES, threads=1)
        try:
            assert ahead.take(first, 0) == (0, ok)

            def bad(log: list[Request]) -> list[Request]:
                return [request for request in log if request.path == "/bad.jsonl"]

            server.wait_for(lambda log: len(bad(log)) >= 3, WAIT)  # failed, retried twice
        finally:
            ahead.close()
        at_close = len(bad(server.log))
        for thread in _new_readahead_threads(before):
            thread.join(WAIT)
            assert not thread.is_alive(), f"{thread.name} still works after close"
        requested = bad(server.log)
        assert len(requested) <= at_close + 1  # the request in flight at close, if any
        assert {request.range for request in requested} == {requested[0].range}, (
            "a piece queued behind the one in progress was fetched after close")
