"""Transform: the user's map and filter steps, applied in the workers (in-stream preprocessing).

Steps compose into one function per record. A map returning None, or a filter returning a
false value, turns the record into `DROPPED`, which the stream counts. For exact resume,
steps must be deterministic functions of the record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .parse import DROPPED, Marker

__all__ = ["Step", "compose", "transform_items"]

Step = tuple[str, Callable[[Any], Any]]  # ("map", fn) or ("filter", predicate)


def compose(steps: Sequence[Step]) -> Callable[[Any], Any] | None:
    """One function applying `steps` in order, or None when there are none."""
    if not steps:
        return None

    def apply(record: Any) -> Any:
        for kind, fn in steps:
            if kind == "map":
                record = fn(record)
                if record is None:
                    return DROPPED
            elif not fn(record):
                return DROPPED
        return record

    return apply


def transform_items(apply: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """`items` with `apply` run on every record; markers pass through untouched."""
    return [item if item.__class__ is Marker else apply(item) for item in items]
