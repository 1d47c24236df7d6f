"""Transform: the user's map and filter steps, applied in the workers (in-stream preprocessing).

Steps compose into one function per record, run over a whole chunk in one comprehension. A
map returning None, or a filter returning a false value, turns the record into `DROPPED`,
which is counted here. For exact resume, steps must be deterministic functions of the record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .chunks import Chunk
from .parse import DROPPED, Marker

__all__ = ["Composed", "Step", "Transform", "compose", "transform_items"]

Step = tuple[str, Callable[[Any], Any]]  # ("map", fn) or ("filter", predicate)


class Composed:
    """`steps` applied in order to one record; counts the records it drops in `dropped`
    (so a chunk's cleanliness is known without comparing items to a marker)."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = tuple(steps)
        self.dropped = 0

    def __call__(self, record: Any) -> Any:
        for kind, fn in self.steps:
            if kind == "map":
                record = fn(record)
                if record is None:
                    self.dropped += 1
                    return DROPPED
            elif not fn(record):
                self.dropped += 1
                return DROPPED
        return record


def compose(steps: Sequence[Step]) -> Composed | None:
    """One function applying `steps` in order, or None when there are none."""
    return Composed(steps) if steps else None


def transform_items(apply: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """`items` with `apply` run on every record; markers pass through untouched."""
    return [item if item.__class__ is Marker else apply(item) for item in items]


class Transform:
    """Stage: chunks of records -> chunks of transformed records (DROPPED where removed).

    State: ``{"source": ..., "counts": {"dropped": n}}``.
    """

    SOURCE = "source"
    COUNTS = "counts"

    def __init__(self, source: Any, steps: Sequence[Step]) -> None:
        self.source = source
        self.apply = compose(steps)
        self.reset()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        self.source.reset(None if state is None else state[self.SOURCE])
        self._dropped = 0 if state is None else state[self.COUNTS]["dropped"]

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE: self.source.get_state(), self.COUNTS: {"dropped": self._dropped}}

    @property
    def counts(self) -> dict[str, int]:
        return {**self.source.counts, "dropped": self._dropped}

    def transform(self, chunk: Chunk) -> Chunk:
        """`chunk` with the steps applied (also used to re-read buffered records)."""
        apply = self.apply
        if apply is None:
            return chunk
        before = apply.dropped
        if chunk.clean:  # every item a record: no marker checks per item
            items = [apply(item) for item in chunk.items]
        else:
            items = transform_items(apply, chunk.items)
        clean = chunk.clean and apply.dropped == before
        return Chunk(chunk.item, chunk.block, chunk.offsets, items, clean, chunk.labels)

    def __iter__(self) -> Iterator[Chunk]:
        apply = self.apply
        for chunk in self.source:
            before = 0 if apply is None else apply.dropped
            out = self.transform(chunk)
            if apply is not None:
                self._dropped += apply.dropped - before
            yield out
