"""The binary encoding of the records `ds.cache` stores (`streamds.storage.record_store`).

`encode_record` / `decode_record`: a small tagged binary format, no pickle (a cache directory
must not be able to run code in the process that reads it). It stores what a map returns:
dict, list, tuple, str, int, float, bool, None, bytes, numpy arrays and scalars and torch
tensors, nested; a value comes back equal and of the same type (an int stays an int, an array
keeps its dtype and shape, a tensor comes back a tensor, on the CPU, without its gradient). A
list or tuple of ints (token ids) is stored as one int32 array (int64 where a value needs it)
and a list of floats as one float64 array. Anything else is refused by
`UncacheableRecordError`, naming the value's place in the record and its type. The entries
that hold no record: `DROPPED` (a filter or a map removed it), `BLANK_LINE`, `BAD_LINE`.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from typing import Any

__all__ = ["BAD_LINE", "BLANK_LINE", "DROPPED", "FORMAT_VERSION", "MAX_DEPTH",
           "UncacheableRecordError", "decode_record", "encode_record"]

FORMAT_VERSION = 1  # of the file layout and the encoding: part of every key
MAX_DEPTH = 256  # nesting levels a record may have (a deeper one is refused, not overflowed)


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
