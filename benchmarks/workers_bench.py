"""Do workers pay off for raw records, and does keeping a CPU free for the main process help?
`.batch(n)` at 0, 1 and 2 workers, with ``worker_cpus="auto"`` (the default: `streamds.stages.cpus`)
and ``worker_cpus="all"`` (the OS places the workers, as torch leaves them).

Each run is a fresh Python process that calls ``gc.freeze()`` after its imports (as the docs
recommend), builds ``DataLoader(StreamingJsonl(folder).batch(n, worker_cpus=...),
batch_size=None, num_workers=w)`` and reads the whole corpus, counting records, timed from the
first batch to the last (the steady rate; the start-up is first_batch.py's). Rows, interleaved
(each round starts at another row), medians of --repeats. A worker hands its batches over as
their JSON lines, written into its shared-memory ring, and the main process parses them
(`streamds.stages.parse_later`).

Besides records/s and the ratio to 0 workers, the CPU each run used: the main process's and
the workers' (getrusage), per record. The corpora are the throughput benchmark's at
--scale 0.5 (PubMed layout, ~21 KB lines; small ~300-byte lines), seekable .jsonl.zst, each
read as a folder of copies of its shard (20 and 30: runs of ~10 s, so that the workers' CPU
measurement, which starts after 5 s and takes ~2 s, is part of a run), in batches of ~300 KB
(16 and 1,024 records), in order and shuffled (``shuffle=True``, a buffer of 1,000 PubMed records or
10,000 small lines: ~20 and ~3 MB).

    .venv/bin/python benchmarks/workers_bench.py                 # ~25 min on 2 cores
    .venv/bin/python benchmarks/workers_bench.py --write-docs  # fill docs/performance.md
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
ds = StreamingJsonl(spec["path"], **shuffled)
ds = ds.batch(spec["batch"], ahead=spec.get("ahead", "auto"), worker_cpus=spec["worker_cpus"])
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

# (row label, workers, worker_cpus)
MODES = [
    ("0 workers", 0, "auto"),
    ("1 worker", 1, "auto"),
    ("1 worker, worker_cpus='all'", 1, "all"),
    ("2 workers", 2, "auto"),
    ("2 workers, worker_cpus='all'", 2, "all"),
]


# shuffle buffers, in records: ~20 MB of PubMed records, ~3 MB of small lines
BUFFERS = {"PubMed": 1000, "small lines": 10_000}


# copies of each corpus read in one run: runs of ~10 s, so that the workers' CPU measurement
# (`streamds.stages.cpus`: after 5 s, for ~2 s) is part of a run
COPIES = {"PubMed": 20, "small lines": 30}


def copied(zst: Path, copies: int) -> Path:
    """A directory of `copies` copies of the shard `zst` (made once, under bench-data/)."""
    from common import copies_folder

    folder = zst.parent.with_name(f"{zst.parent.name}-x{copies}")
    return copies_folder(zst, folder, copies, ".jsonl.zst")


def corpora(scale: float, copies_of: dict[str, int] = COPIES
            ) -> list[tuple[str, str, int, int, int | None]]:
    """(label, folder of copies, records per batch, records, shuffle buffer or None), each
    corpus in order and shuffled, read as `copies_of[corpus]` copies."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import pubmed_corpus, small_lines_corpus

    pubmed = pubmed_corpus(round(1e9 * scale))  # the throughput benchmark's corpora
    small = small_lines_corpus(round(3e8 * scale))
    cases = []
    for name, corpus, batch in (("PubMed", pubmed, 16), ("small lines", small, 1024)):
        copies = copies_of[name]
        for buffer in (None, BUFFERS[name]):
            label = f"{name} x {copies}, .batch({batch})" + (
                f", shuffled (buffer {buffer:,})" if buffer else "")
            cases.append((label, str(copied(corpus.zst, copies)), batch,
                          corpus.records * copies, buffer))
    return cases


def run(path: str, batch: int, workers: int, worker_cpus: str, buffer: int | None) -> dict:
    from common import child_result

    spec = {"path": path, "batch": batch, "workers": workers, "worker_cpus": worker_cpus,
            "buffer": buffer}
    return child_result(["-c", CHILD], spec, what=f"{path}, {workers} workers")


def main(argv: list[str] | None = None) -> int:
    from common import add_write_docs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scale", type=float, default=0.5)
    add_write_docs(parser, "workers")
    args = parser.parse_args(argv)
    from common import command_line, machine, publish

    rows = corpora(args.scale)
    began = time.perf_counter()
    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        turn = repeat % len(MODES)  # each round starts elsewhere: no row always goes first
        first = repeat % len(rows)
        for corpus, path, batch, records, buffer in rows[first:] + rows[:first]:
            for label, workers, worker_cpus in MODES[turn:] + MODES[:turn]:
                result = run(path, batch, workers, worker_cpus, buffer)
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
        f"0-worker run of its round (lowest-highest). worker_cpus='auto' is the default "
        f"(workers that fit beside the main process keep off one CPU; workers that do not "
        f"measure both ways and keep the faster); 'all' lets the OS place them. CPU: "
        f"getrusage of the main process during the loop, and of the reaped workers. Machine: "
        f"{machine()}. "
        f"Command: `{command_line()}`. Measured in {time.perf_counter() - began:.0f} s."
    )
    every_run = [{"corpus": corpus, "loader": label, "runs": r}
                 for (corpus, label), r in runs.items()]
    publish("workers_bench", body, every_run, "workers" if args.write_docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
