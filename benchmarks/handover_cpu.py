"""Where the CPU goes with workers on plain JSONL, per process: the main process and the
workers, in CPU µs per record (getrusage: robust to other load on a shared machine), and
records/s (wall: not robust), for 0 and 2 workers.

Readers, each over ~21 KB PubMed-layout records and ~300-byte small lines (plain `.jsonl`,
no map), through a DataLoader:

- ``DataLoader(ds, batch_size=64, collate_fn=list)``: torch pickles each record in a worker
  and the main process unpickles it;
- ``DataLoader(ds.batch(64), batch_size=None)``: the lines cross in shared memory and the
  main process parses them (`streamds.stages.parse_later`).

On 2 cores the two workers and the main process share the CPUs, so workers pay only where
the main process's share plus half the workers' stays below what 0 workers spend: the main
process must build every record (unpickle or parse), which for plain JSONL is most of the
work of 0 workers.

Every run is a fresh child process whose PYTHONPATH is the tree under test (this checkout,
"new"; with --ref GITREF also that ref, "old"), interleaved; medians of --repeats.

    .venv/bin/python benchmarks/handover_cpu.py --ref main     # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from common import child_result

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = ROOT / "bench-data"


def as_list(batch: list) -> list:
    return batch


def measure(path: str, workers: int, route: str) -> dict:
    import gc

    from torch.utils.data import DataLoader

    from streamds import StreamingJsonl

    ds = StreamingJsonl(path)
    if route == "batch":
        loader = DataLoader(ds.batch(64), batch_size=None, num_workers=workers)
    else:
        loader = DataLoader(ds, batch_size=64, num_workers=workers, collate_fn=as_list)
    gc.freeze()
    before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    records = sum(len(batch) for batch in loader)  # the workers exit (and are reaped) at the end
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    main, children = ((b.ru_utime - a.ru_utime) + (b.ru_stime - a.ru_stime)
                      for a, b in zip(before, after, strict=True))
    return {"records": records, "wall": wall, "main": main, "workers": children}


def corpora(scale: float) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT))
    from streamds.tools.synthetic import write_pubmed, write_small_lines

    DATA.mkdir(exist_ok=True)
    made = {"PubMed (~21 KB lines)": DATA / f"handover-pubmed-{scale:g}.jsonl",
            "small lines (~300 B)": DATA / f"handover-small-{scale:g}.jsonl"}
    writers = [lambda p: write_pubmed(p, target_bytes=int(150e6 * scale), seed=0,
                                      record_chars=10_000),
               lambda p: write_small_lines(p, target_bytes=int(60e6 * scale), seed=0,
                                           line_bytes=300)]
    for path, write in zip(made.values(), writers, strict=True):
        if not path.exists():
            write(path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
    return made


def run(tree: Path, path: Path, workers: int, route: str) -> dict:
    return child_result([__file__, "--child"],
                        {"path": str(path), "workers": workers, "route": route},
                        what=f"a child of {tree}", tree=tree)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", help="also measure this git ref (checked out under /tmp)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return 0
    from state_bench import ref_worktree

    trees = {"new": ROOT} if not args.ref else {"old": ref_worktree(args.ref), "new": ROOT}
    paths = corpora(args.scale)
    routes = {"list": "DataLoader(ds, batch_size=64)", "batch": "DataLoader(ds.batch(64))"}
    runs: dict[tuple[str, str, int, str], list[dict]] = {}
    for repeat in range(args.repeats):
        order = list(trees.items()) if repeat % 2 == 0 else list(trees.items())[::-1]
        for corpus, path in paths.items():
            for route in routes:
                for workers in (0, 2):
                    for name, tree in order:
                        runs.setdefault((corpus, route, workers, name), []).append(
                            run(tree, path, workers, route))
    print("| corpus | reader | workers | version | records/s | main CPU µs/record | "
          "workers' CPU µs/record | all CPU µs/record |\n|---|---|---:|---|---:|---:|---:|---:|")
    for (corpus, route, workers, name), found in runs.items():

        def median(key: str, found: list[dict] = found) -> float:
            return statistics.median(r[key] for r in found)

        records = found[0]["records"]
        main_cpu, workers_cpu = median("main") / records * 1e6, median("workers") / records * 1e6
        print(f"| {corpus} | {routes[route]} | {workers} | {name} | "
              f"{records / median('wall'):,.0f} | {main_cpu:.1f} | {workers_cpu:.1f} | "
              f"{main_cpu + workers_cpu:.1f} |")
    print(f"\nMedians of {args.repeats} interleaved repeats, each a fresh process.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
