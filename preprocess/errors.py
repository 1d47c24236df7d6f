"""The converter's error: bad input or an output directory it cannot use."""

from __future__ import annotations

__all__ = ["ConversionError"]


class ConversionError(ValueError):
    """Bad input or an output directory that cannot be used; the message says where and why."""
