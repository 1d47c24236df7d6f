"""Codecs: which decoder a file needs, and a decoded byte stream over a raw file.

The codec comes from the file name (`.zst`, `.gz`, `.bz2`, `.xz`, otherwise plain). Decoders
read the raw file in large blocks. Two error kinds leave this module, so callers can tell them
apart: `TransientReadError` (the storage failed; retry) and `CorruptShardError` (the bytes are
damaged; retrying will not help).
"""

from __future__ import annotations

import importlib
import io
from typing import BinaryIO

from ..errors import CorruptShardError, MissingCodecError
from ..retry import PERMANENT_ERRORS

__all__ = [
    "CODEC_SUFFIXES",
    "READ_SIZE",
    "TransientReadError",
    "codec_of",
    "decode",
    "require_codec",
    "strip_codec",
]

READ_SIZE = 256 << 10  # bytes per read: small enough that a chunk stays in the L2 cache
_MIN_FEED = 1 << 8  # compressed bytes a zstd decoding step takes at least

# suffix -> (codec name, module that decodes it, pip package that provides the module)
CODEC_SUFFIXES: dict[str, tuple[str, str, str]] = {
    ".zst": ("zst", "zstandard", "zstandard"),
    ".zstd": ("zst", "zstandard", "zstandard"),
    ".gz": ("gz", "gzip", "the Python zlib module (rebuild Python with zlib)"),
    ".bz2": ("bz2", "bz2", "the Python bz2 module (rebuild Python with libbz2)"),
    ".xz": ("xz", "lzma", "the Python lzma module (rebuild Python with liblzma)"),
}


class TransientReadError(OSError):
    """The storage under a shard failed mid-read (Drive's Errno 5, a reset connection)."""


def codec_of(name: str) -> str | None:
    """The codec of a file name: "zst", "gz", "bz2", "xz", or None for plain bytes."""
    for suffix, (codec, _, _) in CODEC_SUFFIXES.items():
        if name.endswith(suffix):
            return codec
    return None


def strip_codec(name: str) -> str:
    """`name` without its codec suffix.

    >>> strip_codec("train.jsonl.zst"), strip_codec("a.tar.gz"), strip_codec("b.tgz")
    ('train.jsonl', 'a.tar', 'b.tgz')
    """
    return name.rsplit(".", 1)[0] if codec_of(name) is not None else name


def require_codec(codec: str | None, url: str) -> None:
    """Fail with the package to install when the decoder of `codec` cannot be imported.

    Without this check fsspec would hand compressed bytes to the JSON parser.
    """
    if codec is None:
        return
    for codec_name, module, package in CODEC_SUFFIXES.values():
        if codec_name != codec:
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise MissingCodecError(
                f"{url}: reading .{codec} files needs {package!r}; install it with "
                f"`pip install {package}` or decompress the file first"
            ) from err
        return


class _Stream(io.RawIOBase):
    """A readable stream defined by `read(size)`; gives `readinto` for io.BufferedReader."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _MarkTransient(_Stream):
    """Wraps a raw storage file so its OSErrors surface as `TransientReadError`."""

    def __init__(self, raw: BinaryIO, url: str) -> None:
        self._raw = raw
        self._url = url

    def read(self, size: int = -1) -> bytes:
        try:
            return self._raw.read(size)
        except PERMANENT_ERRORS:
            raise
        except OSError as err:
            raise TransientReadError(f"{self._url}: read failed: {err}") from err

    def close(self) -> None:
        self._raw.close()
        super().close()


class _ZstdFrames(_Stream):
    """Decodes consecutive zstd frames (skippable ones included) and detects truncation.

    `zstandard`'s stream reader returns a short stream for a truncated frame without an error;
    this reader raises `CorruptShardError` instead. Memory stays near READ_SIZE however well
    the data compresses: a step decodes at most to the end of one frame, from as much input as
    gave about READ_SIZE decoded bytes at the last ratio seen (a step that decoded nothing, a
    block still incomplete, keeps the input size: growing it there could swallow thousands of
    highly compressed blocks at once).
    """

    def __init__(self, raw: BinaryIO, url: str, start: int = 0) -> None:
        import zstandard

        self._raw = raw
        self._url = url
        self._dctx = zstandard.ZstdDecompressor()
        self._error = zstandard.ZstdError
        self._frame = self._dctx.decompressobj()
        self._frame_started = False
        self._pending = b""  # decoded bytes, returned from self._pos on
        self._pos = 0
        self._input = b""  # compressed bytes read, decoded up to self._input_pos
        self._input_pos = 0
        self._feed = _MIN_FEED  # compressed bytes to decode at the next step
        self._compressed_read = start  # file offset just past the compressed bytes read
        self._frame_ended = False  # the last step finished a frame

    def _decode_more(self) -> bool:
        if self._input_pos == len(self._input):
            self._input, self._input_pos = self._raw.read(READ_SIZE), 0
            if not self._input:
                if self._frame_started and not self._frame.eof:
                    raise CorruptShardError(
                        f"{self._url}: truncated zstd frame at compressed offset "
                        f"{self._compressed_read}; the file was cut short: copy or convert it "
                        "again",
                        url=self._url,
                        offset=self._compressed_read,
                    )
                return False
            self._compressed_read += len(self._input)
        piece = self._input[self._input_pos : self._input_pos + self._feed]
        self._input_pos += len(piece)
        try:
            out = self._frame.decompress(piece)
        except self._error as err:
            offset = self._compressed_read - len(self._input) + self._input_pos
            raise CorruptShardError(
                f"{self._url}: corrupt zstd data before compressed offset {offset}: {err}; "
                "copy or convert the file again",
                url=self._url,
                offset=offset,
            ) from err
        self._frame_started = True
        self._frame_ended = self._frame.eof
        if self._frame.eof:  # the rest of `piece` belongs to the next frame
            self._input_pos -= len(self._frame.unused_data)
            self._frame = self._dctx.decompressobj()
            self._frame_started = False
        if out:  # next step: about READ_SIZE decoded bytes at this step's ratio
            self._feed = min(READ_SIZE, max(_MIN_FEED, len(piece) * READ_SIZE // len(out)))
        self._pending = self._pending[self._pos :] + out
        self._pos = 0
        return True

    def read(self, size: int = -1) -> bytes:
        """Up to `size` decoded bytes; fewer at the end of a frame, so a reader that stops at
        a frame boundary never decodes (or trips over) the frames after it."""
        want = READ_SIZE if size is None or size < 0 else size
        while len(self._pending) - self._pos < want:
            if self._frame_ended and len(self._pending) > self._pos:
                break
            if not self._decode_more():
                break
        data = self._pending[self._pos : self._pos + want]
        self._pos += len(data)
        return data

    def close(self) -> None:
        self._raw.close()
        super().close()


class _StdlibDecoded(_Stream):
    """A gzip / bz2 / lzma decoder whose format errors become `CorruptShardError`."""

    def __init__(self, raw: BinaryIO, codec: str, url: str) -> None:
        self._url = url
        self._codec = codec
        self._decoded = 0
        if codec == "gz":
            import gzip

            self._file: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb")
        elif codec == "bz2":
            import bz2

            self._file = bz2.BZ2File(raw, mode="rb")
        else:
            import lzma

            self._file = lzma.LZMAFile(raw, mode="rb")
        self._raw = raw

    def read(self, size: int = -1) -> bytes:
        try:
            data = self._file.read(READ_SIZE if size is None or size < 0 else size)
        except TransientReadError:
            raise
        except Exception as err:  # zlib.error, EOFError, LZMAError, OSError: all damage
            raise CorruptShardError(
                f"{self._url}: corrupt or truncated .{self._codec} data after decoded offset "
                f"{self._decoded}: {err}; copy or convert the file again",
                url=self._url,
                offset=self._decoded,
            ) from err
        self._decoded += len(data)
        return data

    def close(self) -> None:
        self._file.close()
        self._raw.close()
        super().close()


def decode(raw: BinaryIO, codec: str | None, url: str, *, start: int = 0) -> BinaryIO:
    """A stream of the decoded bytes of `raw` from its current position, `start`.

    Reads of the returned stream raise `TransientReadError` when storage fails and
    `CorruptShardError` when the data is damaged.
    """
    marked = _MarkTransient(raw, url)
    if codec is None:
        return marked  # type: ignore[return-value]
    if codec == "zst":
        return _ZstdFrames(marked, url, start)  # type: ignore[return-value]
    return _StdlibDecoded(marked, codec, url)  # type: ignore[return-value]
