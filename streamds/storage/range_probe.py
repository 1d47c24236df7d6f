"""Whether an HTTP server answers byte-range requests: asked once per server, when a source
is resolved.

A server that ignores HTTP Range (`python -m http.server`, the common way to share a folder)
answers a request for part of a file with all of it. Such a file cannot be split into blocks
or read ahead by ranges; it is read as one stream by the one reader that owns it
(`ranges.StreamFile`), which is exact: a resume inside it reads the stream again from the
start and skips to its offset.

The answer is the status of one GET for the first byte of one file of the server: 206 (or
416, an empty file) means ranges, 200 means the whole file (its body is not read: the
connection is closed at once). Other filesystems (local, object stores, the Hub) always serve
ranges and are not asked; a failure to ask answers "ranges", and the reads report what is
wrong.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec.asyn import sync

from ..redact import describe_error, redact

__all__ = ["RangeAnswers"]

log = logging.getLogger(__name__)


def _is_http(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool({"http", "https"} & protocols)


async def _first_byte_status(fs: Any, url: str) -> int:
    """The status of a GET for byte 0 of `url`, with the filesystem's own request options."""
    session = await fs.set_session()
    options = dict(fs.kwargs)
    headers = {**(options.pop("headers", None) or {}), "Range": "bytes=0-0"}
    response = await session.get(fs.encode_url(url), headers=headers, **options)
    try:
        return response.status
    finally:
        response.close()  # a whole file's body is never read


class RangeAnswers:
    """Whether each server of a source honours Range, asked once per scheme and host."""

    def __init__(self) -> None:
        self._known: dict[str, bool] = {}

    def honours_range(self, fs: fsspec.AbstractFileSystem, path: str) -> bool:
        """Whether `fs` serves parts of `path`'s file (True for anything but HTTP)."""
        if not _is_http(fs):
            return True
        parts = urlsplit(path)
        server = f"{parts.scheme}://{parts.hostname}:{parts.port}"
        if server not in self._known:
            self._known[server] = self._ask(fs, path)
        return self._known[server]

    @staticmethod
    def _ask(fs: Any, path: str) -> bool:
        try:
            status = sync(fs.loop, _first_byte_status, fs, path)
        except Exception as err:  # the reads will say what is wrong
            log.debug("%s: could not ask whether the server honours Range: %s", redact(path),
                      describe_error(err))
            return True
        if status == 200:
            log.info("%s: the server ignores HTTP Range requests: each of its files is read "
                     "as one stream by one reader, not split across workers and ranks",
                     redact(path))
        return status != 200
