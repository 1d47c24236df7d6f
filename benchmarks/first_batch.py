"""Time to the first batch in a fresh process, where a training script starts.

Each measurement is a new Python process that imports torch and streamds, builds the dataset
and a DataLoader (2 workers by default, batch_size=None) and takes one batch: the time from
building the dataset to holding the batch. Side by side, interleaved, medians of --repeats:

- a trivial IterableDataset (one tiny list): what torch's DataLoader costs by itself;
- streamds, PubMed-layout records (~15 KB) in batches of 64 from plain .jsonl and from
  seekable .jsonl.zst, and small lines (~300 B) in batches of 1,024;

each as it starts in a script, and again with ``gc.freeze()`` called after the imports. A
fresh process holds torch's freshly imported objects, hundreds of thousands of them, in the
cyclic garbage collector's young generations; the first full collection scans all of them
(~90 ms here) and often falls while the DataLoader starts its threads. ``gc.freeze()``
moves them to a generation the collector never scans. Also measured: the first batch a second
time in the same process (warm), as the throughput table does.

    .venv/bin/python benchmarks/first_batch.py                 # ~2 min on 2 cores
    .venv/bin/python benchmarks/first_batch.py --write-docs  # fill docs/performance.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import gc, json, sys, time
from torch.utils.data import DataLoader, IterableDataset
from streamds import StreamingJsonl

spec = json.loads(sys.argv[1])

class Trivial(IterableDataset):
    def __iter__(self):
        yield [1]

def first_batch():
    start = time.perf_counter()
    if spec["path"] is None:
        ds = Trivial()
    else:
        ds = StreamingJsonl(spec["path"]).batch(spec["batch"])
    batches = iter(DataLoader(ds, batch_size=None, num_workers=spec["workers"]))
    next(batches)
    seconds = time.perf_counter() - start
    del batches  # the workers shut down after the clock stopped
    return seconds * 1e3

if spec["freeze"]:
    gc.freeze()
cold = first_batch()
print(json.dumps({"cold": cold, "warm": first_batch()}))
"""


def corpora(scale: float) -> list[tuple[str, str | None, int]]:
    """(row label, path or None for the trivial dataset, batch size)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import pubmed_corpus, small_lines_corpus

    pubmed = pubmed_corpus(round(3e8 * scale), record_chars=7_000)  # state_bench.py's
    small = small_lines_corpus(round(6e7 * scale))
    return [
        ("trivial IterableDataset (torch alone)", None, 1),
        ("PubMed .jsonl, .batch(64)", str(pubmed.plain), 64),
        ("PubMed seekable .jsonl.zst, .batch(64)", str(pubmed.zst), 64),
        ("small lines seekable .jsonl.zst, .batch(1024)", str(small.zst), 1024),
    ]


def run(path: str | None, batch: int, workers: int, freeze: bool) -> dict:
    from common import child_result

    spec = {"path": path, "batch": batch, "workers": workers, "freeze": freeze}
    return child_result(["-c", CHILD], spec, what=str(path))


def main(argv: list[str] | None = None) -> int:
    from common import add_write_docs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="corpus size, as state_bench.py (the first batch reads little of it)")
    add_write_docs(parser, "first-batch")
    args = parser.parse_args(argv)
    from common import command_line, machine, publish

    rows = corpora(args.scale)
    began = time.perf_counter()
    runs: dict[tuple[str, bool], list[dict]] = {}
    for repeat in range(args.repeats):
        for label, path, batch in rows:
            for freeze in (False, True):
                result = run(path, batch, args.workers, freeze)
                runs.setdefault((label, freeze), []).append(result)
                print(f"[{repeat + 1}/{args.repeats}] {label:<48} freeze={freeze!s:<5} "
                      f"{result['cold']:.0f} / {result['warm']:.0f} ms", file=sys.stderr)

    def ms(label: str, freeze: bool, key: str) -> str:
        values = [r[key] for r in runs[label, freeze]]
        return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"

    lines = ["| dataset | first batch, fresh process | with `gc.freeze()` after the imports "
             "| second loader, same process |", "|---|---:|---:|---:|"]
    for label, _, _ in rows:
        lines.append(f"| {label} | {ms(label, False, 'cold')} | {ms(label, True, 'cold')} | "
                     f"{ms(label, False, 'warm')} |")
    body = "\n".join(lines) + (
        f"\n\nMilliseconds from building the dataset to holding the first batch, "
        f"DataLoader(batch_size=None, num_workers={args.workers}); median (min-max) of "
        f"{args.repeats} fresh processes per cell, interleaved. Machine: {machine()}. "
        f"Command: `{command_line()}`. Measured in {time.perf_counter() - began:.0f} s."
    )
    every_run = [{"dataset": label, "freeze": freeze, "runs": r}
                 for (label, freeze), r in runs.items()]
    publish("first_batch", body, every_run, "first-batch" if args.write_docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
