"""A local store of the records a block produced: what `ds.cache(directory, key=...)` keeps.

The records of one block (`plan.Block`), as the stages before the cache made them (parsed,
tokenized by a `.map`), go into one file per block, ``<key>.records``, in a directory shared
by the workers and ranks of one machine. A block's file holds one entry per ordinal of the
block (the n-th line of the block is ordinal n): the record, `DROPPED` where a filter or a
map removed it, or `BLANK_LINE` / `BAD_LINE` for a line that held no record, so reading the
block back gives the same count, the same drops and skipped lines, the same order.

Keys (`block_key`): a digest of the store's format version, the shard's identity (its name
relative to the source root, size, manifest checksum, or without one the version the storage
gave: a modification time, an ETag), how the shard is read (format, codec), the block's extent
and the caller's `key` (the tokenizer and its settings) and `upstream` (the settings of the
stages before the cache). A changed file or another key gives another name: nothing stale is
served. A shard with neither a checksum nor a version has no key (None): nothing could tell
its records stale. Names enter with their credentials removed, and only as part of a digest:
a file name is the digest, and a file holds the digest, never a name.

Writing (`RecordStore.start`): one writer per block across processes, by an `fcntl.flock`
lock on ``<key>.records.lock`` taken without waiting; a process that does not get it computes
the block itself and writes nothing. Records come in any order (a shuffle interleaves blocks)
and are appended to ``<key>.records.partial-<random>`` as they come, with an offset index in
memory (about 100 bytes a record); once every ordinal is in, the index and a footer are
appended, the file is fsync'd and renamed to its name. A reader never sees a partial file;
a dead writer's partial is removed by the next writer of that block (its lock went with it).

Reading (`RecordStore.get`): a complete file, opened with its lock held shared until the
reader closes (so it is never removed while in use), and touched (its modification time is
its last use). Opening reads the header, the footer and the index; `record(i)` reads one
entry (one `pread`) and checks its xxh3 checksum.

Bounded: `limit` bytes of complete files in the directory. A file is made room for when it is
complete, by removing least recently used files nobody holds; a block that grows past the
limit, or does not fit beside the files in use, is not stored. Partial files of writers at
work are not counted, so the directory may pass the limit by what is being written.

File layout (little-endian)::

    header  b"streamds-records" | u32 format | u32 0 | 16-byte key digest
    entries encoded records, in the order they arrived
    index   per ordinal: u64 offset, u64 length, u64 xxh3_64 of the entry;
            then per ordinal: i64 position (the record's offset in its block)
    footer  u64 index offset | u64 count | b"SDSRECND"

Encoding (`encode_record`, `decode_record`): a small tagged binary format, no pickle (a
cache directory must not be able to run code in the process that reads it). It stores what a
map returns: dict, list, tuple, str, int, float, bool, None, bytes, numpy arrays and scalars
and torch tensors, nested; a value comes back equal and of the same type (an int stays an
int, an array keeps its dtype and shape, a tensor comes back a tensor, on the CPU, without
its gradient). A list or tuple of ints (token ids) is stored as one int32 array (int64 where
a value needs it) and a list of floats as one float64 array. Anything else is refused by
`UncacheableRecordError`, naming the value's place in the record and its type.

Not thread-safe: one store, writer or reader per thread. Readers and writers belong to the
process that opened them: open them in the worker, never before a fork (a forked copy of a
lock descriptor holds the lock until the child closes it).

How the cache stage (`streamds.stages.cache`) uses this. The chain
with a shuffle is lines -> parse -> shuffle buffer (parsed records, with positions) ->
map/filter (`stages.transform.AfterBuffer`). The cache stage takes the place of the steps
after the buffer, and a stored block skips the read and the parse as well:

- Keys: the dataset (which knows the names relative to the source root,
  `resume.identity.relative_names`) makes `block_key(shard, block, name=..., key=...,
  upstream=...)` per block, with the reading settings that change records (on_error, how
  documents are read) in `upstream`; None: read the block as without a cache.
- A stored block (`get` gives a reader): the lines stage yields its positions
  (`reader.position(i)`) with placeholders instead of reading and parsing the source; the
  buffer shuffles them as it would the parsed records (the positions and their number are
  the same, so the draws and the order are too: check that chunk sizes do not change the
  order); the cache stage turns each one handed out at (block, offset) into
  `reader.record(reader.first_at(offset))`, checking `reader.position(i) == offset`, and
  yields nothing for `DROPPED` (counted as the steps would count it). The buffer holds
  positions for such blocks, not tokenized records; `record` is one `pread`.
- A block not stored: `start(key)` (None: another process fills it; just compute). After
  the buffer the steps run as now, and each result goes to `writer.put_at(offset, record)`
  (`DROPPED` for a drop: `stages.parse.DROPPED` is another object, translate it). The
  stage before the buffer that sees the block's last chunk calls `writer.expect(lines)`
  with the number of positions the block put into the buffer; the block completes when
  its last record leaves the buffer. Under even ranks, where the steps run before the
  buffer, records come in order: `put(ordinal, record, offset)`.
- Resume: states are the same with or without the cache (same positions). A resumed
  process never sees the records handed out before the state, so the blocks it was filling
  do not complete: `abort()` every open writer when the epoch ends (or the iterator is
  dropped); they are filled in a later epoch. `fetch(positions)` on a resume reads stored
  blocks by `first_at` as above.
- Errors: an `UncacheableRecordError` goes to the user with the file and line of the
  record (`LineNumbers`); a `CachedBlockError` while reading a stored block: warn, compute
  that block from the source (the same positions) and let the next epoch store it again.
  Blank lines and lines skipped as malformed (on_error="skip") are stored as `BLANK_LINE`
  and `BAD_LINE`, so a cached epoch counts them as the epoch that read the source did.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import hashlib
import logging
import math
import os
import secrets
import struct
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import xxhash

from ..redact import redact
from .locks import fcntl, remove_if_unused, try_lock
from .plan import Block
from .shards import Shard

__all__ = [
    "BAD_LINE",
    "BLANK_LINE",
    "DROPPED",
    "FORMAT_VERSION",
    "BlockReader",
    "BlockWriter",
    "CachedBlockError",
    "RecordStore",
    "UncacheableRecordError",
    "block_key",
    "decode_record",
    "encode_record",
    "uncacheable",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # of the file layout and the encoding: part of every key
MAX_DEPTH = 256  # nesting levels a record may have (a deeper one is refused, not overflowed)
SUFFIX = ".records"
_LOCK, _PARTIAL = ".lock", ".partial-"
_MAGIC = b"streamds-records"
_HEADER = struct.Struct("<16sII16s")
_ENTRY = struct.Struct("<QQQ")  # offset, length, checksum of one ordinal's entry
_POSITION = 8  # bytes of one ordinal's position (int64)
_FOOTER = struct.Struct("<QQ8s")
_END = b"SDSRECND"
_KEY_DIGITS = 32  # hex digits of a block key
WRITE_BUFFER = 256 << 10  # bytes a writer buffers before appending to its partial file


class _Dropped:
    """The entry of an ordinal that a filter (or a map returning None) removed."""

    _instance: _Dropped | None = None

    def __new__(cls) -> _Dropped:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DROPPED"

    def __reduce__(self) -> str:
        return "DROPPED"


DROPPED = _Dropped()


class _LineMark:
    """The entry of a line that held no record: `BLANK_LINE`, or `BAD_LINE` (malformed,
    skipped under on_error="skip"); kept so that a stored block gives the same counts."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self) -> str:
        return self.name


BLANK_LINE = _LineMark("BLANK_LINE")
BAD_LINE = _LineMark("BAD_LINE")


class UncacheableRecordError(TypeError):
    """A record holding a value the cache cannot store; the message names where and what."""


class CachedBlockError(OSError):
    """A cached block's file that is damaged: the message names the file and the entry."""


# ---------------------------------------------------------------------------------------------
# keys


def _plain_name(name: str) -> str:
    """`name` without a URL's user information and with its secret query values masked."""
    if "://" in name:
        parts = urlsplit(name)
        name = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path,
                           parts.query, ""))
    return redact(name)


def uncacheable(shard: Shard) -> str | None:
    """Why the records of `shard` cannot be cached (None: they can)."""
    if shard.checksum is None and shard.version is None:
        return ("the storage gives no ETag or modification time and no manifest lists its "
                "checksum, so a changed file could not be told from its cached records")
    return None


def block_key(shard: Shard, block: Block, *, name: str, key: str, upstream: str = ""
              ) -> str | None:
    """The name of `block`'s records in a store: 32 hex digits, or None where `uncacheable`.

    `name`: the shard's name relative to the source root (the same files under another mount
    point find their records); `key`: the user's key (e.g. the tokenizer and its settings);
    `upstream`: the settings of the stages before the cache that change what they yield (the
    error policy, how documents are read). Costs one digest of a few hundred bytes.
    """
    if uncacheable(shard) is not None:
        return None
    content = (f"checksum={shard.checksum}" if shard.checksum is not None
               else f"version={shard.version}")
    parts = (f"format={FORMAT_VERSION}", f"name={_plain_name(name)}", f"size={shard.size}",
             content, f"read={shard.format.name}/{shard.codec}",
             f"block={block.start}:{block.end}", f"key={key}", f"upstream={upstream}")
    digest = hashlib.blake2b(digest_size=_KEY_DIGITS // 2)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        digest.update(struct.pack("<Q", len(data)) + data)  # length-prefixed: no ambiguity
    return digest.hexdigest()


def _check_key(key: str) -> None:
    if not (isinstance(key, str) and len(key) == _KEY_DIGITS
            and all(char in "0123456789abcdef" for char in key)):
        raise ValueError(f"a block key is {_KEY_DIGITS} lowercase hex digits, got {key!r}; "
                         "make it with block_key(...)")


# ---------------------------------------------------------------------------------------------
# encoding

_Q = struct.Struct("<Q")
_q = struct.Struct("<q")
_d = struct.Struct("<d")
_INT64 = (-(1 << 63), (1 << 63) - 1)
_BIG_ENDIAN = sys.byteorder == "big"

# tags: one byte before each value
_NONE, _TRUE, _FALSE, _INT, _BIGINT, _FLOAT = b"N", b"T", b"F", b"i", b"I", b"f"
_STR, _BYTES, _DICT, _LIST, _TUPLE = b"s", b"b", b"d", b"l", b"t"
_INTS_LIST, _INTS_TUPLE, _FLOATS_LIST, _FLOATS_TUPLE = b"L", b"U", b"D", b"V"
_INT32S_LIST, _INT32S_TUPLE = b"J", b"W"  # ints that all fit in 32 bits (token ids): half the bytes
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT32_CODE = "i" if array("i").itemsize == 4 else "l"  # array's 32-bit signed typecode
_NDARRAY, _NPSCALAR, _TENSOR, _DROP = b"a", b"g", b"x", b"z"
_BLANK, _BAD = b"_", b"!"  # lines without a record (entries of one byte, as `_DROP`)
_MARKS = {_DROP: DROPPED, _BLANK: BLANK_LINE, _BAD: BAD_LINE}

_ALLOWED = ("dict, list, tuple, str, int, float, bool, None, bytes, numpy arrays and scalars "
            "(of numeric, bool, str or bytes dtypes) and torch tensors (dense)")


class _Refused(Exception):
    """Raised inside the encoder; the path is filled in on the way out."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.what = what
        self.fix = fix
        self.path: list[str] = []


def _type_name(value: Any) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _packed(items: list | tuple) -> bytes | None:
    """A list or tuple of only ints (in int64) or only floats as one array, else None.

    Exact types only (a bool or an int subclass would come back an int); counting the types
    in a list is the cheapest whole-list check, then one `struct.pack` packs them.
    """
    kinds = list(map(type, items))
    count = len(items)
    if kinds.count(int) == count:
        if _INT32[0] <= min(items) and max(items) <= _INT32[1]:
            data = struct.pack(f"<{count}i", *items)
            tag = _INT32S_LIST if type(items) is list else _INT32S_TUPLE
        else:
            try:
                data = struct.pack(f"<{count}q", *items)
            except struct.error:  # an int beyond int64
                return None
            tag = _INTS_LIST if type(items) is list else _INTS_TUPLE
    elif kinds.count(float) == count:
        data = struct.pack(f"<{count}d", *items)
        tag = _FLOATS_LIST if type(items) is list else _FLOATS_TUPLE
    else:
        return None
    return tag + _Q.pack(count) + data


def _dtype_text(text: str) -> bytes:
    data = text.encode("ascii")
    return _Q.pack(len(data)) + data


def _shape(shape: tuple[int, ...]) -> bytes:
    return _Q.pack(len(shape)) + b"".join(_Q.pack(size) for size in shape)


def _encode_numpy(value: Any, out: list[bytes]) -> None:
    np = sys.modules["numpy"]
    dtype = value.dtype
    if dtype.kind not in "biufcmMSU" or dtype.fields is not None or dtype.subdtype is not None:
        what = "array" if isinstance(value, np.ndarray) else "scalar"
        raise _Refused(f"a numpy {what} of dtype {dtype}", "store a numeric, bool, str or "
                       "bytes dtype (e.g. value.astype(...)), or a list")
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value).tobytes()
        out += (_NDARRAY, _dtype_text(dtype.str), _shape(value.shape), _Q.pack(len(data)), data)
    else:
        data = value.tobytes()
        out += (_NPSCALAR, _dtype_text(dtype.str), _Q.pack(len(data)), data)


def _encode_tensor(value: Any, out: list[bytes]) -> None:
    torch = sys.modules["torch"]
    if value.layout != torch.strided or value.is_quantized:
        raise _Refused(f"a torch tensor with layout {value.layout}"
                       + (" (quantized)" if value.is_quantized else ""),
                       "store a dense tensor (e.g. value.to_dense() or value.dequantize())")
    flat = value.detach().cpu().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    name = str(value.dtype).removeprefix("torch.")
    out += (_TENSOR, _dtype_text(name), _shape(tuple(value.shape)), _Q.pack(len(data)), data)


def _encode(value: Any, out: list[bytes], depth: int) -> None:
    kind = type(value)
    if kind is str:
        data = value.encode("utf-8", "surrogatepass")
        out += (_STR, _Q.pack(len(data)), data)
    elif kind is int:
        if _INT64[0] <= value <= _INT64[1]:
            out += (_INT, _q.pack(value))
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out += (_BIGINT, _Q.pack(len(data)), data)
    elif kind is float:
        out += (_FLOAT, _d.pack(value))
    elif value is None:
        out.append(_NONE)
    elif kind is bool:
        out.append(_TRUE if value else _FALSE)
    elif kind is list or kind is tuple:
        packed = _packed(value) if len(value) > 1 else None
        if packed is not None:
            out.append(packed)
            return
        if depth >= MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", "flatten the record")
        out += (_LIST if kind is list else _TUPLE, _Q.pack(len(value)))
        for index, item in enumerate(value):
            try:
                _encode(item, out, depth + 1)
            except _Refused as err:
                err.path.append(f"[{index}]")
                raise
    elif kind is dict:
        if depth >= MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", "flatten the record")
        out += (_DICT, _Q.pack(len(value)))
        for name, item in value.items():
            try:
                _encode(name, out, depth + 1)
            except _Refused as err:
                err.what = f"a dict key {name!r} of type {_type_name(name)}"
                err.fix = "use str keys (or int, float, bool, None, bytes, tuples of these)"
                raise
            try:
                _encode(item, out, depth + 1)
            except _Refused as err:
                err.path.append(f"[{name!r}]")
                raise
    elif kind is bytes:
        out += (_BYTES, _Q.pack(len(value)), value)
    else:
        np = sys.modules.get("numpy")  # not imported: the value cannot be numpy's
        if np is not None and (kind is np.ndarray or isinstance(value, np.generic)):
            _encode_numpy(value, out)
            return
        torch = sys.modules.get("torch")
        if torch is not None and kind is torch.Tensor:
            _encode_tensor(value, out)
            return
        raise _Refused(f"a value of type {_type_name(value)}",
                       "convert it in the map to one of those (e.g. str(value), dict(value), "
                       "list(value)), or put the step that makes it after the cache")


def encode_record(record: Any) -> bytes:
    """`record` in the store's binary form; `DROPPED` is an entry of its own.

    Raises `UncacheableRecordError` for a value the cache does not store, naming where it is
    in the record (``record['meta']['when']``), its type, and what to do.
    """
    if record is DROPPED:
        return _DROP
    if record is BLANK_LINE or record is BAD_LINE:
        return _BLANK if record is BLANK_LINE else _BAD
    out: list[bytes] = []
    try:
        _encode(record, out, 0)
    except _Refused as err:
        where = "record" + "".join(reversed(err.path))
        raise UncacheableRecordError(
            f"ds.cache cannot store {where}: {err.what}; the cache stores {_ALLOWED}; "
            f"{err.fix}") from None
    return b"".join(out)


class _Corrupt(Exception):
    pass


def _text(view: memoryview, pos: int) -> tuple[str, int]:
    (size,) = _Q.unpack_from(view, pos)
    pos += 8
    return str(view[pos: pos + size], "ascii"), pos + size


def _shape_at(view: memoryview, pos: int) -> tuple[tuple[int, ...], int]:
    (ndim,) = _Q.unpack_from(view, pos)
    shape = struct.unpack_from(f"<{ndim}Q", view, pos + 8)
    return shape, pos + 8 + 8 * ndim


def _numbers(view: memoryview, pos: int, typecode: str) -> tuple[list, int]:
    (count,) = _Q.unpack_from(view, pos)
    pos += 8
    values = array(typecode)
    end = pos + values.itemsize * count
    values.frombytes(view[pos: end])
    if len(values) != count:
        raise _Corrupt(f"an array of {count} numbers cut short")
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tolist(), end


def _decode(view: memoryview, pos: int) -> tuple[Any, int]:
    tag = view[pos: pos + 1].tobytes()
    pos += 1
    if tag in (_STR, _BYTES):
        (size,) = _Q.unpack_from(view, pos)
        pos += 8
        if pos + size > len(view):
            raise _Corrupt("a string cut short")
        part = view[pos: pos + size]
        value = str(part, "utf-8", "surrogatepass") if tag == _STR else part.tobytes()
        return value, pos + size
    if tag in (_INT32S_LIST, _INT32S_TUPLE):
        values, pos = _numbers(view, pos, _INT32_CODE)
        return (values if tag == _INT32S_LIST else tuple(values)), pos
    if tag in (_INTS_LIST, _INTS_TUPLE):
        values, pos = _numbers(view, pos, "q")
        return (values if tag == _INTS_LIST else tuple(values)), pos
    if tag == _DICT:
        (count,) = _Q.unpack_from(view, pos)
        pos += 8
        result = {}
        for _ in range(count):
            name, pos = _decode(view, pos)
            result[name], pos = _decode(view, pos)
        return result, pos
    if tag == _INT:
        return _q.unpack_from(view, pos)[0], pos + 8
    if tag == _FLOAT:
        return _d.unpack_from(view, pos)[0], pos + 8
    if tag == _NONE:
        return None, pos
    if tag in (_TRUE, _FALSE):
        return tag == _TRUE, pos
    if tag in (_LIST, _TUPLE):
        (count,) = _Q.unpack_from(view, pos)
        pos += 8
        items = []
        for _ in range(count):
            item, pos = _decode(view, pos)
            items.append(item)
        return (items if tag == _LIST else tuple(items)), pos
    if tag in (_FLOATS_LIST, _FLOATS_TUPLE):
        values, pos = _numbers(view, pos, "d")
        return (values if tag == _FLOATS_LIST else tuple(values)), pos
    if tag == _BIGINT:
        (size,) = _Q.unpack_from(view, pos)
        pos += 8
        return int.from_bytes(view[pos: pos + size], "little", signed=True), pos + size
    if tag in (_NDARRAY, _NPSCALAR):
        import numpy as np

        dtype, pos = _text(view, pos)
        shape, pos = _shape_at(view, pos) if tag == _NDARRAY else ((), pos)
        (size,) = _Q.unpack_from(view, pos)
        pos += 8
        kind = np.dtype(dtype)
        flat = (np.frombuffer(bytearray(view[pos: pos + size]), dtype=kind) if kind.itemsize
                else np.zeros(math.prod(shape), dtype=kind))  # "<U0": np.str_("") and kin
        return (flat.reshape(shape) if tag == _NDARRAY else flat[0]), pos + size
    if tag == _TENSOR:
        import torch

        name, pos = _text(view, pos)
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise _Corrupt(f"an unknown tensor dtype {name!r}")
        shape, pos = _shape_at(view, pos)
        (size,) = _Q.unpack_from(view, pos)
        pos += 8
        if size == 0:
            return torch.empty(shape, dtype=dtype), pos
        raw = torch.frombuffer(bytearray(view[pos: pos + size]), dtype=torch.uint8)
        return raw.view(dtype).reshape(shape), pos + size
    if tag in _MARKS:
        return _MARKS[tag], pos
    raise _Corrupt(f"an unknown tag {tag!r}")


def decode_record(data: bytes) -> Any:
    """The record `encode_record` made `data` from (or `DROPPED`).

    Raises ValueError where `data` is not a whole encoded record.
    """
    view = memoryview(data)
    try:
        record, end = _decode(view, 0)
    except (_Corrupt, struct.error, IndexError, ValueError, TypeError) as err:
        raise ValueError(f"not an encoded record: {err}") from None
    if end != len(view):
        raise ValueError(f"not an encoded record: {len(view) - end} bytes after its end")
    return record


# ---------------------------------------------------------------------------------------------
# the store



_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)  # a directory that cannot be written
_said: set[tuple[str, str]] = set()  # (directory, kind) logged in this process


def _say_once(directory: str, kind: str, message: str, *args: Any) -> None:
    """Log a warning of `kind` about `directory` once per process (each block would repeat
    it)."""
    if (directory, kind) not in _said:
        _said.add((directory, kind))
        log.warning(message, *args)


def _checksum(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class RecordStore:
    """Blocks of records in `directory`, at most `limit` bytes of them (None: no bound).

    A picklable description: it opens nothing until `get` or `start` is called. Typical use
    by the stage that fills and reads the cache::

        reader = store.get(key)               # the block's records, or None
        if reader is None:
            writer = store.start(key)         # None: another process writes it; compute
            ...                               # writer.put(ordinal, record or DROPPED)
            writer.expect(count)              # when the block's record count is known
    """

    directory: str
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and (type(self.limit) is not int or self.limit < 0):
            raise ValueError(f"limit must be a number of bytes >= 0 or None, got "
                             f"{self.limit!r}; use None for no bound")

    def path_of(self, key: str) -> Path:
        _check_key(key)
        return Path(self.directory) / f"{key}{SUFFIX}"

    def _lock_fd(self, path: Path, *, write: bool) -> int | None:
        """The descriptor to lock `path` by (None: the directory cannot be written, and
        `write` was asked: store nothing). Reading a directory nobody can write (a cache
        made elsewhere and mounted read-only) locks the lock file, or the block's file,
        opened read-only: nobody can remove it there."""
        if fcntl is None:
            raise OSError(errno.ENOSYS, "ds.cache needs file locks (fcntl), which this system "
                          "lacks; leave the cache out")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(f"{path}{_LOCK}", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            if err.errno not in _READ_ONLY:
                raise
            if write:
                _say_once(self.directory, "read-only",
                          "ds.cache: the directory %s cannot be written (%s): blocks it does "
                          "not hold are computed every epoch and not stored; give the cache a "
                          "writable directory", self.directory, err.strerror)
                return None
        try:
            return os.open(f"{path}{_LOCK}", os.O_RDONLY)
        except FileNotFoundError:
            return os.open(path, os.O_RDONLY)

    def get(self, key: str) -> BlockReader | None:
        """The block's records, or None where it is not stored (or being written or removed
        right now). Cheap: a lock, a stat and three small reads. A damaged file is removed
        (logged) and None returned."""
        path = self.path_of(key)
        if not path.exists():
            return None
        try:
            lock = self._lock_fd(path, write=False)
        except FileNotFoundError:  # removed meanwhile, in a directory we cannot write
            return None
        assert lock is not None
        if not try_lock(lock, fcntl.LOCK_SH):
            os.close(lock)
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # removed between the look and the lock
            os.close(lock)
            return None
        try:
            reader = BlockReader(path, key, fd, lock)
        except CachedBlockError as err:
            log.warning("%s; removing it (its block is computed again)", err)
            os.close(fd)
            fcntl.flock(lock, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):  # a read-only directory keeps it
                remove_if_unused(path, lock)
            os.close(lock)
            return None
        except BaseException:
            os.close(fd)
            os.close(lock)
            raise
        with contextlib.suppress(OSError):  # read-only directory: no order of use
            os.utime(path)  # its last use, for least-recently-used removal
        return reader

    def start(self, key: str, count: int | None = None) -> BlockWriter | None:
        """A writer of the block's records, or None where another process is writing it or
        it is stored already (then `get` it, or compute the block without storing it).

        `count`: the block's number of ordinals, if known now (else `BlockWriter.expect`).
        Removes a partial file a dead writer left.
        """
        path = self.path_of(key)
        lock = self._lock_fd(path, write=True)
        if lock is None:
            return None
        if not try_lock(lock, fcntl.LOCK_EX):
            os.close(lock)
            return None
        try:
            if path.exists():  # completed between the caller's look and the lock
                os.close(lock)
                return None
            for stale in path.parent.glob(f"{path.name}{_PARTIAL}*"):
                log.debug("removing %s, left by a writer that stopped", stale)
                stale.unlink(missing_ok=True)
            partial = path.with_name(f"{path.name}{_PARTIAL}{secrets.token_hex(4)}")
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except BaseException:
            os.close(lock)
            raise
        writer = BlockWriter(self, key, path, partial, fd, lock)
        if count is not None:
            writer.expect(count)
        return writer

    def stored_bytes(self) -> int:
        """Bytes of complete block files in the directory."""
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every complete block file, least recently used first."""
        found = []
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        for entry in entries:
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            found.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        return sorted(found, key=lambda item: (item[0], item[2].name))

    def _make_room(self, needed: int) -> bool:
        """Remove least recently used files nobody holds until `needed` more bytes fit under
        the limit; False where they cannot."""
        if self.limit is None:
            return True
        if needed > self.limit:
            return False
        files = self._files()
        used = sum(size for _, size, _ in files)
        for _, size, path in files:
            if used + needed <= self.limit:
                break
            lock = os.open(f"{path}{_LOCK}", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if remove_if_unused(path, lock):
                    log.debug("removed %s (%d bytes), least recently used", path, size)
                    used -= size
            finally:
                os.close(lock)
        return used + needed <= self.limit




class BlockWriter:
    """Fills one block's file: `put` entries in any order, `expect` the count once known.

    The file is completed (index written, fsync'd, renamed) by the `put` or `expect` that
    makes every ordinal present; `complete` then says so. A writer that cannot store the
    block (larger than the limit, no room, a failed write) stops storing, removes its partial
    file and lets `put` do nothing; `stored` is False then. `abort()` gives up on purpose
    (an epoch cut short); a dead process's partial file is removed by the next writer.
    """

    def __init__(self, store: RecordStore, key: str, path: Path, partial: Path, fd: int,
                 lock: int) -> None:
        self.key = key
        self.path = path
        self._store = store
        self._partial = partial
        self._lock = lock
        self._file = os.fdopen(fd, "wb", buffering=WRITE_BUFFER)
        self._file.write(_HEADER.pack(_MAGIC, FORMAT_VERSION, 0, bytes.fromhex(key)))
        self._end = _HEADER.size
        # ordinal -> (offset, length, checksum, position)
        self._entries: dict[int, tuple[int, int, int, int]] = {}
        self._count: int | None = None
        self._by_position: bool | None = None  # put_at (ordinals by rank) or put (given)
        self.complete = False
        self.stored = True  # False once it gave up

    def put(self, index: int, record: Any, position: int | None = None) -> None:
        """Store the entry of ordinal `index`: a record, or `DROPPED`.

        `position`: where the record stands in its block (its `Position`'s offset: decoded
        bytes, or records in a tar shard), so that a stored block gives the positions reading
        the source gives; None: the ordinal. Positions must increase with the ordinal.
        Raises `UncacheableRecordError` for a record the cache cannot store (the writer
        gives up first), ValueError for an ordinal out of range or put twice.
        """
        if not self._open_to(by_position=False, what=f"ordinal {index}"):
            return
        if type(index) is not int or index < 0 or (self._count is not None
                                                   and index >= self._count):
            raise ValueError(f"block {self.key}: ordinal {index!r} out of range 0.."
                             f"{'?' if self._count is None else self._count - 1}")
        if index in self._entries:
            raise ValueError(f"block {self.key}: ordinal {index} put twice (a record would be "
                             "stored twice)")
        self._append(index, record, index if position is None else position,
                     f"ordinal {index}")

    def put_at(self, position: int, record: Any) -> None:
        """Store the entry of the record at `position` in its block (a record or `DROPPED`);
        ordinals are the positions' ranks, given when the block completes. For a caller that
        knows where a record stands but not how many came before it (after a shuffle).
        Raises as `put` does (a position put twice, one more after the block completed)."""
        if not self._open_to(by_position=True, what=f"position {position}"):
            return
        if type(position) is not int:
            raise ValueError(f"block {self.key}: position must be an int, got {position!r}")
        if position in self._entries:
            raise ValueError(f"block {self.key}: position {position} put twice (a record would "
                             "be stored twice)")
        self._append(position, record, position, f"position {position}")

    def _open_to(self, *, by_position: bool, what: str) -> bool:
        """Whether an entry may be added (False: the writer gave up); refuses a completed
        block and a mix of `put` and `put_at`."""
        if self.complete:
            raise ValueError(f"block {self.key}: {what} put after the block was complete")
        if self._by_position is not None and self._by_position != by_position:
            raise ValueError(f"block {self.key}: put and put_at mixed in one block; use one")
        self._by_position = by_position
        return self.stored

    def _append(self, slot: int, record: Any, position: int, what: str) -> None:
        try:
            data = encode_record(record)
        except UncacheableRecordError as err:
            self.abort()
            raise UncacheableRecordError(f"{err} ({what} of the block)") from None
        if self._store.limit is not None and self._end + len(data) > self._store.limit:
            self._give_up(f"its records pass limit={self._store.limit} bytes")
            return
        try:
            self._file.write(data)
        except OSError as err:
            self._give_up(f"writing failed: {err}")
            return
        self._entries[slot] = (self._end, len(data), _checksum(data), position)
        self._end += len(data)
        if self._count is not None and len(self._entries) == self._count:
            self._finish()

    def expect(self, count: int) -> None:
        """The block has `count` ordinals (0..count-1); completes the file if all are in."""
        if type(count) is not int or count < 0:
            raise ValueError(f"block {self.key}: count must be an int >= 0, got {count!r}")
        if self._count is not None and count != self._count:
            raise ValueError(f"block {self.key}: count {count} given after {self._count}")
        if self._by_position:
            if len(self._entries) > count:
                raise ValueError(f"block {self.key}: {len(self._entries)} positions were put "
                                 f"but the block has {count}")
        elif beyond := [index for index in self._entries if index >= count]:
            raise ValueError(f"block {self.key}: ordinal {max(beyond)} was put but the block "
                             f"has {count}")
        self._count = count
        if self.stored and not self.complete and len(self._entries) == count:
            self._finish()

    def _finish(self) -> None:
        count = self._count
        assert count is not None
        slots = sorted(self._entries) if self._by_position else range(count)
        entries = [self._entries[slot] for slot in slots]
        positions = array("q", [entry[3] for entry in entries])
        for ordinal in range(1, count):
            if positions[ordinal] <= positions[ordinal - 1]:
                self.abort()
                raise ValueError(f"block {self.key}: ordinal {ordinal} at position "
                                 f"{positions[ordinal]} after ordinal {ordinal - 1} at "
                                 f"{positions[ordinal - 1]}: positions must increase with "
                                 "the ordinal")
        if _BIG_ENDIAN:
            positions.byteswap()
        index = b"".join(_ENTRY.pack(*entry[:3]) for entry in entries) + positions.tobytes()
        footer = _FOOTER.pack(self._end, count, _END)
        size = self._end + len(index) + len(footer)
        try:
            self._file.write(index)
            self._file.write(footer)
            self._file.flush()
            os.fsync(self._file.fileno())
            if not self._store._make_room(size):
                self._give_up(f"{size} bytes do not fit under limit={self._store.limit} "
                              "beside the blocks in use")
                return
            os.replace(self._partial, self.path)
        except OSError as err:
            self._give_up(f"writing failed: {err}")
            return
        self._file.close()
        os.close(self._lock)
        self._entries = {}
        self.complete = True
        log.debug("stored %s: %d entries, %d bytes", self.path, count, size)

    def _give_up(self, why: str) -> None:
        log.debug("not storing block %s: %s", self.key, why)
        _say_once(self._store.directory, "not stored",
                  "ds.cache: a block is not stored in %s: %s; blocks that are not stored are "
                  "computed every epoch (raise limit=, or free disk space; further blocks are "
                  "logged at DEBUG)", self._store.directory, why)
        self.abort()

    def abort(self) -> None:
        """Stop storing: remove the partial file and release the block."""
        if not self.stored or self.complete:
            return
        self.stored = False
        self._entries = {}
        with contextlib.suppress(OSError):
            self._file.close()
        self._partial.unlink(missing_ok=True)
        os.close(self._lock)

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # nothing where it completed


class BlockReader:
    """A stored block's entries: `len()`, `record(i)` (random access), iteration in ordinal
    order; entries are records or `DROPPED`; `position(i)` and `first_at(position)` map
    ordinals to positions and back. Holds the block (its lock, shared) until `close()`, so
    it is not removed while in use."""

    def __init__(self, path: Path, key: str, fd: int, lock: int) -> None:
        self.path = path
        self._fd = fd
        self._lock = lock
        size = os.fstat(fd).st_size
        if size < _HEADER.size + _FOOTER.size:
            raise CachedBlockError(f"{path}: {size} bytes, shorter than a header and a footer")
        magic, version, _, digest = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
        if magic != _MAGIC or version != FORMAT_VERSION or digest != bytes.fromhex(key):
            raise CachedBlockError(f"{path}: not a block file of format {FORMAT_VERSION} "
                                   f"for key {key} (header {magic!r}, format {version})")
        index_at, count, end = _FOOTER.unpack(os.pread(fd, _FOOTER.size, size - _FOOTER.size))
        if end != _END or index_at + count * (_ENTRY.size + _POSITION) + _FOOTER.size != size:
            raise CachedBlockError(f"{path}: footer at offset {size - _FOOTER.size} does not "
                                   f"match the file's {size} bytes")
        self._index = os.pread(fd, count * _ENTRY.size, index_at)
        self._positions = array("q")
        self._positions.frombytes(os.pread(fd, count * _POSITION, index_at + len(self._index)))
        if _BIG_ENDIAN:
            self._positions.byteswap()
        self._entries_end = index_at
        self._count = count

    def __len__(self) -> int:
        return self._count

    def record(self, index: int) -> Any:
        """The entry of ordinal `index`: a record or `DROPPED`. One read of the file."""
        if not 0 <= index < self._count:
            raise IndexError(f"{self.path}: ordinal {index} out of range 0..{self._count - 1}")
        offset, length, checksum = _ENTRY.unpack_from(self._index, index * _ENTRY.size)
        if offset < _HEADER.size or offset + length > self._entries_end:
            raise CachedBlockError(f"{self.path}: ordinal {index}: entry at offset {offset} "
                                   f"of {length} bytes lies outside the entries")
        data = os.pread(self._fd, length, offset)
        if len(data) != length or _checksum(data) != checksum:
            raise CachedBlockError(f"{self.path}: ordinal {index}: entry at offset {offset} "
                                   "does not match its checksum")
        try:
            return decode_record(data)
        except ValueError as err:
            raise CachedBlockError(f"{self.path}: ordinal {index}: entry at offset {offset}: "
                                   f"{err}") from None

    def __iter__(self) -> Iterator[Any]:
        for index in range(self._count):
            yield self.record(index)

    def line_marks(self, low: int, high: int) -> dict[int, Any]:
        """Ordinal -> `BLANK_LINE` or `BAD_LINE` for the lines without a record among
        ordinals `low`..`high`-1: only entries of one byte are read."""
        marks = {}
        unpack, size = _ENTRY.unpack_from, _ENTRY.size
        for index in range(low, high):
            if unpack(self._index, index * size)[1] == 1:
                entry = self.record(index)
                if entry is BLANK_LINE or entry is BAD_LINE:
                    marks[index] = entry
        return marks

    def position(self, index: int) -> int:
        """The position the writer gave ordinal `index`."""
        if not 0 <= index < self._count:
            raise IndexError(f"{self.path}: ordinal {index} out of range 0..{self._count - 1}")
        return self._positions[index]

    def first_at(self, position: int) -> int:
        """The first ordinal at or after `position` (`len()` where none is): where reading
        continues from a state that stands at `position`."""
        return bisect.bisect_left(self._positions, position)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._lock)  # releases the shared lock
            self._fd = -1

    def __enter__(self) -> BlockReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
