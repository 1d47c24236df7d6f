"""Reading Parquet (issue 35, item 7): records/s on a ccdv-like layout.

Five Parquet files of PubMed-layout rows (`article`, `abstract`, `section_names`), written
with pyarrow's default row groups, as the Hub's ``train-0000K-of-00005.parquet`` are. Measured,
each in a fresh process (medians over ``--rounds``):

- the floor: one core, ``ParquetFile.iter_batches`` + ``to_pylist`` over the files;
- streamds at 0 workers: ``for record in StreamingJsonl(folder)``;
- streamds with 2 workers and ``.batch(64)`` (``DataLoader(batch_size=None)``);
- Hugging Face ``datasets`` streaming the same files (``load_dataset("parquet",
  streaming=True)``) into ``DataLoader(batch_size=64, num_workers=2)``: what a user of
  `datasets` writes for the same job (the same workers, batch size and files);
- the same two, shuffled, as training reads: ``StreamingJsonl(folder, shuffle=True)`` and
  ``load_dataset(...).shuffle(seed=0)`` (its shards' order and a buffer of 1,000 rows).

Besides records/s (wall clock, which a busy machine bends), each run reports the CPU time of
the main process and of the DataLoader workers per 1,000 rows (reaped children), which load
on the machine moves far less.

    python benchmarks/parquet_bench.py                 # ~150 MB of rows, a few minutes
    python benchmarks/parquet_bench.py --mb 500 --rounds 3 --write-docs

The issue asks for 0 workers >= 0.8 of the floor and 2 workers >= 2x `datasets`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_write_docs, child_result, command_line, machine, publish

BATCH = 64
KINDS = ("iter_batches + to_pylist (one core)", "streamds, 0 workers",
         "streamds, 2 workers, .batch(64)", "datasets streaming, 2 workers, batch 64",
         "streamds, 2 workers, .batch(64), shuffle=True",
         "datasets streaming .shuffle(), 2 workers, batch 64")


def write_corpus(folder: Path, megabytes: int) -> int:
    """Five ccdv-like Parquet files of about `megabytes` in all; returns the row count."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    words = [f"w{n}" for n in range(5000)]
    folder.mkdir(parents=True, exist_ok=True)
    per_file = max(1, megabytes * 2**20 // 5 // 9000)  # ~9 KB of text per row
    total = 0
    for part in range(5):
        rows = [{"article": " ".join(rng.choices(words, k=1200)),
                 "abstract": " ".join(rng.choices(words, k=150)),
                 "section_names": "introduction\nmethods\nresults\nconclusion"}
                for _ in range(per_file)]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"train-{part:05d}-of-00005.parquet")
        total += len(rows)
    return total


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def measure(kind: str, folder: str) -> dict[str, Any]:
    """One epoch of `kind` in this process: records, seconds (imports left out: each kind
    imports its libraries first), CPU seconds of this process and of its workers, peak
    resident MB."""
    import pyarrow.parquet as pq
    from datasets import load_dataset
    from torch.utils.data import DataLoader

    from streamds import StreamingJsonl

    files = sorted(str(path) for path in Path(folder).glob("*.parquet"))
    start = time.perf_counter()
    main_cpu = cpu_seconds(resource.RUSAGE_SELF)
    workers_cpu = cpu_seconds(resource.RUSAGE_CHILDREN)
    records = 0
    if kind == KINDS[0]:
        for name in files:
            for batch in pq.ParquetFile(name).iter_batches(batch_size=1024,
                                                           use_threads=False):
                records += len(batch.to_pylist())
    elif kind == KINDS[1]:
        for _ in StreamingJsonl(folder):
            records += 1
    elif kind in (KINDS[2], KINDS[4]):
        loader = DataLoader(StreamingJsonl(folder, shuffle=kind == KINDS[4], seed=0)
                            .batch(BATCH), batch_size=None, num_workers=2)
        for batch in loader:
            records += len(batch)
    else:
        stream = load_dataset("parquet", data_files=files, split="train", streaming=True)
        if kind == KINDS[5]:
            stream = stream.shuffle(seed=0)
        for batch in DataLoader(stream, batch_size=BATCH, num_workers=2,
                                collate_fn=lambda rows: rows):
            records += len(batch)
    seconds = time.perf_counter() - start
    main_cpu = cpu_seconds(resource.RUSAGE_SELF) - main_cpu
    workers_cpu = cpu_seconds(resource.RUSAGE_CHILDREN) - workers_cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"records": records, "seconds": seconds, "main_cpu": main_cpu,
            "workers_cpu": workers_cpu, "peak_mb": max(peak, children)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=150, help="MB of rows in all (default 150)")
    parser.add_argument("--rounds", type=int, default=1)
    add_write_docs(parser, "parquet")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "pubmed"
        rows = write_corpus(folder, args.mb)
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
        for _ in range(args.rounds):
            for kind in KINDS:
                got = child_result([__file__, "--child"], [kind, str(folder)], what=kind)
                assert got["records"] == rows, (kind, got["records"], rows)
                runs[kind].append(got)
    rate = {kind: statistics.median(r["records"] / r["seconds"] for r in runs[kind])
            for kind in KINDS}
    lines = [f"{rows:,} rows in 5 Parquet files ({args.mb} MB of text, default row groups), "
             f"{machine()}; `{command_line()}`", "",
             "| reader | records/s | vs the floor | CPU ms / 1,000 rows: main | workers "
             "| peak MB |", "|---|---|---|---|---|---|"]
    for kind in KINDS:
        peak = statistics.median(r["peak_mb"] for r in runs[kind])
        main, workers = (statistics.median(1e6 * r[key] / r["records"] for r in runs[kind])
                         for key in ("main_cpu", "workers_cpu"))
        lines.append(f"| {kind} | {rate[kind]:,.0f} | {rate[kind] / rate[KINDS[0]]:.2f} | "
                     f"{main:.1f} | {workers:.1f} | {peak:,.0f} |")
    lines += ["", f"2 workers with `.batch(64)` over `datasets` streaming: "
                  f"{rate[KINDS[2]] / rate[KINDS[3]]:.2f}x; shuffled: "
                  f"{rate[KINDS[4]] / rate[KINDS[5]]:.2f}x."]
    publish("parquet", "\n".join(lines), runs, "parquet" if args.write_docs else None)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(*json.loads(sys.argv[2]))))
    else:
        main()
