"""What StatefulDataLoader adds per batch: streamds against a one-integer state (the floor).

torchdata's StatefulDataLoader takes every worker's dataset state after every batch, diffs it
against the last one in the worker, ships the difference with the batch and rebuilds every
worker's state in the main process. This script measures what that adds per batch of 32,
2 workers, over ~200,000 short records (shuffle=True, buffer_size=10,000, a collate returning
the ids): StatefulDataLoader minus DataLoader, per batch, in wall time and in CPU time (the main
process and its workers, from getrusage; robust to other load on the machine), for

- streamds of each version under test (this checkout, "new"; --ref GITREF, "old"), and
- the floor: `state_bench.FloorLines` (state = {"n": lines seen}), torchdata's own cost.

The issue's target: streamds adds at most 1.25 x the floor's addition + 10 µs.

Every run is a child process whose PYTHONPATH is the tree under test; the runs of one repeat
are interleaved, values are medians of --repeats.

    .venv/bin/python benchmarks/stateful_cost.py --ref main            # ~3 min on 2 cores
    .venv/bin/python benchmarks/stateful_cost.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from common import add_write_docs, child_result, command_line, machine, publish

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BATCH = 32
WORKERS = 2
BUFFER = 10_000


def measure(path: str, stateful: bool, floor: bool) -> dict:
    """One epoch in this process: seconds, and CPU seconds of this process and its workers."""
    sys.path.insert(0, str(HERE))  # state_bench: FloorLines, batch_ids (imports no streamds)
    from state_bench import FloorLines, batch_ids
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    if floor:
        ds = FloorLines(path)
    else:
        from streamds import StreamingJsonl

        ds = StreamingJsonl(path, shuffle=True, buffer_size=BUFFER)
    loader_type = StatefulDataLoader if stateful else DataLoader
    loader = loader_type(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=batch_ids)
    before_self = resource.getrusage(resource.RUSAGE_SELF)
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    batches = sum(1 for _ in loader)  # the workers exit (and are reaped) at the end
    wall = time.perf_counter() - start
    after_self = resource.getrusage(resource.RUSAGE_SELF)
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)

    def cpu(a: resource.struct_rusage, b: resource.struct_rusage) -> float:
        return (b.ru_utime - a.ru_utime) + (b.ru_stime - a.ru_stime)

    return {"batches": batches, "wall": wall, "main": cpu(before_self, after_self),
            "workers": cpu(before_children, after_children)}


def run(tree: Path, path: Path, stateful: bool, floor: bool) -> dict:
    return child_result([__file__, "--child"],
                        {"path": str(path), "stateful": stateful, "floor": floor},
                        what=f"a child of {tree}", tree=tree)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", help="also measure this git ref (checked out under /tmp)")
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_write_docs(parser, "stateful-cost")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return 0
    from state_bench import ref_worktree, write_short_records

    path = ROOT / "bench-data" / f"short-{args.records}.jsonl"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        write_short_records(path.with_suffix(".tmp"), args.records)
        path.with_suffix(".tmp").rename(path)
    trees = {"streamds": ROOT}  # with --ref: "old" and "new"
    if args.ref:
        trees = {"old": ref_worktree(args.ref), "new": ROOT}
    cases = [(name, tree, False) for name, tree in trees.items()] + [("floor", ROOT, True)]
    runs: dict[tuple[str, bool], list[dict]] = {}
    for repeat in range(args.repeats):
        order = cases if repeat % 2 == 0 else cases[::-1]
        for name, tree, floor in order:
            for stateful in (False, True):
                runs.setdefault((name, stateful), []).append(run(tree, path, stateful, floor))
    lines = ["| reader | added wall µs/batch | added CPU µs/batch (main + workers) | "
             "main | workers | DataLoader wall µs/batch |", "|---|---:|---:|---:|---:|---:|"]
    for name, _, _ in cases:

        def per_batch(stateful: bool, what: str, name: str = name) -> float:
            return statistics.median(r[what] / r["batches"] * 1e6
                                     for r in runs[name, stateful])

        wall = per_batch(True, "wall") - per_batch(False, "wall")
        main_cpu = per_batch(True, "main") - per_batch(False, "main")
        workers_cpu = per_batch(True, "workers") - per_batch(False, "workers")
        lines.append(f"| {name} | {wall:.0f} | {main_cpu + workers_cpu:.0f} | {main_cpu:.0f} | "
                     f"{workers_cpu:.0f} | {per_batch(False, 'wall'):.0f} |")
    body = "\n".join(lines) + (
        f"\n\nStatefulDataLoader minus DataLoader, {WORKERS} workers, batch_size={BATCH}, "
        f"{args.records:,} short records, shuffle buffer {BUFFER:,}; \"floor\": a dataset "
        f"whose state is one integer (torchdata's own cost); medians of {args.repeats} "
        f"interleaved repeats, each run a fresh process. Machine: {machine()}. Command: "
        f"`{command_line()}`.")
    publish("stateful_cost", body, {f"{name} {stateful}": rows
                                    for (name, stateful), rows in runs.items()},
            "stateful-cost" if args.write_docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
