"""Which CPUs a DataLoader worker runs on, so that the main process can keep one to itself.

The main process builds every record it receives (it parses the lines of plain batches and
unpickles the rest) and then runs the training step; a worker that the OS schedules on its CPU
takes turns with it, and the processes move between CPUs. Keeping a CPU free for the main
process speeds it up where it is the slower side (large records) and slows the workers where
they are (shuffled small lines, a tokenizing pipeline); `benchmarks/workers_bench.py` measures
both settings. With ``worker_cpus="auto"``:

- the workers fit beside the main processes (``(workers + 1) * local processes <= CPUs``):
  each worker keeps off the first CPUs of its set, one per main process, from its start
  (`plan_cpus` -> FIT);
- they do not: each worker measures how fast it hands out items with every CPU and with those
  kept free, in phases all / spare / spare / all of at least PHASE seconds and MIN_ITEMS items
  after WARM_UP seconds, keeps the spare set only when it was MARGIN faster, and measures again
  every RETUNE seconds (`TuneCpus`). The workers start together and hand out items in turn,
  so each one sees the loader's whole rate and they decide alike.
- workers that only copy lines, in order, for the main process to parse
  (`streamds.stages.parse_later`) under ``ds.loader`` start on the spare CPUs and tune from
  there (``main_heavy``): the main process, which does most of the work, takes its batches
  with its thread bound to the CPU they keep off (`main_cpus`,
  `streamds.train.loader.OnMainCpu`); a worker's message would otherwise wake it on the
  worker's CPU, behind the workers. A shuffle's workers start on every CPU: the buffer's
  draws are work enough to use them.
- a worker whose CPUs differ from its parent's was placed by someone (a `worker_init_fn`,
  a launcher): it is left as it is (KEEP), as on a system without `sched_setaffinity`.
- the process's cgroup has a CPU quota below its CPU count (a container's ``--cpus``, a
  pod's CPU limit): time, not CPUs, is what runs out, and keeping a CPU free for the main
  process reserves it none, so the workers are left as they are (KEEP), and `ahead="auto"`
  makes no batches ahead (it follows TUNE): there, neither pays off
  (`benchmarks/cpu_limits_bench.py` measures both).

"Local processes" is torchrun's LOCAL_WORLD_SIZE (1 when unset or not a positive integer),
or 1 when the process may use only part of the machine's CPUs: a launcher that binds each
rank to its own CPUs (a NUMA node) leaves that set to this rank alone.

Only the speed changes: which records come out, in which order, and the resume state never
depend on it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

__all__ = ["FIT", "KEEP", "TUNE", "CpuPlan", "TuneCpus", "cpu_quota", "main_cpus",
           "move_threads", "on_planned_cpus", "plan_cpus", "set_cpus", "thread_on_cpus",
           "threads", "worker_plan"]

log = logging.getLogger(__name__)

WORKER_CPUS = ("auto", "all")  # StreamingJsonl.batch(..., worker_cpus=...)

KEEP, FIT, TUNE = "keep", "fit", "tune"
WARM_UP = 5.0  # seconds before the first measurement: a shorter run would not win back its cost
PHASE = 0.4  # seconds per measured phase, at least ...
MIN_ITEMS = 8  # ... and items per phase, so that a slow pipeline's rate is not one item's
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


def plan_cpus(workers: int, local_processes: int, every: Iterable[int]) -> CpuPlan:
    """The plan for one of `workers` DataLoader workers of each of `local_processes` training
    processes that share the CPUs `every`."""
    every = frozenset(every)
    main = frozenset(sorted(every)[:local_processes])
    if len(every) - len(main) < 1:
        return CpuPlan(KEEP, every, main)
    fits = local_processes * (workers + 1) <= len(every)
    return CpuPlan(FIT if fits else TUNE, every, main)


_STARTED_ON: frozenset[int] | None = None  # this process's CPUs before any change of ours
_QUOTA: float | None = None  # ... and its cgroup's CPU quota (`cpu_quota`), read with them


def worker_plan(workers: int) -> CpuPlan:
    """The plan for this DataLoader worker, one of `workers` (see the module docstring)."""
    global _STARTED_ON, _QUOTA
    if not hasattr(os, "sched_getaffinity"):  # not Linux: the OS decides
        return CpuPlan(KEEP)
    if _STARTED_ON is None:  # a persistent worker's next epoch must not start from our choice
        _STARTED_ON = frozenset(os.sched_getaffinity(0))
        _QUOTA = cpu_quota()
        try:
            placed = frozenset(os.sched_getaffinity(os.getppid())) != _STARTED_ON
        except OSError:  # the parent is gone or not ours to see
            placed = True
        if placed:
            _STARTED_ON = frozenset()
    if not _STARTED_ON:  # placed by someone else: leave it
        return CpuPlan(KEEP)
    whole_machine = len(_STARTED_ON) == os.cpu_count()
    local = _local_processes()
    # a rank bound to part of the machine has its share of the quota its cgroup holds
    quota = _QUOTA if _QUOTA is None or whole_machine else _QUOTA / local
    if quota is not None and quota < len(_STARTED_ON):  # time runs out, not CPUs
        return CpuPlan(KEEP, _STARTED_ON)
    return plan_cpus(workers, local if whole_machine else 1, _STARTED_ON)


def cpu_quota(membership: str = "/proc/self/cgroup",
              mountinfo: str = "/proc/self/mountinfo") -> float | None:
    """The CPUs' worth of time per period that this process's cgroup may use (a container's
    ``--cpus``, a pod's CPU limit): the smallest quota on the way from its cgroup up to the
    top of the mounted tree, cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``; None when there is none or it cannot be read (not Linux).

    Where the process's cgroup is in the mounted tree comes from `mountinfo`: a container
    without a cgroup namespace sees its own cgroup (``/docker/abc``) mounted as the top of the
    tree, and its processes' paths (``/docker/abc/job``) are taken relative to that root.
    """
    try:
        with open(membership, errors="surrogateescape") as file:
            entries = [line.rstrip("\n").split(":", 2) for line in file]
        trees = _cgroup_trees(mountinfo)
    except OSError:
        return None
    quotas: list[float] = []
    for _, controllers, path in (e for e in entries if len(e) == 3):
        if controllers == "":  # v2: one tree for every controller
            version, read = 2, _v2_quota
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's tree
            version, read = 1, _v1_quota
        else:
            continue
        for root, point in trees[version]:
            inside = _below(path, root)
            if inside is not None:
                quotas += _quotas_up(point, inside, read)
    return min(quotas, default=None)


def _cgroup_trees(mountinfo: str) -> dict[int, list[tuple[str, str]]]:
    """(root inside the hierarchy, mount point) of the mounted cgroup v2 trees (key 2) and
    of the v1 trees that hold the cpu controller (key 1), from /proc/self/mountinfo."""
    trees: dict[int, list[tuple[str, str]]] = {1: [], 2: []}
    with open(mountinfo, errors="surrogateescape") as file:
        for line in file:
            fields = line.split()
            if "-" not in fields[6:]:
                continue
            tail = fields[fields.index("-", 6) + 1:]  # type, source, super options
            root, point = _unescape(fields[3]), _unescape(fields[4])
            if tail[:1] == ["cgroup2"]:
                trees[2].append((root, point))
            elif tail[:1] == ["cgroup"] and "cpu" in tail[-1].split(","):
                trees[1].append((root, point))
    return trees


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def _below(path: str, root: str) -> str | None:
    """`path` relative to `root` ("" for root itself), or None when it is not below it."""
    path, root = path.rstrip("/") or "/", root.rstrip("/") or "/"
    if root == "/":
        return path.lstrip("/")
    if path == root:
        return ""
    return path[len(root) + 1:] if path.startswith(root + "/") else None


def _quotas_up(point: str, inside: str, quota_in: Callable[[str], float | None]
               ) -> list[float]:
    """The quotas of the cgroup at `inside` under the mount `point` and of each of its
    parents up to the mount's top."""
    found: list[float] = []
    parts = [part for part in inside.split("/") if part]
    for depth in range(len(parts), -1, -1):
        quota = quota_in(os.path.join(point, *parts[:depth]))
        if quota is not None:
            found.append(quota)
    return found


def _v2_quota(folder: str) -> float | None:
    """``cpu.max`` holds "max 100000" (none) or "150000 100000" (1.5 CPUs)."""
    try:
        with open(os.path.join(folder, "cpu.max")) as file:
            quota, period = file.read().split()[:2]
        if quota == "max":
            return None
        return _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_quota(folder: str) -> float | None:
    """``cpu.cfs_quota_us`` holds -1 (none) or the microseconds per ``cpu.cfs_period_us``."""
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as file:
            quota = int(file.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as file:
            period = int(file.read())
        return _ratio(quota, period)
    except (OSError, ValueError):
        return None


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def _local_processes() -> int:
    """torchrun's LOCAL_WORLD_SIZE; 1 when unset or not a positive integer (a speed hint)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def set_cpus(cpus: Iterable[int]) -> None:
    """Run every thread of this process on `cpus` (sched_setaffinity sets one thread); a CPU
    set the system refuses leaves the process as it was."""
    cpus = set(cpus)
    try:
        threads = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only
        threads = [0]
    for thread in threads:
        try:
            os.sched_setaffinity(thread, cpus)
        except OSError as err:  # a thread that ended in between; a CPU gone offline
            log.debug("could not move thread %d to CPUs %s: %s", thread, sorted(cpus), err)


_tuning = False  # one TuneCpus measures per process (a Mix holds several readers)


class TuneCpus:
    """The items of `source`, unchanged and in order, while it measures how fast they are
    taken with `plan.every` and with `plan.spare` CPUs and runs on the faster (see the module
    docstring). Reads nothing ahead and holds no state: a resumed worker measures anew.

    `clock` and `apply` are seams for tests; `chosen` lists each measurement's choice.
    """

    def __init__(self, source: Iterable[Any], plan: CpuPlan, *,
                 clock: Callable[[], float] = time.perf_counter,
                 apply: Callable[[frozenset[int]], None] = set_cpus) -> None:
        self.source = source
        self.plan = plan
        self.clock = clock
        self.apply = apply
        self.chosen: list[frozenset[int]] = []

    def __iter__(self) -> Iterator[Any]:
        global _tuning
        if _tuning:  # another reader of this process measures for both
            yield from self.source
            return
        _tuning = True
        try:
            yield from self._measured(iter(self.source))
        finally:
            _tuning = False

    def _measured(self, items: Iterator[Any]) -> Iterator[Any]:
        plan, clock = self.plan, self.clock
        if (yield from _for(items, clock, WARM_UP, 0)) is None:
            return
        while True:
            # phases all / spare / spare / all: a drift in speed weighs on both sides alike
            counts = {plan.every: 0, plan.spare: 0}
            spent = {plan.every: 0.0, plan.spare: 0.0}
            for cpus in (plan.every, plan.spare, plan.spare, plan.every):
                self.apply(cpus)
                start = clock()
                taken = yield from _for(items, clock, PHASE, MIN_ITEMS)
                if taken is None:
                    return
                counts[cpus] += taken
                spent[cpus] += clock() - start
            every, spare = (counts[c] / max(spent[c], 1e-9) for c in (plan.every, plan.spare))
            best = plan.spare if spare > every * MARGIN else plan.every
            self.apply(best)
            self.chosen.append(best)
            log.debug("items/s with CPUs %s: %.1f, with %s: %.1f; keeping %s",
                      sorted(plan.every), every, sorted(plan.spare), spare, sorted(best))
            if (yield from _for(items, clock, RETUNE, 0)) is None:
                return


def on_planned_cpus(items: Iterable[Any], plan: CpuPlan, *, main_heavy: bool = False
                    ) -> Iterable[Any]:
    """`items` as they are, handed out on the CPUs `plan` gives (in a DataLoader worker).
    `main_heavy`: the main process does most of the work per item (it parses lines the
    workers only copy): a TUNE plan starts on the spare CPUs, as FIT does, until it measures
    (the main process takes its batches on its own CPU meanwhile: `main_cpus`)."""
    if plan.how == FIT or (plan.how == TUNE and main_heavy):
        set_cpus(plan.spare)
    return TuneCpus(items, plan) if plan.how == TUNE else items


def main_cpus(workers: int) -> frozenset[int] | None:
    """The CPU this main process's thread takes its batches on while `workers` DataLoader
    workers that leave the parsing to it keep off that CPU (`on_planned_cpus` with
    `main_heavy`: the same plan, made here from this process's CPUs); None: where the
    workers do not keep off one (one CPU, a CPU quota, not Linux) or this rank's CPU is not
    known (several local processes without LOCAL_RANK)."""
    if workers < 1 or not hasattr(os, "sched_getaffinity"):
        return None
    every = frozenset(os.sched_getaffinity(0))
    whole_machine = len(every) == os.cpu_count()
    local = _local_processes() if whole_machine else 1
    quota = cpu_quota()
    if quota is not None and (quota if whole_machine else quota / local) < len(every):
        return None
    plan = plan_cpus(workers, local, every)
    if plan.how == KEEP:
        return None
    try:
        rank = int(os.environ["LOCAL_RANK"]) if local > 1 else 0
    except (KeyError, ValueError):
        return None
    main = sorted(plan.main)
    return frozenset({main[rank]}) if 0 <= rank < len(main) else None


@contextmanager
def thread_on_cpus(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread runs on `cpus` inside the block and where it ran before after it
    (None, or a set the system refuses: left as it is)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        before = None
    try:
        yield
    finally:
        if before is not None:
            with suppress(OSError):
                os.sched_setaffinity(0, before)


def threads() -> set[int]:
    """The ids of this process's threads (empty without /proc)."""
    try:
        return {int(task) for task in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def move_threads(ids: Iterable[int], cpus: Iterable[int]) -> None:
    """Run the threads `ids` of this process on `cpus` (one that ended meanwhile is left)."""
    for thread in ids:
        with suppress(OSError):
            os.sched_setaffinity(thread, set(cpus))


def _for(items: Iterator[Any], clock: Callable[[], float], seconds: float,
         at_least: int) -> Any:
    """Yield from `items` for `seconds` and `at_least` items; return how many, or None when
    `items` ran out."""
    end = clock() + seconds
    for count, item in enumerate(items, 1):
        yield item
        if count >= at_least and clock() >= end:
            return count
    return None
