"""A threaded HTTP server on 127.0.0.1 serving a folder as an object store does, with faults.

Files answer single-range GETs (`Range: bytes=a-b`, `a-`, `-n`) with 206 and Content-Range,
HEAD with Content-Length; both with an ETag (of the file's size and modification time) and a
Last-Modified, as object stores and web servers send them; folders answer the plain HTML
listing that fsspec's HTTPFileSystem parses. Connections are HTTP/1.1 keep-alive, as
aiohttp's are against a real store.

Faults are read from `server.faults` on every request, so a test may change them (or replace
the object) while the server runs:

    with serve(root, Faults(fail_every=20)) as server:
        ds = StreamingJsonl(f"{server.url}/part-0.jsonl.zst")
        server.faults.latency = 0.05
        ...
        ranged = [r for r in server.log if r.range is not None]

The `*_every` faults count ranged GETs only (listings and HEADs do not shift them), in one
counter shared by all three; when several match the same request, fail beats throttle beats drop.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NamedTuple
from urllib.parse import unquote, urlsplit

__all__ = ["Faults", "RangeServer", "Request", "serve"]

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass
class Faults:
    """What the server does wrong; every field is read afresh for each request."""

    latency: float = 0.0  # seconds slept before every response
    bandwidth: float | None = None  # bytes/s per response body, None: as fast as possible
    fail_every: int = 0  # every Nth ranged GET answers 503
    throttle_every: int = 0  # every Nth ranged GET answers 429
    drop_every: int = 0  # every Nth ranged GET sends headers and half the body, then hangs up
    status_for: dict[str, int] = field(default_factory=dict)  # URL path -> forced status
    ignore_range: bool = False  # answer ranged GETs with 200 and the whole file
    validators: tuple[str, ...] = ("ETag", "Last-Modified")  # the ones files are sent with


class Request(NamedTuple):
    """One answered request: method, URL path, the Range header (or None), status sent."""

    method: str
    path: str
    range: str | None
    status: int


class _Server(http.server.ThreadingHTTPServer):
    """The socket server; holds the fault settings, the log and the ranged-GET counter."""

    daemon_threads = True
    request_queue_size = 128  # many clients connect at once (read-ahead threads, workers)

    def __init__(self, root: Path, faults: Faults) -> None:
        handler = functools.partial(_Handler, directory=os.fspath(root))
        super().__init__(("127.0.0.1", 0), handler)
        self.faults = faults
        self.lock = threading.Lock()
        self.logged = threading.Condition(self.lock)  # notified at each request recorded
        self.requests: list[Request] = []
        self.ranged_gets = 0

    def record(self, request: Request) -> None:
        with self.lock:
            self.requests.append(request)
            self.logged.notify_all()

    def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        """A client that hangs up mid-body (a probe that reads only the status) is normal."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def count_ranged_get(self) -> int:
        with self.lock:
            self.ranged_gets += 1
            return self.ranged_gets


class _Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body leave in separate writes: no 40 ms stalls
    timeout = 60  # an idle keep-alive connection frees its thread after this long
    server: _Server

    def log_message(self, fmt: str, *args: object) -> None:
        pass  # keep test output clean; `server.log` has every request

    def send_response(self, code: int, message: str | None = None) -> None:
        headers = getattr(self, "headers", None)
        self.server.record(Request(
            self.command or "", self._url_path(), headers.get("Range") if headers else None,
            int(code),
        ))
        super().send_response(code, message)

    def _url_path(self) -> str:
        return unquote(urlsplit(self.path or "").path)

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _answer(self, *, head: bool) -> None:
        faults = self.server.faults
        if faults.latency > 0:
            time.sleep(faults.latency)  # the simulated round trip, in the server's thread
        forced = faults.status_for.get(self._url_path())
        if forced is not None:
            self.send_error(forced)
            return
        ranged = not head and self.headers.get("Range") is not None
        drop = False
        if ranged:
            n = self.server.count_ranged_get()
            if _nth(n, faults.fail_every):
                self.send_error(503, "Slow Down")
                return
            if _nth(n, faults.throttle_every):
                self.send_error(429, "Too Many Requests")
                return
            drop = _nth(n, faults.drop_every)
        body = self.send_head()
        if body is None:
            return
        with body:
            if not head:
                length = self._body_length
                self._send_body(body, length // 2 if drop else length, faults.bandwidth)
        if drop:
            self.close_connection = True  # hang up mid-body, as a reset connection does

    def send_head(self) -> BinaryIO | None:
        """Headers for a file (whole or one range) or a listing; returns the body to send."""
        path = Path(self.translate_path(self.path))
        header = self.headers.get("Range")
        if not path.is_file():
            listing = super().send_head()  # a folder's listing, a redirect to "dir/", or 404
            self._body_length = _length(listing)
            return listing
        stat = path.stat()
        size = stat.st_size
        if self.server.faults.ignore_range:
            header = None  # as a server without range support: the whole file, 200
        span = _span(header, size) if header is not None else (0, size - 1)
        if span is None:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        start, end = span
        handle = path.open("rb")
        handle.seek(start)
        self.send_response(206 if header is not None else 200)
        self.send_header("Content-Type", "application/octet-stream")
        if header is not None:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        if not self.server.faults.ignore_range:
            self.send_header("Accept-Ranges", "bytes")
        validators = self.server.faults.validators
        if "ETag" in validators:
            self.send_header("ETag", f'"{stat.st_mtime_ns:x}-{size:x}"')
        if "Last-Modified" in validators:
            self.send_header("Last-Modified", self.date_time_string(int(stat.st_mtime)))
        self.end_headers()
        self._body_length = end - start + 1
        return handle

    def _send_body(self, body: BinaryIO, length: int, bandwidth: float | None) -> None:
        """Copy `length` bytes of `body`; under a bandwidth cap, each slice leaves on schedule."""
        if bandwidth is None:
            piece_size = 256 << 10
        else:  # ~100 slices a second, 1-64 KiB each
            piece_size = max(1 << 10, min(64 << 10, int(bandwidth / 100)))
        began = time.monotonic()
        sent = 0
        while sent < length:
            piece = body.read(min(piece_size, length - sent))
            if not piece:
                break
            if bandwidth is not None:
                pause = began + (sent + len(piece)) / bandwidth - time.monotonic()
                if pause > 0:
                    time.sleep(pause)  # the simulated link speed
            self.wfile.write(piece)
            sent += len(piece)


def _nth(n: int, every: int) -> bool:
    return every > 0 and n % every == 0


def _length(body: BinaryIO | None) -> int:
    """Bytes left in a listing or file body (what SimpleHTTPRequestHandler would copy)."""
    if body is None:
        return 0
    here = body.tell()
    end = body.seek(0, os.SEEK_END)
    body.seek(here)
    return end - here


def _span(header: str, size: int) -> tuple[int, int] | None:
    """The inclusive byte span a single-range header asks for, or None when unsatisfiable."""
    match = _RANGE.fullmatch(header.strip())
    if match is None or match.group(0) == "bytes=-":
        return None
    first, last = match.groups()
    if not first:  # suffix range: the last `last` bytes
        count = int(last)
        return (max(0, size - count), size - 1) if count > 0 and size > 0 else None
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or end < start:
        return None
    return start, end


class RangeServer:
    """A running server: `url` ("http://127.0.0.1:PORT"), `faults` (read per request), `log`."""

    def __init__(self, root: Path, faults: Faults | None = None) -> None:
        self._server = _Server(root, faults if faults is not None else Faults())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"RangeServer {self.url}", daemon=True
        )

    @property
    def faults(self) -> Faults:
        return self._server.faults

    @faults.setter
    def faults(self, faults: Faults) -> None:
        self._server.faults = faults

    @property
    def log(self) -> list[Request]:
        """Every answered request so far, oldest first (a snapshot: safe to read while serving)."""
        with self._server.lock:
            return list(self._server.requests)

    def wait_for(self, done: Callable[[list[Request]], bool], timeout: float) -> list[Request]:
        """The log once `done(log)` holds, checked at each request (no polling); raises
        TimeoutError when it does not within `timeout` seconds."""
        with self._server.logged:
            if not self._server.logged.wait_for(lambda: done(self._server.requests), timeout):
                raise TimeoutError(f"the server's log did not reach the state asked for in "
                                   f"{timeout}s: {self._server.requests}")
            return list(self._server.requests)

    def reset_log(self) -> None:
        """Forget the requests so far and restart the count the `*_every` faults use."""
        with self._server.lock:
            self._server.requests.clear()
            self._server.ranged_gets = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@contextmanager
def serve(root: Path, faults: Faults | None = None) -> Iterator[RangeServer]:
    """Serve the folder `root` on 127.0.0.1 (a free port) while the block runs."""
    server = RangeServer(Path(root), faults)
    server.start()
    try:
        yield server
    finally:
        server.stop()
