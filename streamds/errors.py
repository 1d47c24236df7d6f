"""Errors raised by streamds. Each subclasses a built-in so callers can catch it generically."""

from __future__ import annotations

__all__ = ["CorruptRecordError", "CorruptShardError", "MissingCodecError", "StateMismatchError"]


class CorruptRecordError(ValueError):
    """A line that is not valid JSON; the message names the file, the 1-based line, the offset."""

    def __init__(self, message: str, *, url: str, line: int | None, offset: int) -> None:
        super().__init__(message)
        self.url = url
        self.line = line
        self.offset = offset


class CorruptShardError(OSError):
    """A shard that cannot be decoded (truncated or damaged compressed data)."""

    def __init__(self, message: str, *, url: str, offset: int) -> None:
        super().__init__(message)
        self.url = url
        self.offset = offset


class MissingCodecError(ImportError):
    """A compressed shard whose codec library is not installed."""


class StateMismatchError(ValueError):
    """A state_dict that was taken from a different source, seed, format or world."""
