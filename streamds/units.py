"""Byte sizes as people write and read them: ``"256MB"`` -> 256 * 10**6 -> ``"256.0 MB"``.

Shared by the command lines (``streamds``, the converter, the synthetic corpus generator);
imports only the standard library.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["human_bytes", "parse_size", "size_argument"]

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: decimal (kB, MB) and binary (KiB, MiB) units, ``B`` optional.

    >>> parse_size("1GB"), parse_size("256MiB"), parse_size("300"), parse_size("1.5k")
    (1000000000, 268435456, 300, 1500)
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 300, 10KB, 256MB, 1GB or 1GiB")
    return int(float(match[1]) * _UNITS[(match[2] or "").lower()])


def size_argument(text: str) -> int:
    """`parse_size` as an argparse ``type=``: a bad size is a usage error naming the value."""
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def human_bytes(n: float) -> str:
    """`n` bytes in decimal units.

    >>> human_bytes(512), human_bytes(3_400_000), human_bytes(7e15)
    ('512 B', '3.4 MB', '7000.0 TB')
    """
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover
