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

With ``--shuffle-map``, instead: the first batch of ``shuffle=True`` with an expensive ``.map``
(busy for --map-ms a record, as a tokenizer is) over the PubMed-layout corpus, through
``StatefulDataLoader(batch_size=16)`` with 0 and --workers workers, for each of
--buffer-sizes: fresh, and after loading a state taken 20 batches in. The map runs on
records as they leave the shuffle buffer, so neither filling it nor re-filling it on a
resume waits for --map-ms x buffer_size.

    .venv/bin/python benchmarks/first_batch.py --shuffle-map --repeats 3
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


SHUFFLE_MAP_CHILD = r"""
import json, pickle, sys, time
from torchdata.stateful_dataloader import StatefulDataLoader
from streamds import StreamingJsonl

spec = json.loads(sys.argv[1])

def costly(record):  # busy, as a tokenizer is (not a sleep: it takes the CPU)
    end = time.perf_counter() + spec["map_ms"] / 1e3
    while time.perf_counter() < end:
        pass
    return {"id": record["article_id"], "sentences": len(record["article_text"])}

def ids(batch):
    return [record["id"] for record in batch]

def loader():
    ds = StreamingJsonl(spec["path"], shuffle=True, seed=1,
                        buffer_size=spec["buffer_size"]).map(costly)
    return StatefulDataLoader(ds, batch_size=16, num_workers=spec["workers"], collate_fn=ids)

if __name__ == "__main__":
    start = time.perf_counter()
    first = loader()
    batches = iter(first)
    next(batches)
    fresh = time.perf_counter() - start
    for _ in range(20):
        next(batches)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    del batches, first
    start = time.perf_counter()
    again = loader()
    again.load_state_dict(state)
    next(iter(again))
    resumed = time.perf_counter() - start
    print(json.dumps({"fresh": fresh * 1e3, "resumed": resumed * 1e3}))
"""


def shuffle_map(args: argparse.Namespace) -> int:
    """The --shuffle-map table: first batch with a shuffle buffer and an expensive map."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import child_result, command_line, machine, publish, pubmed_corpus

    path = str(pubmed_corpus(round(3e8 * args.scale), record_chars=7_000).plain)
    sizes = [int(size) for size in args.buffer_sizes.split(",")]
    cells = [(size, workers) for size in sizes for workers in sorted({0, args.workers})]
    began = time.perf_counter()
    runs: dict[tuple[int, int], list[dict]] = {}
    for repeat in range(args.repeats):
        for size, workers in cells:
            spec = {"path": path, "buffer_size": size, "workers": workers,
                    "map_ms": args.map_ms}
            result = child_result(["-c", SHUFFLE_MAP_CHILD], spec, what=path)
            runs.setdefault((size, workers), []).append(result)
            print(f"[{repeat + 1}/{args.repeats}] buffer_size={size} workers={workers}: "
                  f"{result['fresh']:.0f} / {result['resumed']:.0f} ms", file=sys.stderr)

    def ms(cell: tuple[int, int], key: str) -> str:
        values = [r[key] for r in runs[cell]]
        return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"

    lines = ["| buffer_size | num_workers | first batch, fresh | first batch after a resume |",
             "|---:|---:|---:|---:|"]
    for cell in cells:
        lines.append(f"| {cell[0]:,} | {cell[1]} | {ms(cell, 'fresh')} | "
                     f"{ms(cell, 'resumed')} |")
    body = "\n".join(lines) + (
        f"\n\nMilliseconds from building the loader to holding its first batch: "
        f"StatefulDataLoader(batch_size=16), shuffle=True, a .map busy for {args.map_ms} ms a "
        f"record, PubMed-layout records; median (min-max) of {args.repeats} fresh processes per "
        f"cell, interleaved. Machine: {machine()}. Command: `{command_line()}`. Measured in "
        f"{time.perf_counter() - began:.0f} s."
    )
    every_run = [{"buffer_size": size, "workers": workers, "runs": r}
                 for (size, workers), r in runs.items()]
    publish("first_batch_shuffle_map", body, every_run,
            "first-batch-map" if args.write_docs else None)
    return 0


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
    parser.add_argument("--shuffle-map", action="store_true",
                        help="time the first batch with a shuffle buffer and an expensive map")
    parser.add_argument("--buffer-sizes", default="1000,10000",
                        help="with --shuffle-map: the buffer sizes, comma-separated")
    parser.add_argument("--map-ms", type=float, default=1.0,
                        help="with --shuffle-map: milliseconds the map takes per record")
    args = parser.parse_args(argv)
    if args.shuffle_map:
        return shuffle_map(args)
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
