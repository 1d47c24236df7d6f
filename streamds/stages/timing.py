"""The timing seam the stages share: where a reader's time goes, stage by stage.

`Timed` wraps one stage and adds the time spent pulling each item out of it to a
`StageTimer` under the stage's name. Times nest (a stage's time includes its source's), so
`StageTimer.exclusive` subtracts each stage's source to say what the stage itself costs.
Used by `streamds bench`; a reader built without a timer pays nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["StageTimer", "Timed"]


class StageTimer:
    """Seconds per stage name, cumulative (a stage's time includes its sources')."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.order: list[str] = []  # stage names, source first

    def add(self, name: str, seconds: float) -> None:
        if name not in self.seconds:
            self.seconds[name] = 0.0
            self.order.append(name)
        self.seconds[name] += seconds

    def _nested(self, chain: Sequence[str]) -> list[str]:
        """The stages of `chain` that were timed, source first: the order their first items
        came out in (a stage's item comes out after its source's)."""
        return [name for name in self.order if name in chain]

    def exclusive(self, chain: Sequence[str]) -> dict[str, float]:
        """Each stage of `chain` without the time of the stage it pulls from (0 for a stage
        that was not timed)."""
        out, below = dict.fromkeys(chain, 0.0), 0.0
        for name in self._nested(chain):
            total = self.seconds[name]
            out[name] = max(0.0, total - below)
            below = total
        return out

    def outermost(self, chain: Sequence[str]) -> float:
        """The time of the last stage of `chain` to hand items out: all of the chain's."""
        nested = self._nested(chain)
        return self.seconds[nested[-1]] if nested else 0.0


class Timed:
    """A stage whose iteration is timed under `name`; everything else passes through."""

    BATCHES = ("batches", "batches_with_positions")  # lists of records (Records, Shuffle)

    def __init__(self, stage: Any, name: str, timer: StageTimer) -> None:
        self.stage = stage
        self.name = name
        self.timer = timer

    def __getattr__(self, attribute: str) -> Any:
        found = getattr(self.stage, attribute)
        if attribute in self.BATCHES:  # lists handed out: timed as items are
            return lambda size: self._timed(found(size))
        return found

    def reset(self, state: Any = None) -> None:
        self.stage.reset(state)

    def get_state(self) -> Any:
        return self.stage.get_state()

    def __iter__(self) -> Iterator[Any]:
        return self._timed(iter(self.stage))

    def _timed(self, items: Iterator[Any]) -> Iterator[Any]:
        clock, add, name = time.perf_counter, self.timer.add, self.name
        while True:
            start = clock()
            try:
                item = next(items)
            except StopIteration:
                add(name, clock() - start)
                return
            add(name, clock() - start)
            yield item
