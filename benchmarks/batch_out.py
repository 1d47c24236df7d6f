"""Batches made in the workers (`ds.batch(n)`) against DataLoader batching, in one run.

    python benchmarks/batch_out.py CORPUS.jsonl [--workers 0 2] [--batch 256] [--repeats 3]

Shuffled (buffer 10,000), medians of the repeats, plain DataLoader and StatefulDataLoader,
with the time to the first batch (from building the dataset). `ds.batch(n)` runs without a
collate_fn: its batches (`streamds.RecordBatch`, parsed records crossing as one JSON document)
pass the DataLoader's default conversion untouched. Make a corpus with e.g.
`streamds synthetic small-lines lines.jsonl --bytes 100MB` or use any JSONL file.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import StreamingJsonl, as_list


def rate(make: Callable[[], Any]) -> tuple[float, float]:
    """(records/s, seconds to the first batch) of one pass of the loader `make()` builds."""
    start = time.perf_counter()
    loader = make()
    records = first = 0
    for batch in loader:
        if not records:
            first = time.perf_counter() - start
        records += len(batch)
    return records / (time.perf_counter() - start), first


def loaders(path: str, workers: int, batch: int) -> dict[str, Callable[[], Any]]:
    def ds() -> StreamingJsonl:
        return StreamingJsonl(path, shuffle=True, buffer_size=10_000)

    made: dict[str, Callable[[], Any]] = {}
    for cls in (DataLoader, StatefulDataLoader):
        made[f"{cls.__name__}(ds, batch_size={batch}, collate_fn=as_list)"] = partial(
            cls, ds(), batch_size=batch, num_workers=workers, collate_fn=as_list)
        made[f"{cls.__name__}(ds.batch({batch}), batch_size=None)"] = partial(
            cls, ds().batch(batch), batch_size=None, num_workers=workers)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| num_workers | loader | records/s | first batch |\n|---:|---|---:|---:|")
    for workers in args.workers:
        runs: dict[str, list[tuple[float, float]]] = {}
        for _ in range(args.repeats):  # interleaved, so machine noise hits every loader
            for name, make in loaders(args.corpus, workers, args.batch).items():
                runs.setdefault(name, []).append(rate(make))
        for name, results in runs.items():
            rates, firsts = zip(*results, strict=True)
            print(f"| {workers} | `{name}` | {statistics.median(rates):,.0f} | "
                  f"{statistics.median(firsts) * 1e3:,.0f} ms |")


if __name__ == "__main__":
    main()
