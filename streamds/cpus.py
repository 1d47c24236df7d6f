"""Which CPUs a DataLoader worker runs on, so that the main process can keep one to itself.

The main process builds every record it receives (it parses the lines of plain batches and
unpickles the rest) and then runs the training step; a worker that the OS schedules on its CPU
takes turns with it, and the processes move between CPUs. Measured on 2 CPUs (README, "Workers
and CPUs"): a worker kept off one CPU made 1 worker 10-17% faster on every corpus; with 2
workers it made the main-bound PubMed batches 11-20% faster but small lines shuffled in the
workers 15-20% slower, and a tokenizing pipeline, where the workers are the slower side, needs
every CPU for them. So, with ``worker_cpus="auto"``:

- the workers fit beside the main processes (``local processes * (workers + 1) <= CPUs``):
  each worker keeps off the first CPUs of its affinity set, one per main process on this
  machine, from its start (`plan_cpus` -> FIT);
- they do not: each worker measures how fast it hands out items with every CPU and with those
  kept free, in phases all / spare / spare / all of PHASE seconds after WARM_UP seconds, keeps
  the spare set only when it was MARGIN faster, and measures again every RETUNE seconds
  (`TuneCpus`). The workers start together and hand out items in turn, so each one sees the
  loader's whole rate and they decide alike.

Only the speed changes: which records come out, in which order, never depends on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FIT", "KEEP", "TUNE", "CpuPlan", "TuneCpus", "plan_cpus", "set_cpus", "worker_cpus",
]

WORKER_CPUS = ("auto", "all")  # StreamingJsonl(worker_cpus=...)

KEEP, FIT, TUNE = "keep", "fit", "tune"
WARM_UP = 0.25  # seconds handed out before the first measurement (buffers fill, caches warm)
PHASE = 0.4  # seconds per measured phase
RETUNE = 60.0  # seconds between measurements
MARGIN = 1.03  # the spare set must be this much faster to be kept


@dataclass(frozen=True)
class CpuPlan:
    """What a worker does with its CPUs: KEEP them, keep off `main` from the start (FIT), or
    TUNE between `every` and `every - main`."""

    how: str
    every: frozenset[int] = frozenset()
    main: frozenset[int] = frozenset()

    @property
    def spare(self) -> frozenset[int]:
        return self.every - self.main


_STARTED_ON: frozenset[int] | None = None  # this process's CPUs before any change of ours


def plan_cpus(workers: int, local_processes: int, every: Iterable[int] | None = None) -> CpuPlan:
    """The plan for one of `workers` DataLoader workers of each of `local_processes` training
    processes on this machine, whose CPUs are `every` (default: the ones this process started
    with, which a persistent worker's next epoch must not take from its own last choice)."""
    global _STARTED_ON
    if every is None:
        if not hasattr(os, "sched_getaffinity"):  # not Linux: the OS decides
            return CpuPlan(KEEP)
        if _STARTED_ON is None:
            _STARTED_ON = frozenset(os.sched_getaffinity(0))
        every = _STARTED_ON
    every = frozenset(every)
    main = frozenset(sorted(every)[:local_processes])
    if len(every) - len(main) < 1:
        return CpuPlan(KEEP, every, main)
    fits = local_processes * (workers + 1) <= len(every)
    return CpuPlan(FIT if fits else TUNE, every, main)


def set_cpus(cpus: Iterable[int]) -> None:
    """Run every thread of this process on `cpus` (sched_setaffinity sets one thread)."""
    cpus = set(cpus)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # a thread that ended in between
            continue


class TuneCpus:
    """Stage: the items of `source`, unchanged, while it measures how fast they are taken with
    `plan.every` and with `plan.spare` CPUs and runs on the faster (see the module docstring).

    `clock` and `apply` are seams for tests. Holds no state: a resumed worker measures anew.
    """

    def __init__(self, source: Iterable[Any], plan: CpuPlan, *,
                 clock: Callable[[], float] = time.perf_counter,
                 apply: Callable[[frozenset[int]], None] = set_cpus) -> None:
        self.source = source
        self.plan = plan
        self.clock = clock
        self.apply = apply
        self.chosen: list[frozenset[int]] = []  # each measurement's choice, for tests and logs

    def __iter__(self) -> Iterator[Any]:
        items = iter(self.source)
        plan, clock = self.plan, self.clock
        if (yield from _for(items, clock, WARM_UP)) is None:
            return
        while True:
            # phases all / spare / spare / all: a drift in speed weighs on both sides alike
            counts = {plan.every: 0, plan.spare: 0}
            spent = {plan.every: 0.0, plan.spare: 0.0}
            for cpus in (plan.every, plan.spare, plan.spare, plan.every):
                self.apply(cpus)
                start = clock()
                taken = yield from _for(items, clock, PHASE)
                if taken is None:
                    return
                counts[cpus] += taken
                spent[cpus] += clock() - start
            every, spare = (counts[c] / max(spent[c], 1e-9) for c in (plan.every, plan.spare))
            best = plan.spare if spare > every * MARGIN else plan.every
            self.apply(best)
            self.chosen.append(best)
            if (yield from _for(items, clock, RETUNE)) is None:
                return


def worker_cpus(items: Iterable[Any], plan: CpuPlan) -> Iterable[Any]:
    """`items` as they are, run on the CPUs `plan` gives (in a DataLoader worker)."""
    if plan.how == FIT:
        set_cpus(plan.spare)
    return TuneCpus(items, plan) if plan.how == TUNE else items


def _for(items: Iterator[Any], clock: Callable[[], float], seconds: float) -> Any:
    """Yield from `items` for `seconds`; return how many, or None when `items` ran out."""
    end = clock() + seconds
    for count, item in enumerate(items, 1):
        yield item
        if clock() >= end:
            return count
    return None
