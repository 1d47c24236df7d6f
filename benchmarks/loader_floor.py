"""The DataLoader's own cost per message: how many items a second it hands over when the
dataset does nothing, at 0, 1 and 2 workers, with torch's DataLoader and torchdata's
StatefulDataLoader, in one run.

A worker's batch is one message; whatever streamds does, a loader with workers cannot deliver
more batches a second than this floor (the pipe, the index queue, pickling a ~100-byte
item, waking the main process). With `.batch(n)` of small records the floor decides how small
n may be before workers cost more than they bring (docs/performance.md, "Throughput").

    .venv/bin/python benchmarks/loader_floor.py             # ~1 min
    .venv/bin/python benchmarks/loader_floor.py --items 200000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

from common import command_line, machine, publish
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

PAYLOAD = b"x" * 100


class Same(IterableDataset):
    """`items` copies of one small bytes object, split over the workers."""

    def __init__(self, items: int) -> None:
        self.items = items

    def __iter__(self) -> Iterator[bytes]:
        info = get_worker_info()
        for _ in range(self.items // (1 if info is None else info.num_workers)):
            yield PAYLOAD


def as_is(item: bytes) -> bytes:
    return item


def rate(loader_type: type, workers: int, items: int) -> float:
    """Items a second from the first item to the last (the workers' start-up aside)."""
    batches = iter(loader_type(Same(items), batch_size=None, num_workers=workers,
                               collate_fn=as_is))
    next(batches)
    start, count = time.perf_counter(), 1
    for _ in batches:
        count += 1
    return (count - 1) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    loaders = [DataLoader, StatefulDataLoader]
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):  # interleaved rounds
        for loader_type in loaders:
            for workers in (0, 1, 2):
                rates.setdefault((loader_type.__name__, workers), []).append(
                    rate(loader_type, workers, args.items))
    lines = ["| loader | 0 workers | 1 worker | 2 workers |", "|---|---:|---:|---:|"]
    for loader_type in loaders:
        cells = [f"{statistics.median(rates[loader_type.__name__, w]):,.0f}" for w in (0, 1, 2)]
        lines.append(f"| {loader_type.__name__} | " + " | ".join(cells) + " |")
    body = "\n".join(lines) + (
        f"\n\nItems a second (one 100-byte item a message, nothing read or parsed), medians of "
        f"{args.repeats} interleaved rounds of {args.items:,} items. Machine: {machine()}. "
        f"Command: `{command_line()}`.")
    publish("loader_floor", body, [{"loader": loader, "workers": workers, "rates": r}
                                   for (loader, workers), r in rates.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
