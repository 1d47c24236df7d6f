"""Argument checks shared by every public constructor: one rule, one message shape.

Each check names the parameter, the value it got and what to do, and raises `ValueError`.
"""

from __future__ import annotations

from typing import Any

from .units import parse_size

__all__ = [
    "check_bool", "check_choice", "check_int", "check_optional_int", "is_int", "size_setting",
]


def is_int(value: Any) -> bool:
    """Whether `value` is an int and not a bool (Python's True is 1; a user's True is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(
    name: str, value: Any, minimum: int, fix: str, *, maximum: int | None = None
) -> None:
    """`value` must be an int (not a bool) in [minimum, maximum]."""
    if (
        not is_int(value)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}; {fix}")


def check_optional_int(
    name: str, value: Any, minimum: int, fix: str, *, maximum: int | None = None
) -> None:
    """`value` must be None (no limit) or an int (not a bool) in [minimum, maximum]."""
    if value is not None:
        check_int(name, value, minimum, fix, maximum=maximum)


def check_bool(name: str, value: Any) -> None:
    """`value` must be True or False (not 0, 1 or "yes")."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...], fix: str = "") -> None:
    """`value` must be one of `choices`."""
    if value not in choices:
        tail = f"; {fix}" if fix else ""
        raise ValueError(f"{name} must be one of {choices}, got {value!r}{tail}")


def size_setting(name: str, value: Any, fix: str) -> int:
    """Bytes of a size setting: an int >= 0, a string such as "64MB" or "1GiB", or None/0
    (off: 0)."""
    if value is None:
        return 0
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as err:
            raise ValueError(f"{name}: {err}; {fix}") from None
    check_int(name, value, 0, f"or a size such as '64MB'; {fix}")
    return value
