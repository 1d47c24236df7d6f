"""Exact resume at full speed for short records: `Rebatch` over big batches from the workers.

torchdata's StatefulDataLoader has every worker take its state after every batch and the main
process file it: a fixed cost per batch, which short records at batch_size=32 pay thousands of
times a second (state_bench.py: StatefulDataLoader keeps ~0.55 of a plain DataLoader's
throughput there, and so does a trivial dataset). Workers that hand over 2,048-record batches
(``ds.batch(2048)``, ~270 KB) pay it 64 times less often, and `streamds.Rebatch` cuts them into the
32-record training batches in the main process, with an exact state.

One run, interleaved (every configuration once per repeat, in turn), each in a fresh child
process, medians of --repeats; a corpus of short records (`{"id", "text": ~100 chars}`, the
records of state_bench.py), shuffle=True with buffer_size=10,000, training batches of 32 records
turned into their ids by the same collate everywhere, 0, 1 and 2 workers:

- `DataLoader(ds, batch_size=32)`: what a user writes without resume;
- `StatefulDataLoader(ds, batch_size=32)`: the same with exact resume;
- `Rebatch(DataLoader(ds.batch(2048), batch_size=None), 32)`: big batches, no resume;
- `Rebatch(StatefulDataLoader(ds.batch(2048), batch_size=None), 32)`: big batches, exact
  resume (state_dict() after any training batch);
- `ds.loader(32, num_workers=...)`: the one call (training batches made in the workers and
  handed over several to a message, exact resume).

Every epoch is checked to yield each record once. Writes benchmarks/results/rebatch_bench.md and
.json (every run), docs/img/rebatch_bench.png, and with --write-docs the rebatch section of
docs/performance.md.

    .venv/bin/python benchmarks/rebatch_bench.py --quick           # smoke run, < 1 min
    .venv/bin/python benchmarks/rebatch_bench.py --write-docs    # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "img" / "rebatch_bench.png"  # shown in docs/performance.md
BUFFER = 10_000
TRAIN_BATCH = 32
BIG_BATCH = 2048
# configuration -> (loader, big batches?) ; the table's rows, in order
CONFIGS = {
    "DataLoader(ds, batch_size=32)": ("DataLoader", False),
    "StatefulDataLoader(ds, batch_size=32)": ("StatefulDataLoader", False),
    "Rebatch(DataLoader(ds.batch(2048)), 32)": ("DataLoader", True),
    "Rebatch(StatefulDataLoader(ds.batch(2048)), 32)": ("StatefulDataLoader", True),
    "ds.loader(32)": ("ds.loader", False),
}


def batch_ids(batch: list[dict]) -> list[int]:
    """The collate of every configuration: the ids of the training batch."""
    return [record["id"] for record in batch]


def measure(path: str, records: int, config: str, workers: int) -> dict:
    """Records/s of one epoch (worker start-up included) through `config`."""
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from streamds import Rebatch, StreamingJsonl

    loader_name, big = CONFIGS[config]
    loader_class = StatefulDataLoader if loader_name == "StatefulDataLoader" else DataLoader
    ds = StreamingJsonl(path, shuffle=True, buffer_size=BUFFER)
    start = time.perf_counter()
    if loader_name == "ds.loader":  # the one call: StatefulDataLoader, batches made in workers
        batches = ds.loader(TRAIN_BATCH, num_workers=workers, collate=batch_ids)
    elif big:
        loader = loader_class(ds.batch(BIG_BATCH), batch_size=None, num_workers=workers)
        batches = Rebatch(loader, TRAIN_BATCH, collate=batch_ids)
    else:
        batches = loader_class(ds, batch_size=TRAIN_BATCH, num_workers=workers,
                               collate_fn=batch_ids)
    seen = bytearray(records)
    for batch in batches:
        for i in batch:
            seen[i] += 1
    seconds = time.perf_counter() - start
    if seen.count(1) != records:
        raise RuntimeError(f"{config}, {workers} workers: an epoch did not yield every record "
                           "exactly once")
    return {"rate": records / seconds}


def short_records(records: int) -> Path:
    """The short-records corpus, written once under bench-data/."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import DATA_DIR
    from state_bench import write_short_records

    path = DATA_DIR / f"short-{records}.jsonl"
    if not path.exists():
        DATA_DIR.mkdir(exist_ok=True)
        partial = path.with_suffix(".partial")
        write_short_records(partial, records)
        partial.rename(path)
    return path


def run_child(path: Path, records: int, config: str, workers: int) -> dict:
    from common import child_result

    spec = {"path": str(path), "records": records, "config": config, "workers": workers}
    return child_result([__file__, "--child"], spec, what=f"{config}, {workers} workers")


def table(rates: dict[tuple[str, int], list[float]], workers: list[int]) -> str:
    med = {key: statistics.median(values) for key, values in rates.items()}
    head = "| records/s (median) | " + " | ".join(
        f"{w} worker{'' if w == 1 else 's'}" for w in workers) + " |"
    lines = [head, "|---|" + "---:|" * len(workers)]
    for config in CONFIGS:
        lines.append(f"| `{config}` | " + " | ".join(
            f"{med[config, w]:,.0f}" for w in workers) + " |")
    names = list(CONFIGS)
    ratios = [
        ("**exact resume / none**, batch_size=32", names[1], names[0]),
        ("**exact resume / none**, Rebatch", names[3], names[2]),
        ("**Rebatch with exact resume / DataLoader(batch_size=32)**", names[3], names[0]),
    ]
    for label, top, bottom in ratios:
        lines.append(f"| {label} | " + " | ".join(
            f"{med[top, w] / med[bottom, w]:.2f}" for w in workers) + " |")
    # the two Rebatch rows ran one after the other in every repeat: their ratio per repeat
    pairs = {w: [a / b for a, b in zip(rates[names[3], w], rates[names[2], w], strict=True)]
             for w in workers}
    lines.append("| exact resume / none, Rebatch: median (min-max) of the per-repeat ratios | "
                 + " | ".join(f"{statistics.median(pairs[w]):.2f} ({min(pairs[w]):.2f}-"
                              f"{max(pairs[w]):.2f})" for w in workers) + " |")
    return "\n".join(lines)


def plot(rates: dict[tuple[str, int], list[float]], workers: list[int], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed in this environment: no {path.name}"
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(CONFIGS)
    for i, config in enumerate(CONFIGS):
        xs = [x + (i - (len(CONFIGS) - 1) / 2) * width for x in range(len(workers))]
        values = [statistics.median(rates[config, w]) / 1000 for w in workers]
        bars = ax.bar(xs, values, width, label=config)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ax.set_xticks(range(len(workers)), [str(w) for w in workers])
    ax.set(xlabel="num_workers", ylabel="thousand records/s (median)",
           title="Short records, shuffle buffer 10,000, training batches of 32")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"![records/s per configuration and num_workers]({path.relative_to(ROOT / 'docs')})"


def main(argv: list[str] | None = None) -> int:
    from common import add_write_docs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, help="short records (1,200,000; quick 200,000)")
    parser.add_argument("--repeats", type=int, help="runs per cell (median); 5, quick 1")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true")
    add_write_docs(parser, "rebatch")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return 0
    records = args.records or (200_000 if args.quick else 1_200_000)
    repeats = args.repeats or (1 if args.quick else 5)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import command_line, machine, publish

    path = short_records(records)
    path.read_bytes()  # into the page cache
    began = time.perf_counter()
    rates: dict[tuple[str, int], list[float]] = {}
    for repeat in range(repeats):
        for workers in args.workers:
            for config in CONFIGS:
                rate = run_child(path, records, config, workers)["rate"]
                rates.setdefault((config, workers), []).append(rate)
                print(f"[{repeat + 1}/{repeats}] {workers} workers {config:<50} {rate:,.0f}",
                      file=sys.stderr, flush=True)
    body = "\n\n".join([
        table(rates, args.workers),
        f"Machine: {machine()}. Command: `{command_line()}`. {records:,} short records "
        f"(`{{\"id\", \"text\": ~100 chars}}`), shuffle=True, buffer_size={BUFFER:,}; every "
        f"row turns each training batch of {TRAIN_BATCH} into its ids; medians of {repeats} "
        "epochs per cell, each in a fresh process (worker start-up included), the "
        "configurations interleaved; every epoch checked to yield each record exactly once. "
        f"Measured in {time.perf_counter() - began:.0f} s.",
        plot(rates, args.workers, PLOT),
    ])
    publish("rebatch_bench", body,
            [{"config": c, "workers": w, "rates": r} for (c, w), r in rates.items()],
            "rebatch" if args.write_docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
