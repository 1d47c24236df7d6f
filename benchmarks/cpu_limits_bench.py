"""Workers on fewer CPUs than they seem to have: a container's CPU quota and a single CPU.

`streamds.stages.cpus` plans a worker's CPUs from the set it may run on, and `.batch(n,
ahead="auto")` makes batches ahead only where that plan is TUNE (more processes than CPUs, on
the whole set). Two limits change what the set means:

- a CPU quota (a container's ``--cpus``, a pod's CPU limit: the cgroup's ``cpu.max`` or
  ``cpu.cfs_quota_us``) below the CPU count: `cpu_quota` reads it and the plan is KEEP;
- one CPU (``taskset -c 0``): nothing to keep free, KEEP.

Each row reads the workers benchmark's corpora (`workers_bench.py`, --scale 0.5: PubMed
`.batch(16)` over 6 copies of its shard, small lines `.batch(1024)` over 10), in order and
shuffled, through ``DataLoader(batch_size=None)`` at 0 workers and at 2 workers with
``ahead=0`` and ``ahead=4``, each under: no limit (the machine's CPUs), a cgroup quota of
--quota CPUs (made under the cgroup v1 cpu tree or a v2 tree with the cpu controller; rows
left out where this process may not make one), and CPU 0 alone. "auto" says which of the two
the default picks there (the plan a worker makes in that place). A fresh process per run, timed
from the first batch to the last; medians of --repeats interleaved rounds.

    .venv/bin/python benchmarks/cpu_limits_bench.py                 # ~15 min on 2 cores
    .venv/bin/python benchmarks/cpu_limits_bench.py --write-docs  # fill docs/performance.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import add_write_docs, child_result, command_line, machine, publish  # noqa: E402
from workers_bench import CHILD, corpora  # noqa: E402

# the child places itself (a cgroup, a CPU set) before torch starts, so its workers inherit it
PLACE = r"""
import json, os, sys
_spec = json.loads(sys.argv[1])
if _spec.get("cgroup"):
    with open(os.path.join(_spec["cgroup"], "cgroup.procs"), "w") as _procs:
        _procs.write(str(os.getpid()))
if _spec.get("cpus"):
    os.sched_setaffinity(0, _spec["cpus"])
"""
PLAN = r"""
from torch.utils.data import IterableDataset
from streamds.stages.cpus import worker_plan

class Plan(IterableDataset):  # the plan a worker of 2 makes in this place
    def __iter__(self):
        yield worker_plan(2).how

plan = next(iter(DataLoader(Plan(), batch_size=None, num_workers=1)))
print(json.dumps({"first": first, "records": records, "seconds": seconds, "plan": plan}))
"""
COPIES = {"PubMed": 6, "small lines": 10}
LOADERS = [("0 workers", 0, 0), ("2 workers, ahead=0", 2, 0), ("2 workers, ahead=4", 2, 4)]


@contextlib.contextmanager
def quota_group(cpus: float) -> Iterator[str | None]:
    """A cgroup limited to `cpus` CPUs' worth of time (v1 cpu tree, else v2), or None where
    this process may not make one."""
    made = None
    for tree, files in (("/sys/fs/cgroup/cpu", ("cpu.cfs_quota_us", "{q}")),
                        ("/sys/fs/cgroup", ("cpu.max", "{q} 100000"))):
        folder = os.path.join(tree, f"streamds-bench-{os.getpid()}")
        try:
            os.mkdir(folder)
        except OSError:
            continue
        try:  # a cgroup's control files exist as soon as it is made
            with open(os.path.join(folder, files[0]), "r+") as file:
                file.write(files[1].format(q=round(cpus * 100_000)))
            made = folder
            break
        except OSError:
            os.rmdir(folder)
    try:
        yield made
    finally:
        if made is not None:
            os.rmdir(made)  # empty: every child has exited


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--quota", type=float, default=1.5, help="CPUs of the quota rows")
    add_write_docs(parser, "cpu-limits")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    cases = corpora(args.scale, COPIES)
    runs: dict[tuple[str, str, str], list[dict]] = {}
    with quota_group(args.quota) as group:
        limits = [("none", {})]
        if group is not None:
            limits.append((f"quota {args.quota:g} CPUs", {"cgroup": group}))
        else:
            print("no cgroup could be made here: the quota rows are left out", file=sys.stderr)
        limits.append(("CPU 0 alone", {"cpus": [0]}))
        for repeat in range(args.repeats):
            turn = repeat % len(LOADERS)
            for case, path, batch, records, buffer in cases:
                for limit, place in limits:
                    for loader, workers, ahead in LOADERS[turn:] + LOADERS[:turn]:
                        spec = {"path": path, "batch": batch, "workers": workers,
                                "worker_cpus": "auto", "buffer": buffer, "ahead": ahead,
                                **place}
                        result = child_result(["-c", PLACE + CHILD + PLAN], spec,
                                              what=f"{case}, {limit}, {loader}")
                        if result["first"] + result["records"] != records:
                            raise RuntimeError(f"{case}, {limit}, {loader}: "
                                               f"{result['first'] + result['records']} records"
                                               f", the corpus has {records}")
                        runs.setdefault((case, limit, loader), []).append(result)
                        print(f"[{repeat + 1}/{args.repeats}] {case:<36} {limit:<18} "
                              f"{loader:<20} {result['records'] / result['seconds']:,.0f} "
                              f"records/s (plan {result['plan']})", file=sys.stderr)

    def rate(key: tuple[str, str, str]) -> float:
        return statistics.median(r["records"] / r["seconds"] for r in runs[key])

    lines = ["| corpus | CPU limit | 0 workers, records/s | 2 workers, ahead=0 | ahead=4 "
             "| 4 / 0 | \"auto\" picks |", "|---|---|---:|---:|---:|---:|---|"]
    for case, *_ in cases:
        for limit, _ in limits:
            alone, none, four = (rate((case, limit, loader)) for loader, *_ in LOADERS)
            plan = runs[case, limit, LOADERS[1][0]][0]["plan"]
            picks = "ahead=4 (TUNE)" if plan == "tune" else f"ahead=0 ({plan.upper()})"
            lines.append(f"| {case} | {limit} | {alone:,.0f} | {none:,.0f} ({none / alone:.2f}x)"
                         f" | {four:,.0f} ({four / alone:.2f}x) | {four / none:.2f} | {picks} |")
    body = "\n".join(lines) + (
        f"\n\n`DataLoader(ds.batch(n, ahead=...), batch_size=None)`, a fresh process per run "
        f"placed in the limit before torch starts (its workers inherit it), timed from the "
        f"first batch to the last; medians of {args.repeats} interleaved rounds; (x) against "
        f"0 workers under the same limit. Machine: {machine()}. "
        f"Command: `{command_line()}`. Measured in {time.perf_counter() - began:.0f} s."
    )
    every_run = [{"corpus": c, "limit": lim, "loader": ld, "runs": r}
                 for (c, lim, ld), r in runs.items()]
    publish("cpu_limits_bench", body, every_run, "cpu-limits" if args.write_docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
