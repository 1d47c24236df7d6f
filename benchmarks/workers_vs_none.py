"""Are 2 workers ever slower than none over plain `.jsonl` with no map? The three ways users
read, at 0 and 2 workers, over long and short lines:

- ``DataLoader(ds, batch_size=64, collate_fn=as_list)``: records one at a time; torch's
  worker collates 64 and pickles them, the main process unpickles them;
- ``DataLoader(ds.batch(64), batch_size=None)``: a worker hands over each batch of 64 as its
  JSON lines, in its shared-memory ring, and the main process parses them
  (`streamds.stages.parse_later`);
- ``ds.loader(64, num_workers=w)``: the one-call loader (a torchdata `StatefulDataLoader`),
  batches of 64 lists of records.

Each run is a fresh Python process that calls ``gc.freeze()`` after its imports and reads the
whole file, timed from the first batch to the last (the steady rate; worker start-up is
first_batch.py's), every record counted against the corpus. Besides records/s and the ratio of
2 workers to 0 (each run against the 0-worker run of its round), the CPU each run used per
record: the main process's during the loop and the reaped workers' (getrusage; a shared
machine bends these less than wall time). Rows interleaved, medians of --repeats.

The corpora are the throughput benchmark's layouts as plain `.jsonl`: PubMed records
(~21 KB lines, 500 MB at --scale 0.5) and small lines (~300 B, 150 MB); runs of 1-2 s.
``--copies N`` reads a folder of N copies of each instead: runs long enough (N=8: 5-15 s) for
what a training run sees after its first seconds (the workers' CPU placement, decided after
5 s: `streamds.stages.cpus`; worker start-up spread over more records). With
``--ref GITREF`` every row is also run with that ref's streamds (checked out under /tmp), "old"
beside "new".

    .venv/bin/python benchmarks/workers_vs_none.py                  # ~3 min on 2 cores
    .venv/bin/python benchmarks/workers_vs_none.py --ref main       # old and new: ~6 min
    .venv/bin/python benchmarks/workers_vs_none.py --copies 8 --repeats 2   # ~15 min
    .venv/bin/python benchmarks/workers_vs_none.py --write-docs     # fill docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

def measure(spec: dict) -> dict:
    """One run, in a fresh process (`--child`): the whole corpus through one reader."""
    import gc
    import resource

    from torch.utils.data import DataLoader

    from streamds import StreamingJsonl, as_list

    ds = StreamingJsonl(spec["path"])
    workers = spec["workers"]
    if spec["route"] == "records":
        loader = DataLoader(ds, batch_size=64, collate_fn=as_list, num_workers=workers)
    elif spec["route"] == "batch":
        loader = DataLoader(ds.batch(64), batch_size=None, num_workers=workers)
    else:
        loader = ds.loader(64, num_workers=workers)
    gc.freeze()

    def cpu(who: int) -> float:
        used = resource.getrusage(who)
        return used.ru_utime + used.ru_stime

    children_before = cpu(resource.RUSAGE_CHILDREN)
    batches = iter(loader)
    first = len(next(batches))  # the steady state: from the first batch on
    main_before = cpu(resource.RUSAGE_SELF)
    start = time.perf_counter()
    records = 0
    for batch in batches:
        records += len(batch)
    seconds = time.perf_counter() - start
    main = cpu(resource.RUSAGE_SELF) - main_before
    del batches  # the epoch ended: the workers have exited and been reaped
    gc.collect()
    return {"first": first, "records": records, "seconds": seconds, "main_cpu": main,
            "workers_cpu": cpu(resource.RUSAGE_CHILDREN) - children_before,
            "streamds": str(Path(sys.modules["streamds"].__file__).parent.parent)}


ROUTES = {
    "records": "`DataLoader(ds, batch_size=64, collate_fn=as_list)`",
    "batch": "`DataLoader(ds.batch(64), batch_size=None)`",
    "loader": "`ds.loader(64, num_workers=w)`",
}
WORKERS = (0, 2)


def copied(plain: Path, copies: int) -> Path:
    """`plain` itself, or a directory of `copies` copies of it (under bench-data/)."""
    from common import copies_folder

    if copies == 1:
        return plain
    return copies_folder(plain, plain.with_name(f"{plain.stem}-x{copies}"), copies, ".jsonl")


def corpora(scale: float, copies: int) -> dict[str, tuple[Path, int]]:
    """{label: (plain .jsonl or a folder of its copies, records)}: PubMed-layout and small
    lines."""
    sys.path.insert(0, str(HERE))
    from common import pubmed_corpus, small_lines_corpus

    pubmed = pubmed_corpus(round(1e9 * scale))  # the throughput benchmark's corpora
    small = small_lines_corpus(round(3e8 * scale))
    times = f" x {copies} copies" if copies > 1 else ""
    return {f"PubMed{times}: {pubmed.records * copies:,} records, "
            f"{pubmed.decoded_bytes / pubmed.records / 1e3:.0f} KB/line":
            (copied(pubmed.plain, copies), pubmed.records * copies),
            f"small lines{times}: {small.records * copies:,} records, "
            f"{small.decoded_bytes / small.records:.0f} B/line":
            (copied(small.plain, copies), small.records * copies)}


def run(tree: Path, path: Path, route: str, workers: int) -> dict:
    from common import child_result

    result = child_result([__file__, "--child"],
                          {"path": str(path), "route": route, "workers": workers},
                          what=f"{route}, {workers} workers, {tree}", tree=tree)
    if Path(result["streamds"]).resolve() != tree.resolve():
        raise RuntimeError(f"a child for {tree} imported the streamds of {result['streamds']}")
    return result


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from common import add_write_docs, command_line, machine, publish

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--copies", type=int, default=1,
                        help="read a folder of this many copies of each file: runs long enough "
                             "for the workers' CPU placement (after 5 s) to take part")
    parser.add_argument("--ref", help="also measure this git ref (checked out under /tmp)")
    parser.add_argument("--routes", nargs="+", choices=list(ROUTES), default=list(ROUTES),
                        help="only these readers")
    add_write_docs(parser, "workers-vs-none")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return 0
    routes = {route: ROUTES[route] for route in args.routes}
    trees = {"": ROOT}
    if args.ref:
        from state_bench import ref_worktree

        trees = {"old": ref_worktree(args.ref), "new": ROOT}
    files = corpora(args.scale, args.copies)
    cells = [(corpus, route, name) for corpus in files for route in routes for name in trees]
    began = time.perf_counter()
    runs: dict[tuple[str, str, str, int], list[dict]] = {}
    for repeat in range(args.repeats):
        turn = repeat % len(cells)  # each round starts elsewhere: no cell always goes first
        for corpus, route, name in cells[turn:] + cells[:turn]:
            path, records = files[corpus]
            for workers in WORKERS if repeat % 2 == 0 else WORKERS[::-1]:
                result = run(trees[name], path, route, workers)
                if result["first"] + result["records"] != records:
                    raise RuntimeError(f"{corpus}, {route}, {workers} workers {name}: "
                                       f"{result['first'] + result['records']} records, "
                                       f"the corpus has {records}")
                runs.setdefault((corpus, route, name, workers), []).append(result)
                print(f"[{repeat + 1}/{args.repeats}] {corpus[:16]:<16} {route:<8} {name:<4} "
                      f"{workers} workers: {result['records'] / result['seconds']:,.0f} "
                      "records/s", file=sys.stderr)

    def rate(result: dict) -> float:
        return result["records"] / result["seconds"]

    def per_record(results: list[dict], key: str) -> float:
        return statistics.median(r[key] / r["records"] * 1e6 for r in results)

    version = "| version " if args.ref else ""
    lines = [f"| corpus | reader {version}| records/s, 0 workers | records/s, 2 workers | "
             "2 workers / 0 | per round | main CPU µs/record, 0 / 2 workers | "
             "workers' CPU µs/record, 2 workers |",
             f"|---|---{'|---' if args.ref else ''}|---:|---:|---:|---|---:|---:|"]
    for corpus in files:
        for index, (route, label) in enumerate(routes.items()):
            for name in trees:
                alone, two = runs[corpus, route, name, 0], runs[corpus, route, name, 2]
                base, with_two = (statistics.median(map(rate, r)) for r in (alone, two))
                ratios = sorted(rate(b) / rate(a) for a, b in zip(alone, two, strict=True))
                first = index == 0 and name == next(iter(trees))
                lines.append(
                    f"| {corpus if first else ''} | {label if name == next(iter(trees)) else ''} "
                    f"{'| ' + name + ' ' if args.ref else ''}| {base:,.0f} | {with_two:,.0f} | "
                    f"**{with_two / base:.2f}** | {ratios[0]:.2f}-{ratios[-1]:.2f} | "
                    f"{per_record(alone, 'main_cpu'):.2f} / {per_record(two, 'main_cpu'):.2f} | "
                    f"{per_record(two, 'workers_cpu'):.2f} |")
    body = "\n".join(lines) + (
        f"\n\nPlain `.jsonl`, no map, in order; a fresh process per run with `gc.freeze()` "
        f"after its imports, timed from the first batch to the last; medians of "
        f"{args.repeats} interleaved rounds; \"per round\" divides each round's 2-worker run "
        f"by its 0-worker run (lowest-highest). CPU: getrusage of the main process during the "
        f"loop, and of the reaped workers. Machine: {machine()}. Command: "
        f"`{command_line()}`. Measured in {time.perf_counter() - began:.0f} s.")
    every_run = [{"corpus": corpus, "route": route, "version": name, "workers": workers,
                  "runs": found} for (corpus, route, name, workers), found in runs.items()]
    publish("workers_vs_none", body, every_run, "workers-vs-none" if args.write_docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
