"""Batches made in the workers (`ds.batch(n)`) against DataLoader batching, in one run.

    python benchmarks/batch_out.py CORPUS.jsonl [--workers 0 2] [--batch 256] [--repeats 3]

Shuffled (buffer 10,000), medians of the repeats, plain DataLoader and StatefulDataLoader.
Make a corpus with e.g. `python -m corpora.synthetic` or any JSONL file.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import StreamingJsonl, as_list


def rate(loader: Any) -> float:
    start = time.perf_counter()
    records = sum(len(batch) for batch in loader)
    return records / (time.perf_counter() - start)


def loaders(path: str, workers: int, batch: int) -> dict[str, Any]:
    def ds() -> StreamingJsonl:
        return StreamingJsonl(path, shuffle=True, buffer_size=10_000)

    made = {}
    for cls in (DataLoader, StatefulDataLoader):
        made[f"{cls.__name__}(ds, batch_size={batch})"] = cls(
            ds(), batch_size=batch, num_workers=workers, collate_fn=as_list)
        made[f"{cls.__name__}(ds.batch({batch}), batch_size=None)"] = cls(
            ds().batch(batch), batch_size=None, num_workers=workers, collate_fn=as_list)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| num_workers | loader | records/s |\n|---:|---|---:|")
    for workers in args.workers:
        runs: dict[str, list[float]] = {}
        for _ in range(args.repeats):  # interleaved, so machine noise hits every loader
            for name, loader in loaders(args.corpus, workers, args.batch).items():
                runs.setdefault(name, []).append(rate(loader))
        for name, rates in runs.items():
            print(f"| {workers} | `{name}` | {statistics.median(rates):,.0f} |")


if __name__ == "__main__":
    main()
