"""Parquet and Arrow inputs -> records, each as the library yields it, checked to be JSON.

::

    format of the file name             # streamds.formats.registry: parquet, arrow
      -> settle(file)                   # its layout, as the library settles it: the footer;
                                        #   an Arrow stream's message headers where local, its
                                        #   schema alone where remote (rows counted as read)
      -> rows_from(file, first row)     # the format module's reader: to_pylist() records,
                                        #   its refusals by column (decimal, zoned timestamps)
      -> json_refusal(value)            # what JSON cannot hold, refused naming the column
      -> (row, JSON text, record)       # the row is the position a resume restarts at
                                        #   (decoding only its row group)

Records are what `StreamingJsonl` reads from the same file, so the shards read back to
exactly those records. A value JSON cannot hold is refused by its column, never changed:
bytes (JSON has no bytes), dates, times and durations (JSON would hold strings, the library
yields datetime objects), a map column (its pairs would come back as lists), NaN and
Infinity (JSON has none). A damaged file raises the format module's CorruptShardError,
naming the file and the row group (record batch).

A remote file is read once: an Arrow stream there is not counted first (that would
download it twice), so its progress is the bytes read so far, counted as each record batch
arrives, before its records are yielded; a rerun resuming inside it starts counting after
the batch its first row lies in (the run before counted that batch when it yielded the row).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

from streamds.formats import values
from streamds.formats.columnar import (
    Columnar,
    Layout,
    UnsupportedColumnError,
    require_pyarrow,
)
from streamds.formats.protocol import FileFacts
from streamds.formats.registry import of_file
from streamds.storage.shards import Shard

from .errors import ConversionError

__all__ = ["ColumnError", "json_refusal", "rows_of_file"]

_PLAIN = frozenset({str, int, bool, type(None)})  # JSON values as they are

_FIX = ("cast the column where the file is written, or read the file with StreamingJsonl "
        "directly (it yields the value as it is)")


class ColumnError(ConversionError):
    """A column whose values a JSON line cannot hold as the library yields them."""


def json_refusal(value: Any) -> str | None:
    """Why `value` (a `to_pylist()` value) has no JSON form that reads back the same, or
    None when it has one."""
    kind = type(value)
    if kind in _PLAIN:
        return None
    if kind is float:
        return None if math.isfinite(value) else f"{value} (JSON has no NaN or Infinity)"
    if kind is list:
        for item in value:
            why = json_refusal(item)
            if why is not None:
                return why
        return None
    if kind is dict:
        for item in value.values():
            why = json_refusal(item)
            if why is not None:
                return why
        return None
    if kind is bytes:
        return "binary (JSON has no bytes)"
    if kind is tuple:
        return "a map (its key-value pairs would read back as lists, not pairs)"
    return f"{kind.__name__} (JSON would hold a string, not a {kind.__name__})"


def _checked(path: str, row: int, record: dict[str, Any]) -> None:
    for name, value in record.items():
        if type(value) in _PLAIN:
            continue
        why = json_refusal(value)
        if why is not None:
            raise ColumnError(
                f"{path}: row {row} of the file, column {name!r}: a value of type {why}; "
                f"{_FIX}")


def _open(path: str, fs: Any, fs_path: str, size: int | None, version: str | None
          ) -> tuple[Any, int, str | None]:
    """(the file, its stored size, what identifies its content here): a local file through
    pyarrow's own file object (no Python between; not memory-mapped, so a file truncated
    while it is read is an error, not a SIGBUS), a remote one through its filesystem."""
    if fs is not None:  # read ahead as it goes: each byte fetched once (fsspec's default
        # cache for HTTP trims blocks not read yet and fetches them again)
        file = fs.open(fs_path, "rb", cache_type="readahead")
        return file, size if size is not None else int(file.size or 0), version
    file = require_pyarrow(path).OSFile(path)
    info = os.fstat(file.fileno())  # the footer cache's key: a file rewritten is another
    return file, info.st_size, f"{info.st_ino}:{info.st_mtime_ns}:{info.st_ctime_ns}"


def _layout(fmt: Columnar, file: Any, path: str, stored: int, local: bool) -> Layout:
    """The file's layout as the library settles it (`Format.settle`), read from the open
    `file`: the footer; an Arrow stream's message headers where local (a disk read), its
    schema alone where remote (counting would read all of it; `Layout.counted` is False)."""

    def read(fn: Callable[[Any], Any], _what: str) -> Any:
        return fn(file)

    def read_exact(start: int, end: int) -> bytes:
        file.seek(start)
        return file.read(end - start)

    facts = FileFacts(name=os.path.basename(path), url=path, size=stored, codec=None,
                      on_error="raise", read=read, read_exact=None if local else read_exact,
                      local=local)
    return fmt.settle(facts).layout


def rows_of_file(
    path: str, first: int, count: Callable[[int], None], *, size: int | None = None,
    fs: Any = None, fs_path: str = "", version: str | None = None,
) -> Iterator[tuple[int, bytes, dict[str, Any]]]:
    """(file row number, JSON text, record) of the Parquet or Arrow file `path` (on `fs` at
    `fs_path` when remote) from row `first`, group by group through the format module's
    reader, each stored byte read once. `count(n)` hears stored bytes read: a share of
    `size` by rows where the layout counts them, else the bytes read so far (a remote Arrow
    stream); the whole of it once the file is read."""
    fmt = of_file(path)[0]
    if not isinstance(fmt, Columnar):  # pragma: no cover - the caller names columnar files
        raise ConversionError(f"{path}: not a Parquet or Arrow file name")
    file, stored, version = _open(path, fs, fs_path, size, version)
    dumps = values.dumps
    with closing(file):
        layout = _layout(fmt, file, path, stored, local=fs is None)
        shard = Shard(url=path, path=fs_path or path, size=stored, format=fmt, codec=None,
                      layout=layout, version=version)
        total = layout.rows if layout.counted else 0
        counted = stored * first // total if total else 0
        # a rerun inside an uncounted stream: the run before counted the batch its first
        # row lies in, so counting starts after that batch
        resumed_inside = first > 0 and not layout.counted
        try:
            for row, records in fmt.rows_from(file, shard, first):
                if not layout.counted:  # the batch is read: count it before its rows go
                    done = file.tell()
                    if resumed_inside:
                        counted, resumed_inside = done, False
                    count(done - counted)
                    counted = done
                for at, record in enumerate(records, row):
                    _checked(path, at, record)
                    yield at, dumps(record), record
                if layout.counted:
                    done = stored * (row + len(records)) // total
                    count(done - counted)
                    counted = done
        except UnsupportedColumnError as err:  # the library's refusal, in convert's words
            raise ColumnError(str(err).replace(
                "or leave it out with columns=[...]",
                "or read the file with StreamingJsonl(columns=[...]) without it")) from err
        if not resumed_inside:
            count(stored - counted)  # the rest: the footer, the end of the stream
