"""Do workers pay off for raw records? `.batch(n)` at 0, 1 and 2 workers, parsed in the main
process (what streamds does now) against parsed in the workers (what it did before).

Each run is a fresh Python process that calls ``gc.freeze()`` after its imports (as the README
recommends), builds ``DataLoader(StreamingJsonl(path).batch(n), batch_size=None,
num_workers=w)`` and reads the whole corpus, counting records, timed from the first batch to
the last (the steady rate; the start-up is first_batch.py's). Rows, interleaved (each round
starts at another row), medians of --repeats:

- 0 workers: the reader runs in the main process;
- parsed in the main process: a worker hands its batches over as their JSON lines, written
  into its shared-memory ring, and the main process parses them (`streamds.parse_later`);
- parsed in the workers: the same loader with ``on_error="skip"``, which needs the values in
  the worker (no line is malformed), so the worker parses, marshals and sends the records.

Besides records/s and the ratio to 0 workers, the CPU each run used: the main process's and
the workers' (getrusage), per record. The corpora are the throughput benchmark's at
--scale 0.5 (PubMed layout, ~21 KB lines; small ~300-byte lines), seekable .jsonl.zst, in
batches of ~300 KB (16 and 1,024 records), each read in order and shuffled (``shuffle=True``,
a buffer of 1,000 PubMed records or 10,000 small lines: ~20 and ~3 MB).

    .venv/bin/python benchmarks/workers_bench.py                 # ~4 min on 2 cores
    .venv/bin/python benchmarks/workers_bench.py --write-readme  # fill the README section
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import gc, json, resource, sys, time
from torch.utils.data import DataLoader
from streamds import StreamingJsonl

spec = json.loads(sys.argv[1])
gc.freeze()
shuffled = {"shuffle": True, "buffer_size": spec["buffer"], "seed": 0} if spec["buffer"] else {}
ds = StreamingJsonl(spec["path"], on_error=spec["on_error"], **shuffled).batch(spec["batch"])
def cpu(who):
    used = resource.getrusage(who)
    return used.ru_utime + used.ru_stime

children_before = cpu(resource.RUSAGE_CHILDREN)
batches = iter(DataLoader(ds, batch_size=None, num_workers=spec["workers"]))
first = len(next(batches))  # the steady state: from the first batch on (start-up aside)
main_before = cpu(resource.RUSAGE_SELF)
start = time.perf_counter()
records = 0
for batch in batches:
    records += len(batch)
seconds = time.perf_counter() - start
main = cpu(resource.RUSAGE_SELF) - main_before
del batches  # the workers exit and are reaped: their CPU time is the children's
gc.collect()
print(json.dumps({"first": first, "records": records, "seconds": seconds, "main_cpu": main,
                  "workers_cpu": cpu(resource.RUSAGE_CHILDREN) - children_before}))
"""

# (row label, workers, on_error)
MODES = [
    ("0 workers", 0, "raise"),
    ("1 worker, parsed in the main process", 1, "raise"),
    ("1 worker, parsed in the worker", 1, "skip"),
    ("2 workers, parsed in the main process", 2, "raise"),
    ("2 workers, parsed in the workers", 2, "skip"),
]


# shuffle buffers, in records: ~20 MB of PubMed records, ~3 MB of small lines
BUFFERS = {"PubMed": 1000, "small lines": 10_000}


def corpora(scale: float) -> list[tuple[str, str, int, int, int | None]]:
    """(label, seekable .jsonl.zst path, records per batch, records, shuffle buffer or None),
    each corpus in order and shuffled."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import pubmed_corpus, small_lines_corpus

    pubmed = pubmed_corpus(round(1e9 * scale))  # the throughput benchmark's corpora
    small = small_lines_corpus(round(3e8 * scale))
    cases = []
    for name, corpus, batch in (("PubMed", pubmed, 16), ("small lines", small, 1024)):
        for buffer in (None, BUFFERS[name]):
            label = f"{name}, .batch({batch})" + (
                f", shuffled (buffer {buffer:,})" if buffer else "")
            cases.append((label, str(corpus.zst), batch, corpus.records, buffer))
    return cases


def run(path: str, batch: int, workers: int, on_error: str, buffer: int | None) -> dict:
    from common import child_result

    spec = {"path": path, "batch": batch, "workers": workers, "on_error": on_error,
            "buffer": buffer}
    return child_result(["-c", CHILD], spec, what=f"{path}, {workers} workers")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args(argv)
    from common import command_line, machine, publish

    rows = corpora(args.scale)
    began = time.perf_counter()
    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        turn = repeat % len(MODES)  # each round starts elsewhere: no row always goes first
        first = repeat % len(rows)
        for corpus, path, batch, records, buffer in rows[first:] + rows[:first]:
            for label, workers, on_error in MODES[turn:] + MODES[:turn]:
                result = run(path, batch, workers, on_error, buffer)
                if result["first"] + result["records"] != records:
                    raise RuntimeError(f"{corpus}, {label}: {result['first']} + "
                                       f"{result['records']} records, "
                                       f"the corpus has {records}")
                runs.setdefault((corpus, label), []).append(result)
                print(f"[{repeat + 1}/{args.repeats}] {corpus:<45} {label:<40} "
                      f"{records / result['seconds']:,.0f} records/s", file=sys.stderr)

    def rate(result: dict) -> float:
        return result["records"] / result["seconds"]

    lines = ["| corpus | loader | records/s | x 0 workers | per run | main process CPU, "
             "us/record | workers' CPU, us/record |", "|---|---|---:|---:|---|---:|---:|"]
    for corpus, *_ in rows:
        alone = [rate(r) for r in runs[corpus, MODES[0][0]]]
        base = statistics.median(alone)
        for index, (label, workers, _) in enumerate(MODES):
            results = runs[corpus, label]
            rates = [rate(r) for r in results]
            # each run against the 0-worker run of its own round
            pairs = sorted(r / a for r, a in zip(rates, alone, strict=True))
            main_us = statistics.median(r["main_cpu"] / r["records"] * 1e6 for r in results)
            workers_us = statistics.median(r["workers_cpu"] / r["records"] * 1e6
                                           for r in results)
            name = corpus if index == 0 else ""
            lines.append(
                f"| {name} | {label} | {statistics.median(rates):,.0f} | "
                f"{statistics.median(rates) / base:.2f} | {pairs[0]:.2f}-{pairs[-1]:.2f} | "
                f"{main_us:.2f} | {workers_us:.2f} |" if workers else
                f"| {name} | {label} | {statistics.median(rates):,.0f} | 1.00 | - | "
                f"{main_us:.2f} | - |")
    body = "\n".join(lines) + (
        f"\n\nDataLoader(ds.batch(n), batch_size=None) over the whole seekable .jsonl.zst, a "
        f"fresh process per run with `gc.freeze()` after its imports, timed from the first "
        f"batch to the last (the start-up is under \"The first batch\"); median of "
        f"{args.repeats} runs per row, interleaved; \"per run\" divides each run by the "
        f"0-worker run of its round (lowest-highest). \"parsed in the worker(s)\" is the same "
        f"loader with on_error=\"skip\" (the path every batch took before). CPU: getrusage of "
        f"the main process during the loop, and of the reaped workers. Machine: {machine()}. "
        f"Command: `{command_line()}`. Measured in {time.perf_counter() - began:.0f} s."
    )
    every_run = [{"corpus": corpus, "loader": label, "runs": r}
                 for (corpus, label), r in runs.items()]
    publish("workers_bench", body, every_run, "workers" if args.write_readme else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
