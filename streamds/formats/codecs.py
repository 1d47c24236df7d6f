"""Codecs: which decoder a file needs, and a decoded byte stream over a raw file.

The codec comes from the file name (`.zst`, `.gz`, `.bz2`, `.xz`, otherwise plain); the first
bytes must then say the same (magic bytes), so a gzip or plain text file named `.zst` is
reported as what it is, not as damaged zstd. Decoders read the raw file in large blocks and
hand out what they decoded before any damage: a truncated or corrupt file yields every byte
that decodes, then raises naming where the data stops. Two error kinds leave this module, so
callers can tell them apart: `TransientReadError` (the storage failed; retry) and
`CorruptShardError` (the bytes are damaged or not what the name says; retrying will not help).
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable
from typing import Any, BinaryIO

from ..errors import CorruptShardError, MissingCodecError
from ..redact import redact, safe_cause
from ..retry import is_transient

__all__ = [
    "CODEC_SUFFIXES",
    "MAX_WINDOW_SIZE",
    "READ_SIZE",
    "TransientReadError",
    "codec_of",
    "decode",
    "looks_like",
    "require_codec",
    "strip_codec",
]

READ_SIZE = 256 << 10  # bytes per read: small enough that a chunk stays in the L2 cache
_MIN_FEED = 1 << 8  # compressed bytes a zstd decoding step takes at least
MAX_WINDOW_SIZE = 1 << 31  # the largest zstd window (`zstd --long=31`); decoders allocate it

# suffix -> (codec name, module that decodes it, pip package that provides the module)
CODEC_SUFFIXES: dict[str, tuple[str, str, str]] = {
    ".zst": ("zst", "zstandard", "zstandard"),
    ".zstd": ("zst", "zstandard", "zstandard"),
    ".gz": ("gz", "gzip", "the Python zlib module (rebuild Python with zlib)"),
    ".gzip": ("gz", "gzip", "the Python zlib module (rebuild Python with zlib)"),
    ".bz2": ("bz2", "bz2", "the Python bz2 module (rebuild Python with libbz2)"),
    ".bzip2": ("bz2", "bz2", "the Python bz2 module (rebuild Python with libbz2)"),
    ".xz": ("xz", "lzma", "the Python lzma module (rebuild Python with liblzma)"),
}

# What data is, by its first bytes: (magic, name in messages, suffix of files that hold it)
_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\x28\xb5\x2f\xfd", "zstd", "zst"),
    (b"\x1f\x8b", "gzip", "gz"),
    (b"BZh", "bzip2", "bz2"),
    (b"\xfd7zXZ\x00", "xz", "xz"),
    (b"PK\x03\x04", "zip", "zip"),
    (b"\x04\x22\x4d\x18", "lz4", "lz4"),
)
_MAGIC_BYTES = 6  # enough for every magic above
_CODEC_NAMES = {"zst": "zstd", "gz": "gzip", "bz2": "bzip2", "xz": "xz"}
_TEXT_CONTROLS = frozenset(b"\t\n\r\f")


class TransientReadError(OSError):
    """The storage under a shard failed mid-read (Drive's Errno 5, a reset connection)."""


def codec_of(name: str) -> str | None:
    """The codec of a file name: "zst", "gz", "bz2", "xz", or None for plain bytes.

    Suffixes match in any case and common spelling (``.GZ``, ``.gzip``, ``.zstd``, ``.bzip2``).
    """
    lowered = name.lower()
    for suffix, (codec, _, _) in CODEC_SUFFIXES.items():
        if lowered.endswith(suffix):
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


def _is_zstd_skippable(head: bytes) -> bool:
    return len(head) >= 4 and head[0] & 0xF0 == 0x50 and head[1:4] == b"\x2a\x4d\x18"


def looks_like(head: bytes) -> tuple[str, str | None]:
    """What data beginning with `head` is: (name for messages, file suffix or None).

    >>> looks_like(b"\\x1f\\x8b\\x08\\x00"), looks_like(b'{"id": 1}'), looks_like(b"\\x00\\x01")
    (('gzip', 'gz'), ('uncompressed text', None), ('unknown binary data', None))
    """
    if _is_zstd_skippable(head):
        return "zstd", "zst"
    for magic, name, suffix in _MAGIC:
        if head.startswith(magic):
            return name, suffix
    text = head[3:] if head.startswith(b"\xef\xbb\xbf") else head
    try:
        text.decode("utf-8")
        decodes = True
    except UnicodeDecodeError as err:  # a character cut by the end of `head` is still text
        decodes = err.start >= len(text) - 3 and err.reason == "unexpected end of data"
    if decodes and all(byte >= 0x20 or byte in _TEXT_CONTROLS for byte in text):
        return "uncompressed text", None
    return "unknown binary data", None


def _check_magic(head: bytes, codec: str, url: str, start: int) -> None:
    """Raise CorruptShardError unless `head`, read at compressed offset `start`, begins
    `codec` data."""
    what, suffix = looks_like(head)
    if suffix == codec:
        return
    name = _CODEC_NAMES[codec]
    named = url.rsplit(".", 1)[-1]  # the suffix as written: .zst, .zstd, .tgz
    shown = head[:_MAGIC_BYTES].hex(" ")
    if start > 0:
        raise CorruptShardError(
            f"{url}: no {name} frame begins at compressed offset {start} (the bytes there, "
            f"{shown}, look like {what}); the seek table does not match the data: copy or "
            "convert the file again",
            url=url,
            offset=start,
        )
    if suffix is not None and suffix in _CODEC_NAMES:
        fix = f"rename it to end in .{suffix} instead of .{named}"
    elif suffix is not None:
        fix = f"unpack the {what} archive first"
    elif what == "uncompressed text":
        fix = f"drop the .{named} suffix from its name (it is not compressed)"
    else:
        fix = "copy it again or convert it from its source"
    raise CorruptShardError(
        f"{url}: this is not {name} (looks like {what}: it begins with {shown} at offset 0) "
        f"although its name ends in .{named}; {fix}",
        url=url,
        offset=0,
    )


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

    def seekable(self) -> bool:  # a file read in place (Parquet, Arrow) seeks the raw file
        return self._raw.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def read(self, size: int = -1) -> bytes:
        try:
            return self._raw.read(size)
        except OSError as err:
            if not is_transient(err):
                raise
            raise TransientReadError(
                f"{self._url}: read failed: {redact(str(err))}") from safe_cause(err)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _MagicChecked(_Stream):
    """The raw bytes of a compressed file; the first read checks they begin as `codec` data.

    An empty file passes (it decodes to nothing).
    """

    def __init__(self, raw: BinaryIO, codec: str, url: str, start: int) -> None:
        self._raw = raw
        self._codec = codec
        self._url = url
        self._start = start
        self._checked = False

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        if not self._checked:
            self._checked = True
            while 0 < len(data) < _MAGIC_BYTES:  # a short read: top up for the check
                more = self._raw.read(_MAGIC_BYTES - len(data))
                if not more:
                    break
                data += more
            if data:
                _check_magic(data[:_MAGIC_BYTES], self._codec, self._url, self._start)
        return data

    def close(self) -> None:
        self._raw.close()
        super().close()


def _window_of(header: bytes) -> int | None:
    """The window size a zstd frame header declares (None: not in `header`)."""
    if len(header) < 6 or not header.startswith(b"\x28\xb5\x2f\xfd") or header[4] & 0x20:
        return None  # a single-segment frame's window is its content size: never too large
    exponent, mantissa = header[5] >> 3, header[5] & 7
    base = 1 << (10 + exponent)
    return base + (base >> 3) * mantissa


class _ZstdFrames(_Stream):
    """Decodes consecutive zstd frames (skippable ones included) and detects truncation.

    `zstandard`'s stream reader returns a short stream for a truncated frame without an error;
    this reader raises `CorruptShardError` instead, after handing out every byte decoded
    before the damage. Windows up to MAX_WINDOW_SIZE (`zstd --long=31`) decode; a larger one
    is refused as "window too large". Memory stays near READ_SIZE plus the frame's window
    however well the data compresses: a step decodes at most to the end of one frame, from as
    much input as gave about READ_SIZE decoded bytes at the last ratio seen (a step that
    decoded nothing, a block still incomplete, keeps the input size: growing it there could
    swallow thousands of highly compressed blocks at once).
    """

    def __init__(self, raw: BinaryIO, url: str, start: int = 0, decoded_start: int = 0) -> None:
        import zstandard

        self._raw = raw
        self._url = url
        self._dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_SIZE)
        self._error = zstandard.ZstdError
        self._frame = self._dctx.decompressobj()
        self._frame_started = False
        self._frame_head = b""  # the first bytes of the current frame (its header)
        self._pending = b""  # decoded bytes, returned from self._pos on
        self._pos = 0
        self._input = b""  # compressed bytes read, decoded up to self._input_pos
        self._input_pos = 0
        self._feed = _MIN_FEED  # compressed bytes to decode at the next step
        self._compressed_read = start  # file offset just past the compressed bytes read
        self._decoded = decoded_start  # decoded offset just past self._pending
        self._frame_ended = False  # the last step finished a frame
        self._failed: CorruptShardError | None = None  # raised once the decoded bytes are out

    def _corrupt(self, err: Exception, offset: int) -> CorruptShardError:
        window = _window_of(self._frame_head)
        if "too much memory" in str(err) or (window is not None and window > MAX_WINDOW_SIZE):
            declared = f"{window >> 20} MiB" if window is not None else "more than 2 GiB"
            return CorruptShardError(
                f"{self._url}: zstd window too large: the frame ending before compressed offset "
                f"{offset} needs a {declared} window and streamds decodes windows up to "
                f"{MAX_WINDOW_SIZE >> 20} MiB (`zstd --long=31`); recompress it with "
                "`zstd --long=27` (or less), or convert it with `streamds convert`",
                url=self._url,
                offset=offset,
            )
        return CorruptShardError(
            f"{self._url}: corrupt zstd data before compressed offset {offset} (after decoded "
            f"offset {self._decoded}): {err}; copy or convert the file again",
            url=self._url,
            offset=offset,
        )

    def _decode_more(self) -> bool:
        if self._input_pos == len(self._input):
            self._input, self._input_pos = self._raw.read(READ_SIZE), 0
            if not self._input:
                if self._frame_started and not self._frame.eof:
                    raise CorruptShardError(
                        f"{self._url}: truncated zstd frame: the file ends at compressed offset "
                        f"{self._compressed_read}, inside a frame, after decoded offset "
                        f"{self._decoded}; the lines before it were read; the file was cut "
                        "short: copy or convert it again",
                        url=self._url,
                        offset=self._compressed_read,
                    )
                return False
            self._compressed_read += len(self._input)
        piece = self._input[self._input_pos : self._input_pos + self._feed]
        self._input_pos += len(piece)
        if len(self._frame_head) < 6:
            self._frame_head += piece[: 6 - len(self._frame_head)]
        try:
            out = self._frame.decompress(piece)
        except self._error as err:
            offset = self._compressed_read - len(self._input) + self._input_pos
            raise self._corrupt(err, offset) from err
        self._frame_started = True
        self._frame_ended = self._frame.eof
        if self._frame.eof:  # the rest of `piece` belongs to the next frame
            self._input_pos -= len(self._frame.unused_data)
            self._frame = self._dctx.decompressobj()
            self._frame_started = False
            self._frame_head = b""
        if out:  # next step: about READ_SIZE decoded bytes at this step's ratio
            self._feed = min(READ_SIZE, max(_MIN_FEED, len(piece) * READ_SIZE // len(out)))
        self._pending = self._pending[self._pos :] + out
        self._pos = 0
        self._decoded += len(out)
        return True

    def read(self, size: int = -1) -> bytes:
        """Up to `size` decoded bytes; fewer at the end of a frame, so a reader that stops at
        a frame boundary never decodes (or trips over) the frames after it. Damage is raised
        once the bytes decoded before it are handed out."""
        want = READ_SIZE if size is None or size < 0 else size
        if self._failed is not None and self._pos == len(self._pending):
            raise self._failed
        while self._failed is None and len(self._pending) - self._pos < want:
            if self._frame_ended and len(self._pending) > self._pos:
                break
            try:
                if not self._decode_more():
                    break
            except CorruptShardError as err:
                if len(self._pending) == self._pos:
                    raise
                self._failed = err  # hand out what decoded first
        data = self._pending[self._pos : self._pos + want]
        self._pos += len(data)
        return data

    def close(self) -> None:
        self._raw.close()
        super().close()


class _GzipMember:
    """zlib's gzip decoder with the interface of `bz2.BZ2Decompressor`."""

    def __init__(self) -> None:
        import zlib

        self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._tail = b""

    @property
    def eof(self) -> bool:
        return self._zlib.eof

    @property
    def unused_data(self) -> bytes:
        return self._zlib.unused_data

    @property
    def needs_input(self) -> bool:
        return not self._tail

    def decompress(self, data: bytes, max_length: int) -> bytes:
        out = self._zlib.decompress(self._tail + data, max_length)
        self._tail = self._zlib.unconsumed_tail
        return out


def _decompressor(codec: str) -> tuple[Callable[[], Any], tuple[type[Exception], ...]]:
    """A factory of one-stream decompressors for `codec` and the errors they raise."""
    if codec == "gz":
        import zlib

        return _GzipMember, (zlib.error, EOFError)
    if codec == "bz2":
        import bz2

        return bz2.BZ2Decompressor, (OSError, EOFError, ValueError)
    import lzma

    return lzma.LZMADecompressor, (lzma.LZMAError, EOFError)


class _StdlibDecoded(_Stream):
    """A gzip / bz2 / xz decoder over raw bytes; concatenated streams (and the zero padding
    between them) decode as one. Damage becomes `CorruptShardError`, raised once the bytes
    decoded before it are handed out; a cut file says where its data ends."""

    def __init__(self, raw: BinaryIO, codec: str, url: str) -> None:
        self._raw = raw
        self._codec = codec
        self._url = url
        self._new, self._errors = _decompressor(codec)
        self._stream = self._new()
        self._stream_fed = False  # the current stream has taken input
        self._input = b""  # raw bytes read, not yet given to a decompressor
        self._raw_read = 0  # raw bytes read from the file
        self._fed = 0  # raw bytes given to decompressors (net of what came back unused)
        self._decoded = 0  # decoded bytes handed out or about to be
        self._failed: CorruptShardError | None = None

    def _more_input(self) -> bytes:
        data = self._raw.read(READ_SIZE)
        self._raw_read += len(data)
        return data

    def _damage(self, err: Exception, fed: int) -> CorruptShardError:
        return CorruptShardError(
            f"{self._url}: corrupt .{self._codec} data before compressed offset {fed} "
            f"(after decoded offset {self._decoded}): {err}; copy or convert the file again",
            url=self._url,
            offset=self._decoded,
        )

    def _truncated(self) -> CorruptShardError:
        return CorruptShardError(
            f"{self._url}: corrupt or truncated .{self._codec} data: the file ends at "
            f"compressed offset {self._raw_read}, inside a compressed stream, after decoded offset "
            f"{self._decoded}; the lines before it were read; the file was cut short: copy or "
            "convert it again",
            url=self._url,
            offset=self._decoded,
        )

    def _next_stream(self) -> bool:
        """Start the stream after a finished one; False at the clean end of the data."""
        unused = self._stream.unused_data
        self._fed -= len(unused)
        rest = unused + self._input
        while True:
            stripped = rest.lstrip(b"\x00")  # gzip and xz allow zero padding between streams
            self._fed += len(rest) - len(stripped)
            if stripped:
                break
            rest = self._more_input()
            if not rest:
                return False
        self._stream, self._stream_fed, self._input = self._new(), False, stripped
        return True

    def _step(self, limit: int) -> bytes | None:
        """Some decoded bytes (at most `limit`; possibly none); None at the end of the data."""
        if self._stream.eof and not self._next_stream():
            return None
        data = b""
        if self._stream.needs_input:
            data, self._input = self._input or self._more_input(), b""
            if not data:
                if not self._stream_fed:
                    return None  # an empty file
                try:  # output the decoder still holds, then the cut
                    out = self._stream.decompress(b"", limit)
                except self._errors:
                    out = b""
                if out:
                    return out
                raise self._truncated()
        try:
            out = self._stream.decompress(data, limit)
        except self._errors as err:
            raise self._damage(err, self._fed + len(data)) from err
        self._stream_fed = True
        self._fed += len(data)
        return out

    def read(self, size: int = -1) -> bytes:
        want = READ_SIZE if size is None or size < 0 else size
        if self._failed is not None:
            raise self._failed
        pieces: list[bytes] = []
        got = 0
        while got < want:
            try:
                piece = self._step(want - got)
            except CorruptShardError as err:
                if not got:
                    raise
                self._failed = err  # hand out what decoded first
                break
            if piece is None:
                break
            pieces.append(piece)
            got += len(piece)
            self._decoded += len(piece)
        return b"".join(pieces)

    def close(self) -> None:
        self._raw.close()
        super().close()


def decode(
    raw: BinaryIO, codec: str | None, url: str, *, start: int = 0, decoded_start: int = 0
) -> BinaryIO:
    """A stream of the decoded bytes of `raw` from its current position, `start`.

    `decoded_start` is the decoded offset there (a seekable zstd frame's), for messages.
    Reads of the returned stream raise `TransientReadError` when storage fails and
    `CorruptShardError` when the data is damaged or is not `codec` data.
    """
    marked = _MarkTransient(raw, url)
    if codec is None:
        return marked  # type: ignore[return-value]
    checked = _MagicChecked(marked, codec, url, start)
    if codec == "zst":
        return _ZstdFrames(checked, url, start, decoded_start)  # type: ignore[arg-type,return-value]
    return _StdlibDecoded(checked, codec, url)  # type: ignore[arg-type,return-value]
