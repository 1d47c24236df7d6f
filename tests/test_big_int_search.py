"""The search for integers beyond 64 bits over a whole chunk (`values.big_int_starts`, used by
`values.loads_many` on the buffer the reader cut the lines from) finds what a search of
every line finds, so parsing a chunk at once reads the same values, and refuses the same
lines, as parsing it line by line: big integers at chunk edges, in strings and keys,
negative, nested, next to long fractions and exponents (``1e400`` included)."""

from __future__ import annotations

import io
import json
import re
from typing import Any
from unittest.mock import patch

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamds.formats import jsonl, values
from streamds.formats.jsonl import CutLines
from streamds.stages.chunks import Chunk
from streamds.stages.parse import BAD, BLANK, parse_chunk
from streamds.storage.plan import Block
from streamds.storage.read import read_lines
from streamds.storage.shards import Shard

# a run of 19 or more digits after no digit, ".", "e" or "E": what the search must find
EVERY_RUN = re.compile(rb"(?<![0-9.eE])[0-9]{19,}")

# -- the search alone -------------------------------------------------------------------------

digit_runs = st.integers(1, 45).flatmap(
    lambda n: st.text("0123456789", min_size=n, max_size=n)).map(str.encode)
between = st.text(' ,:[]{}"-+.eEx\n', max_size=4).map(str.encode)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(digit_runs, between), max_size=40), st.sampled_from([0, 1 << 30]))
def test_the_search_finds_every_run_a_scan_of_every_byte_finds(pieces, numpy_from):
    """With the sample taken by numpy (a chunk) and by bytes methods (a line)."""
    data = b"".join(pieces)
    with patch.object(values, "_NUMPY_FROM", numpy_from):
        assert values.big_int_starts(data) == [m.start() for m in EVERY_RUN.finditer(data)]


@pytest.mark.parametrize("numpy_from", [0, 1 << 30])
def test_the_search_finds_a_run_at_every_alignment_of_the_sample(numpy_from, monkeypatch):
    monkeypatch.setattr(values, "_NUMPY_FROM", numpy_from)
    for before in range(13):
        for length in (19, 20, 25):
            data = b"x" * before + b"1" * length + b"x" * 7
            assert values.big_int_starts(data) == [before], (before, length)
            data = b"-" * 20_000 + data  # a chunk's size
            assert values.big_int_starts(data) == [20_000 + before], (before, length)
    assert values.big_int_starts(b"1" * 18) == []
    assert values.big_int_starts(b"0." + b"1" * 30) == []  # a float's fraction
    assert values.big_int_starts(b"1e" + b"1" * 30 + b" -" + b"2" * 19) == [34]


# -- a chunk at once against line by line -----------------------------------------------------

def _number(sign: str, whole: str, fraction: str, exponent: str) -> str:
    return sign + whole + (f".{fraction}" if fraction else "") + exponent


def _digits(low: int, high: int) -> st.SearchStrategy[str]:
    return st.text("0123456789", min_size=low, max_size=high)


numbers = st.builds(
    _number,
    st.sampled_from(["", "-"]),
    st.one_of(st.just("0"), st.builds(str.__add__, st.sampled_from("123456789"),
                                      _digits(0, 40))),
    st.one_of(st.just(""), _digits(1, 40)),
    st.one_of(st.just(""), st.builds(str.__add__, st.sampled_from(["e", "E", "e+", "e-"]),
                                     _digits(1, 25))),
)
strings = st.text("0123456789 .eE-ab", max_size=30).map(json.dumps)
scalars = st.one_of(numbers, strings, st.sampled_from(["null", "true", "false"]))
json_texts = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
        st.lists(st.tuples(strings, inner), max_size=4).map(
            lambda pairs: "{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"),
    ),
    max_leaves=8,
)
records = st.lists(st.tuples(strings, json_texts), max_size=4).map(
    lambda pairs: "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}")
lines = st.one_of(records, records, records, json_texts, st.sampled_from(["", "  "])).map(
    str.encode)


def _line_by_line(line: bytes) -> Any:
    """What one line parses to on the per-line path: its value, BLANK, or BAD."""
    try:
        value = values.loads(line)
    except orjson.JSONDecodeError:
        return BLANK if not line.strip() else BAD
    return value if type(value) is dict else BAD


def _same(got: list[Any], want: list[Any]) -> None:
    """Equal, markers the same, and every number of the same type (10**29 == 1e29)."""
    assert got == want
    assert [type(item) for item in got] == [type(item) for item in want]
    assert repr(got) == repr(want)


def _opener(data: bytes):
    def open_at(shard: Shard, offset: int, end: int | None = None, **_: Any) -> io.BytesIO:
        return io.BytesIO(data[offset:])
    return open_at


@settings(max_examples=300, deadline=None)
@given(st.lists(lines, min_size=1, max_size=12), st.booleans(), st.integers(1, 300),
       st.integers(0, 400), st.sampled_from([0, 64]))
def test_a_chunk_parses_as_its_lines_one_by_one(file_lines, final_newline, read_size, cut,
                                                few_lines):
    """The reader's chunks (lines cut at every read size, the block ending anywhere; their
    newlines found one by one, and all at once) parse to what each line parses to alone."""
    data = b"\n".join(file_lines) + (b"\n" if final_newline else b"")
    shard = Shard(url="memory://big.jsonl", path="big.jsonl", size=len(data), format="jsonl",
                  codec=None)
    block = Block(0, 0, cut if cut < len(data) else None)
    got: list[Any] = []
    want: list[Any] = []
    with patch.object(jsonl, "_FEW_LINES", few_lines):
        chunks = list(read_lines(shard, block, 0, opener=_opener(data), read_size=read_size))
    for raw in chunks:
        chunk = Chunk(0, 0, raw.offsets, raw.lines, False, data=raw.data)
        assert isinstance(raw.lines, CutLines)  # found one by one, or all at once
        items, _ = parse_chunk(chunk, on_error="skip", url=shard.url,
                               locate=lambda index: (None, "?"))
        if BAD not in items and BLANK not in items:
            assert not raw.lines.cut  # read in place: never copied out
        assert raw.lines == raw.data.split(b"\n")[: len(raw.lines)]
        got += items
        want += [_line_by_line(line) for line in raw.lines]
    _same(got, want)
    for line, item in zip(file_lines, got, strict=False):  # what Python's json reads
        if isinstance(item, dict):
            assert item == json.loads(line) and repr(item) == repr(json.loads(line))


@settings(max_examples=300, deadline=None)
@given(st.lists(records.map(str.encode), min_size=1, max_size=8), st.binary(max_size=40),
       st.sampled_from([b"", b"1" * 19, b"-" + b"9" * 30]))
def test_the_bytes_after_the_last_line_are_not_read(chunk_lines, more, run):
    """A block's last chunk stops at the line crossing its end; the rest of the read buffer
    (a run of digits included) belongs to no line of the chunk."""
    data = b"\n".join(chunk_lines) + b"\n" + run + more
    try:
        got, _ = values.loads_many(chunk_lines, data)
    except orjson.JSONDecodeError:
        assert BAD in [_line_by_line(line) for line in chunk_lines]
        return
    _same(got, [_line_by_line(line) for line in chunk_lines])
    joined, _ = values.loads_many(chunk_lines)
    _same(joined, got)


def test_a_big_int_on_a_chunk_edge_is_exact():
    big = b'{"n": -123456789012345678901234567890}'
    head = b'{"a": "x"}'
    data = head + b"\n" + big  # the run ends the buffer: no newline after it
    got, whole = values.loads_many([head, big], data)
    assert whole and got == [{"a": "x"}, {"n": -123456789012345678901234567890}]
    assert type(got[1]["n"]) is int
