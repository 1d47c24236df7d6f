"""streamds.units: byte sizes parsed from and written for people."""

from __future__ import annotations

import doctest

import pytest

from streamds import units
from streamds.units import human_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [("300", 300), ("10KB", 10_000), ("256MB", 256_000_000), ("1GB", 10**9), ("1gb", 10**9),
     ("1.5GB", 1_500_000_000), ("1GiB", 2**30), ("64 MiB", 64 * 2**20), ("2k", 2000)],
)  # fmt: skip
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "1XB", "-1MB", "1 G B"])
def test_parse_size_refuses_garbage(text):
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("size", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (1_234_567, "1.2 MB"), (10**9, "1.0 GB"),
     (2.5e12, "2.5 TB"), (3e15, "3000.0 TB"), (-2000, "-2.0 kB")],
)  # fmt: skip
def test_human_bytes(size, text):
    assert human_bytes(size) == text


def test_docstring_examples():
    result = doctest.testmod(units)
    assert result.attempted >= 2 and result.failed == 0
