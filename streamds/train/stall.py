"""Stall: how much of a training loop is spent waiting for data.

`StallMeter(loader)` is iterated in place of the loader. It times each ``next()`` (the step
is blocked on the input pipeline: *wait*) and the gaps between batches (the caller's own
work: *step*), and reports the data-wait fraction ``wait / (wait + step)`` overall and over
the last `window` batches, plus the time to the first batch of each pass (worker start-up,
opening files, filling the shuffle buffer), which is kept apart from the steady state.

Example::

    meter = StallMeter(loader, window=50)
    for step, batch in enumerate(meter):
        train_step(batch)
        if step % 100 == 0:
            log.info("%s", meter)   # "data wait 3.1% (last 50: 2.7%) over 100 batches; ..."

A fraction near 0 means the model is the bottleneck; near 1, the input pipeline is. On a GPU
the host only notices the model's time where it synchronises (``loss.item()``, the optimizer
step with AMP), so measure with such a sync in the loop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..checks import check_int

__all__ = ["StallMeter"]


class StallMeter:
    """Iterates `loader` and times waiting for batches vs the work between them.

    Costs three clock reads per batch. Counters are cumulative over every pass; `reset()`
    clears them. `clock` is injectable for tests (default `time.perf_counter`).
    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        window: int = 100,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(loader, Iterable):
            raise ValueError(f"loader must be iterable, got {loader!r}")
        check_int("window", window, 1, "the number of recent batches to average over")
        self.loader = loader
        self.window = window
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Forget everything measured so far."""
        self.batches = 0  # batches handed over, first batches of passes included
        self.wait_s = 0.0  # steady-state time blocked in next()
        self.step_s = 0.0  # time between a batch and the next request
        self.startup_s: list[float] = []  # time to the first batch, one per pass
        self.last_wait_s = 0.0
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.window)
        self._pending_step: float | None = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return self._measure(iter(self.loader))

    def _measure(self, batches: Iterator[Any]) -> Iterator[Any]:
        clock = self._clock
        first = True
        handed = None  # when the last batch was handed over
        while True:
            asked = clock()
            if handed is not None:
                step = asked - handed
                self.step_s += step
                self._pending_step = step
            try:
                batch = next(batches)
            except StopIteration:
                return
            got = clock()
            wait = got - asked
            self.batches += 1
            self.last_wait_s = wait
            if first:
                self.startup_s.append(wait)
                first = False
            else:
                self.wait_s += wait
                self._recent.append((wait, self._pending_step or 0.0))
            handed = clock()
            yield batch

    # -- reports -------------------------------------------------------------------------

    @property
    def first_batch_s(self) -> float | None:
        """Time to the first batch of the first pass (None before any batch)."""
        return self.startup_s[0] if self.startup_s else None

    @property
    def wait_fraction(self) -> float:
        """Steady-state share of the loop spent waiting for data (first batches excluded)."""
        total = self.wait_s + self.step_s
        return self.wait_s / total if total > 0 else 0.0

    @property
    def recent_wait_fraction(self) -> float:
        """Share of waiting over the last `window` batches."""
        wait = sum(w for w, _ in self._recent)
        total = wait + sum(s for _, s in self._recent)
        return wait / total if total > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Plain numbers, for logs and JSON."""
        steady = max(0, self.batches - len(self.startup_s))
        return {
            "batches": self.batches,
            "first_batch_s": self.first_batch_s,
            "startup_s": sum(self.startup_s),
            "wait_s": self.wait_s,
            "step_s": self.step_s,
            "wait_fraction": self.wait_fraction,
            "recent_wait_fraction": self.recent_wait_fraction,
            "window": self.window,
            "mean_wait_ms": 1000 * self.wait_s / steady if steady else 0.0,
            "mean_step_ms": 1000 * self.step_s / self.batches if self.batches else 0.0,
        }

    def __str__(self) -> str:
        s = self.summary()
        first = "-" if s["first_batch_s"] is None else f"{s['first_batch_s']:.2f} s"
        recent = min(self.window, len(self._recent))
        return (
            f"data wait {100 * s['wait_fraction']:.1f}% (last {recent}: "
            f"{100 * s['recent_wait_fraction']:.1f}%) over {s['batches']} batches; "
            f"first batch {first}; {s['mean_wait_ms']:.1f} ms wait / "
            f"{s['mean_step_ms']:.1f} ms step per batch"
        )

    def __repr__(self) -> str:
        return f"StallMeter({self})"
