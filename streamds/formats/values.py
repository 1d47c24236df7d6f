"""Values: JSON bytes -> Python values exactly as the file holds them, and back; and what to
say about bytes that are not a record.

orjson is fast but differs from Python's `json` in two ways that would change or refuse
data: it reads an integer beyond 64 bits (``123456789012345678901234567890``,
``-9223372036854775809``) as a float, and it refuses a lone surrogate escape
(``"\\ud800"``, which ``json.dumps`` writes). `loads` reads such bytes with `json` instead:
a lone surrogate only on orjson's error path, a big integer when the bytes hold a run of 19
digits (the shortest integer orjson cannot read exactly). `big_int_starts` finds those runs
at C speed (a sample of one byte in six rules out most data); `loads_many` searches a whole
chunk of lines at once, so only the lines that hold such a run are read twice. NaN and
Infinity, which `json` accepts and JSON does not, stay refused (`explain` says so). `dumps`
writes what `loads` reads back.

A record is a JSON object: `is_record` / `not_a_record` say so for parsed values.
`explain` turns a line orjson refused into what the file looks like and what to do (NUL
bytes of an interrupted write, UTF-16, CR-only line endings, pretty-printed JSON, Parquet,
NaN), and `snippet` quotes a bad line without dumping a run of NUL bytes.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from operator import add
from typing import Any

import numpy as np
import orjson

__all__ = [
    "BIG_INT_DIGITS",
    "big_int_lines",
    "big_int_lines_of",
    "big_int_starts",
    "dumps",
    "explain",
    "has_big_int",
    "is_record",
    "loads",
    "loads_many",
    "not_a_record",
    "snippet",
    "try_loads",
]

BIG_INT_DIGITS = 19  # -9223372036854775809: the shortest integer orjson reads as a float
_STRIDE = 6  # a run of 19 digits holds three neighbouring samples taken 6 bytes apart
_SAMPLED = b"000"
# digits -> "0"; what may precede a float's fraction or exponent digits -> "."; the rest " "
_CLASSES = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x2E if byte in b".eE" else 0x20
                 for byte in range(256))
_RUN = b"0" * BIG_INT_DIGITS
_AFTER_OTHER = b" " + _RUN  # a run after a byte that is no digit, ".", "e" or "E"
_NUMPY_FROM = 8 << 10  # bytes from which numpy takes the sample faster than bytes methods
_SNIPPET = 80  # bytes of a bad line quoted in a message


def _sample_has_run(data: bytes | memoryview) -> bool:
    """Whether three neighbouring bytes of the sample of every `_STRIDE`th byte of `data`
    are digits (numpy's vector loops for a chunk, bytes methods for a line)."""
    if len(data) < _NUMPY_FROM:
        return bytes(data[::_STRIDE]).translate(_CLASSES).find(_SAMPLED) >= 0
    digits = (np.frombuffer(data, np.uint8)[::_STRIDE] - 0x30) < 10  # below "0" wraps
    return bool((digits[:-2] & digits[1:-1] & digits[2:]).any())


def big_int_starts(data: bytes | memoryview) -> list[int]:
    """Where in `data` each run of `BIG_INT_DIGITS` or more digits begins that follows no
    digit, ``.``, ``e`` or ``E``: each integer orjson may read as a float (the run may also
    be digits in a string, or a float's integer part: `json` then reads the same values).
    Ascending; ``[]`` for most data at a fraction of parsing's cost: a run of 19 digits
    holds three neighbouring bytes of a sample of every 6th byte, which text rarely does by
    chance (a float's 17 digits may), and only data with such a sample is searched whole."""
    if not _sample_has_run(data):
        return []
    classes = bytes(data).translate(_CLASSES)  # (data may be a memoryview: a ring's pages)
    starts = [0] if classes.startswith(_RUN) else []
    at = classes.find(_AFTER_OTHER)
    while at >= 0:
        starts.append(at + 1)
        at = classes.find(_AFTER_OTHER, at + len(_AFTER_OTHER))  # the next run, after this
    return starts


def has_big_int(data: bytes) -> bool:
    """Whether `data` holds an integer orjson may read as a float (`big_int_starts`)."""
    return bool(big_int_starts(data))


class _Refused(ValueError):
    """A value `json` reads and JSON does not allow (NaN, Infinity, a float out of range)."""


def _refuse_constant(name: str) -> Any:
    raise _Refused(name)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(text)
    return value


def _python_loads(data: bytes | memoryview) -> Any:
    """`json.loads` of UTF-8 `data`, refusing NaN, Infinity and floats out of range as
    orjson does; raises ValueError (UnicodeDecodeError, JSONDecodeError, `_Refused`)."""
    text = bytes(data).decode("utf-8")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError:  # nested deeper than Python's recursion limit lets json go
        return _deep_loads(text)


_DEEPER = threading.Lock()
ORJSON_DEPTH = 1024  # orjson refuses deeper values, so none of those reaches json here


def _deep_loads(text: str) -> Any:
    """`json.loads` of a value nested up to ORJSON_DEPTH levels (a big integer deep inside
    arrays), with the recursion limit raised for the call; still too deep: an
    `orjson.JSONDecodeError`, which the parse stage reports as a bad line (on_error)."""
    with _DEEPER:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + ORJSON_DEPTH + 64)
        try:
            return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
        except RecursionError:
            raise orjson.JSONDecodeError(
                f"nested too deeply: deeper than {ORJSON_DEPTH} levels", text, 0) from None
        finally:
            sys.setrecursionlimit(limit)


def _may_hold_surrogate(data: bytes | memoryview) -> bool:
    data = bytes(data)
    return b"\\ud" in data or b"\\uD" in data


def loads(data: bytes | memoryview) -> Any:
    """The JSON value in `data`, as Python's `json.loads` reads it (every integer exact, lone
    surrogate escapes kept), with NaN and Infinity refused. Raises `orjson.JSONDecodeError`."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        if not _may_hold_surrogate(data):
            raise
        try:
            return _python_loads(data)
        except ValueError:
            pass
        raise  # orjson's error: it says where
    if has_big_int(bytes(data)):
        return _python_loads(data)
    return value


def try_loads(data: bytes | memoryview) -> tuple[Any, orjson.JSONDecodeError | None]:
    """(value, None) as `loads` reads `data`, or (None, the error) where it is no JSON."""
    try:
        return loads(data), None
    except orjson.JSONDecodeError as err:
        return None, err


def big_int_lines(data: bytes | memoryview, ends: Sequence[int]) -> list[int]:
    """The indexes of the lines of `data` (each ends where `ends` says, the next begins one
    byte later) that hold a run `big_int_starts` finds: the lines `loads_many` reads with
    `json`. Ascending; ``[]`` for most data."""
    return _lines_holding(big_int_starts(data), ends)


def big_int_lines_of(pieces: Sequence[bytes | memoryview], ends: Sequence[int]) -> list[int]:
    """`big_int_lines` of the pieces joined, each searched where it lies (a piece of
    ``b"\\n"``, between lines, holds no run)."""
    starts: list[int] = []
    at = 0
    for piece in pieces:
        if len(piece) > 1:
            starts += (at + start for start in big_int_starts(piece))
        at += len(piece)
    return _lines_holding(starts, ends)


def _lines_holding(starts: list[int], ends: Sequence[int]) -> list[int]:
    """The indexes of the lines (each ends where `ends` says, the next begins one byte
    later) in which the runs at `starts` begin."""
    if not starts:
        return []
    begins = [0, *(int(end) + 1 for end in ends)]  # no run spans two lines
    lines = {bisect_right(begins, start) - 1 for start in starts}
    return sorted(index for index in lines if index < len(ends))


def loads_many(lines: Sequence[bytes], data: bytes | memoryview | None = None,
               ends: Sequence[int] | None = None, *, big_lines: Sequence[int] | None = None,
               ) -> tuple[list[Any], bool]:
    """``[loads(line) for line in lines]`` at orjson's speed, and whether every value is a
    record (a JSON object). One search over all the lines finds big integers
    (`big_int_starts`); only the lines it finds are read again, by `json`. `data`: the
    bytes the lines were cut from (``lines == data.split(b"\\n")[:len(lines)]``), searched
    in place of the lines joined; with `ends` (where each line ends in `data`) the lines are
    read in place, through a memoryview, and `lines` is not touched. `big_lines` (with
    `data` and `ends`): `big_int_lines(data, ends)`, found already by whoever joined the
    lines (a DataLoader worker: `streamds.stages.parse_later`), so no search here. Raises
    `orjson.JSONDecodeError` if orjson refuses a line: the caller then goes line by line."""
    loaded = orjson.loads
    if data is not None and ends is not None:
        view = memoryview(data)
        begins = [0, *map((1).__add__, ends)]  # where each line begins, then the end
        values = [loaded(view[begin:end]) for begin, end in zip(begins, ends, strict=False)]
        if big_lines is None:
            big_lines = big_int_lines(data, ends)
        for index in big_lines:
            values[index] = _python_loads(view[begins[index] : ends[index]])
        return values, is_record(values)
    values = [loaded(line) for line in lines]
    starts = big_int_starts(b"\n".join(lines) if data is None else data)
    if starts:  # no run spans two lines: find each run's line by where the lines begin
        begins = list(accumulate(map((1).__add__, map(len, lines)), add, initial=0))
        for index in sorted({bisect_right(begins, start) - 1 for start in starts}):
            if index < len(values):
                values[index] = _python_loads(lines[index])
    return values, is_record(values)


def dumps(value: Any) -> bytes:
    """Compact JSON that `loads` reads back to `value`: orjson's, or `json`'s for what orjson
    will not write (integers beyond 64 bits, strings with lone surrogates, written escaped).
    Raises TypeError for a value that is not JSON, ValueError for NaN or Infinity (orjson
    writes those as null, which would change the value without a word)."""
    try:
        out = orjson.dumps(value)
    except TypeError as err:
        try:
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False)
        except TypeError:
            raise err from None
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: escaped, as json.dumps writes it
            return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("ascii")
    if b"null" in out and _holds_non_finite(value):  # NaN and Infinity come out as null
        raise ValueError("Out of range float values are not JSON compliant: NaN or Infinity; "
                         "write null (or a string) for them instead")
    return out


def _holds_non_finite(value: Any) -> bool:
    """Whether a NaN or an infinite float stands anywhere in `value`."""
    kind = type(value)
    if kind is float:
        return not math.isfinite(value)
    if kind is dict:
        value = value.values()
    elif kind is not list and kind is not tuple:
        return isinstance(value, float) and not math.isfinite(value)
    return any(_holds_non_finite(item) for item in value
               if type(item) in (float, dict, list, tuple) or isinstance(item, float))


# -- records ----------------------------------------------------------------------------


def is_record(values: Sequence[Any]) -> bool:
    """Whether every value is a JSON object (a dict): what a record is."""
    return all(map(dict.__instancecheck__, values)) if values else True


_KINDS = {list: "a JSON array", str: "a JSON string", int: "a JSON number",
          float: "a JSON number", bool: "true or false", type(None): "null"}


def not_a_record(value: Any) -> str:
    """What a parsed value that is not an object holds, and what to do, for a message."""
    kind = _KINDS.get(type(value), type(value).__name__)
    more = ""
    if isinstance(value, list):
        more = ("; a file that is one JSON array of records is read as its elements when "
                "named .json")
    return (f"holds {kind}, not a JSON object: a record is an object ({{...}}); write each "
            f"record as an object (e.g. {{\"text\": ...}}){more}")


# -- what a bad line looks like ------------------------------------------------------------


def snippet(line: bytes) -> str:
    """The start of `line` for a message; a run of NUL bytes is counted, not quoted."""
    nul = line.find(b"\x00")
    if nul < 0 or _utf16(line):
        return repr(line[:_SNIPPET])
    run = len(line) - nul - len(line[nul:].lstrip(b"\x00"))
    rest = len(line) - nul - run
    head = repr(line[: min(nul, _SNIPPET)])
    return f"{head} then {run} NUL bytes" + (f" and {rest} more bytes" if rest else "")


def _utf16(line: bytes) -> bool:
    """Whether `line` looks like UTF-16 text: a byte-order mark, or ASCII with a NUL byte
    beside every character."""
    if line.startswith((b"\xff\xfe", b"\xfe\xff")):
        return True
    head = line[:64]
    if len(head) < 4:
        return False
    even, odd = head[0::2], head[1::2]
    return (even.count(0) >= 0.8 * len(even) and odd.count(0) <= 0.2 * len(odd)) or (
        odd.count(0) >= 0.8 * len(odd) and even.count(0) <= 0.2 * len(even))


def _cr_only(line: bytes) -> bool:
    if b"\r" not in line:
        return False
    first, rest = line.split(b"\r", 1)
    if not first.strip() or not rest.strip(b" \t\r"):
        return False
    try:
        orjson.loads(first)
    except orjson.JSONDecodeError:
        return False
    return True


def _nan(line: bytes) -> bool:
    try:
        json.loads(line.decode("utf-8"), parse_constant=_refuse_constant)
    except _Refused:
        return True
    except (ValueError, RecursionError):
        return False
    return False


def _goes_on(line: bytes, err: Exception) -> bool:
    """Whether `line` is the start of a JSON value that goes on after it."""
    pos = getattr(err, "pos", None)
    text = line.decode("utf-8", "replace").rstrip()
    return pos is not None and bool(text.strip()) and pos >= len(text)


def explain(line: bytes, err: Exception, *, offset: int | None, file_start: bool) -> str:
    """What `line` (refused by orjson with `err`) looks like and what to do, as a clause for
    a message ("" when nothing is recognised). `offset`: the decoded byte where the line
    begins (None: not a byte offset); `file_start`: the line is a file's first."""
    if file_start and line.startswith(b"PAR1"):
        return ("the file is Parquet (it begins with PAR1), not JSON lines; convert it first, "
                "e.g. pandas.read_parquet(path).to_json(out, orient='records', lines=True, "
                "force_ascii=False)")
    if _utf16(line):
        return ("the file looks UTF-16 encoded (a byte-order mark FF FE / FE FF, or a NUL "
                "byte beside every character); streamds reads UTF-8: re-encode it, e.g. "
                "iconv -f UTF-16 -t UTF-8 IN > OUT, or in Python "
                "open(out, 'w', encoding='utf-8').write(open(path, encoding='utf-16').read())")
    nul = line.find(b"\x00")
    if nul >= 0:
        at = f"byte offset {offset + nul}" if offset is not None else f"byte {nul} of the line"
        tail = not line[nul:].strip(b"\x00")
        where = "ends in" if tail else "holds"
        cut = f"truncate it before {at} (e.g. truncate -s {offset + nul} FILE) or " if (
            tail and offset is not None) else ""
        return (f"the line {where} NUL bytes from {at}: a write that was interrupted (a "
                "crash, a full disk, a copy cut short) leaves a file ending in NUL bytes on "
                f"some filesystems; {cut}copy the file again from its source")
    if _cr_only(line):
        return ("the file uses CR-only line endings (\\r, classic Mac), so its lines read as "
                "one; convert them to \\n, e.g. tr '\\r' '\\n' < IN > OUT, or in Python "
                "data.replace(b'\\r', b'\\n')")
    if _nan(line):
        return ("the line holds NaN or Infinity, which JSON does not allow (Python's "
                "json.dumps writes them unless allow_nan=False); write null (or a string) "
                "for them instead")
    if _goes_on(line, err) and not file_start:  # records before it ended on their lines
        return ("the line ends before its JSON value does: it was cut short (a write or copy "
                "that was interrupted leaves the last line so); copy the file again from its "
                "source, or pass on_error='skip' to skip and count it")
    if _goes_on(line, err):
        return ("the line holds the start of a JSON value that goes on over the next lines: "
                "the file looks like pretty-printed JSON (one document, e.g. an array), not "
                "JSON lines; name it .json to read it as one document (an array as its "
                "elements), or write one record per line (e.g. jq -c '.[]' IN > OUT)")
    return ""
