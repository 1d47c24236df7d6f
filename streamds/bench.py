"""Bench: how fast the input pipeline runs on the user's data, and which stage holds it back.

``streamds bench SOURCE`` measures, on the first ``--records`` records:

1. each stage on one core, timed separately in a single pass: read (storage I/O, decompression
   and line splitting, via `streamds.read.read_lines` over the dataset's blocks), parse
   (``orjson.loads``) and the user's ``--transform``;
2. a ``DataLoader`` over ``StreamingJsonl(SOURCE).map(transform)`` for each ``--num-workers``
   value: records/s, MB/s and the time to the first batch.

It prints a table and recommendations (the best ``num_workers``; which stage is the
bottleneck), or with ``--json`` one JSON object. Progress bars go to stderr.

`run_bench()` returns the same report as a dict, for programs and tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from typing import Any

import orjson
from torch.utils.data import DataLoader
from tqdm import tqdm

from .collate import as_list
from .dataset import StreamingJsonl
from .plan import make_blocks
from .read import read_lines
from .spec import load_function

__all__ = ["main", "run_bench"]

DOMINANT = 0.5  # a stage taking this share of the per-record time is "the bottleneck"
IO_BOUND = 0.6  # a read stage using the CPU less than this share of its time waits on storage
NEAR_BEST = 0.95  # fewer workers within 5% of the best are recommended instead
MB = 1e6


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def _finite(value: float) -> float | None:
    return value if value != float("inf") else None


def measure_stages(
    dataset: StreamingJsonl,
    transform: Callable[[Any], Any] | None,
    *,
    records: int,
    seconds: float,
    progress: bool,
) -> dict[str, Any]:
    """Per-stage time on one core over the first `records` records (or `seconds`)."""
    shards = dataset.shards
    blocks = make_blocks(shards, dataset.block_size)
    timer, cpu = time.perf_counter, time.process_time
    spent = {"read": 0.0, "parse": 0.0, "transform": 0.0}
    read_cpu = 0.0
    lines = parsed = kept = decoded = 0
    started = timer()
    with tqdm(total=records, desc="stages", unit="rec", disable=not progress) as bar:
        for block_id, block in enumerate(blocks):
            if parsed >= records or timer() - started > seconds:
                break
            chunks = read_lines(shards[block.shard], block, block_id)
            with closing(chunks):
                while parsed < records and timer() - started <= seconds:
                    c0, t0 = cpu(), timer()
                    chunk = next(chunks, None)
                    t1 = timer()
                    read_cpu += cpu() - c0
                    spent["read"] += t1 - t0
                    if chunk is None:
                        break
                    lines += len(chunk.lines)
                    decoded += sum(map(len, chunk.lines)) + len(chunk.lines)
                    values = [orjson.loads(line) for line in chunk.lines if line.strip()]
                    t2 = timer()
                    spent["parse"] += t2 - t1
                    if transform is not None:
                        kept += sum(1 for value in values if transform(value) is not None)
                    else:
                        kept += len(values)
                    spent["transform"] += timer() - t2
                    parsed += len(values)
                    bar.update(len(values))
    if transform is None:
        del spent["transform"]
    total = sum(spent.values())
    stages = {}
    for name, secs in spent.items():
        stages[name] = {
            "seconds": secs,
            "records_per_s": _finite(_rate(parsed, secs)),
            "mb_per_s": _finite(_rate(decoded / MB, secs)),
            "us_per_record": 1e6 * secs / parsed if parsed else None,
            "share": secs / total if total > 0 else 0.0,
        }
    stages["read"]["cpu_share"] = min(1.0, read_cpu / spent["read"]) if spent["read"] else 1.0
    return {
        "records": parsed,
        "lines": lines,
        "kept": kept,
        "bytes": decoded,
        "mean_record_bytes": decoded / lines if lines else 0.0,
        "single_core_records_per_s": _finite(_rate(parsed, total)),
        "stages": stages,
    }


def measure_loader(
    dataset: StreamingJsonl,
    *,
    num_workers: int,
    batch_size: int,
    records: int,
    seconds: float,
    mean_record_bytes: float,
    progress: bool,
) -> dict[str, Any]:
    """DataLoader throughput with `num_workers`, start-up included and excluded."""
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                        collate_fn=as_list)
    timer = time.perf_counter
    count = batches = first_count = 0
    first = None
    started = timer()
    desc = f"loader num_workers={num_workers}"
    with tqdm(total=records, desc=desc, unit="rec", disable=not progress) as bar:
        iterator = iter(loader)
        try:
            for batch in iterator:
                if first is None:
                    first, first_count = timer() - started, len(batch)
                count += len(batch)
                batches += 1
                bar.update(len(batch))
                if count >= records or timer() - started > seconds:
                    break
        finally:
            elapsed = timer() - started
            del iterator  # shuts the workers down
    steady_time = elapsed - (first or 0.0)
    steady = _rate(count - first_count, steady_time) if batches > 1 else _rate(count, elapsed)
    return {
        "num_workers": num_workers,
        "records": count,
        "batches": batches,
        "seconds": elapsed,
        "time_to_first_batch_s": first,
        "records_per_s": _finite(steady),
        "records_per_s_with_startup": _finite(_rate(count, elapsed)),
        "mb_per_s": _finite(steady * mean_record_bytes / MB),
    }


def _best_workers(runs: list[dict[str, Any]]) -> int | None:
    rated = [r for r in runs if r["records_per_s"] is not None and r["records"] > 0]
    if not rated:
        return None
    top = max(r["records_per_s"] for r in rated)
    return min(r["num_workers"] for r in rated if r["records_per_s"] >= NEAR_BEST * top)


def _recommend(report: dict[str, Any]) -> tuple[str | None, list[str]]:
    notes: list[str] = []
    stages = report["stages"]
    shares = {name: s["share"] for name, s in stages.items()}
    bottleneck = max(shares, key=shares.get) if shares else None
    if bottleneck is not None and shares[bottleneck] < DOMINANT:
        bottleneck = None
    if bottleneck is not None:
        stage = stages[bottleneck]
        cost = f"{100 * stage['share']:.0f}% of the per-record time, " \
               f"{stage['us_per_record']:.0f} us/record"
        if bottleneck == "transform":
            notes.append(
                f"your transform is the bottleneck ({cost}); make it cheaper, run it once at "
                "conversion time (streamds convert --transform), or add workers"
            )
        elif bottleneck == "read" and stage["cpu_share"] < IO_BOUND:
            notes.append(
                f"storage I/O is the bottleneck ({cost}, {100 * stage['cpu_share']:.0f}% of it "
                "on the CPU, the rest waiting for storage); copy the data to local disk, or "
                "convert it to .jsonl.zst shards (fewer bytes to fetch)"
            )
        elif bottleneck == "read" and report["compressed"]:
            notes.append(
                f"decompression is the bottleneck ({cost}); add workers, or convert with a "
                "lower compression level"
            )
        elif bottleneck == "read":
            notes.append(
                f"reading (splitting lines on the CPU) is the bottleneck ({cost}); add workers "
                "so that more blocks are read at once"
            )
        else:
            kb = report["mean_record_bytes"] / 1000
            notes.append(
                f"JSON parsing is the bottleneck ({cost}; records average {kb:.1f} kB); drop "
                "fields you do not use when converting"
            )
    else:
        notes.append("no single stage dominates the per-record time")
    runs, best = report["loader"], report["best_num_workers"]
    if best is not None:
        by_workers = {r["num_workers"]: r for r in runs}
        rate = by_workers[best]["records_per_s"]
        notes.append(f"use num_workers={best} ({rate:,.0f} records/s)")
        tried = sorted(by_workers)
        if best == tried[-1] and len(tried) > 1:
            below = by_workers[tried[-2]]["records_per_s"] or 0.0
            if rate > 1.2 * below:
                notes.append(
                    f"throughput still grows with workers; try more than {best} if you "
                    "have the cores"
                )
        if best == 0 and len(tried) > 1:
            notes.append(
                "worker processes do not pay off here: their start-up and transfer cost more "
                "than the work they take over"
            )
        first = by_workers[best]["time_to_first_batch_s"]
        if first is not None and first > 5:
            notes.append(
                f"the first batch takes {first:.1f} s; use persistent_workers=True so that "
                "workers start once, not every epoch"
            )
    return bottleneck, notes


def run_bench(
    source: str | Sequence[str],
    *,
    num_workers: Sequence[int] = (0, 1, 2),
    batch_size: int = 32,
    records: int = 10_000,
    seconds: float = 10.0,
    transform: Callable[[Any], Any] | str | None = None,
    shuffle: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Measure the pipeline on `source`; the report `streamds bench --json` prints."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if isinstance(records, bool) or not isinstance(records, int) or records < 1:
        raise ValueError(f"records must be an integer >= 1, got {records!r}")
    if not num_workers or any(n < 0 for n in num_workers):
        raise ValueError(f"num_workers must be integers >= 0, got {list(num_workers)}")
    name = transform if isinstance(transform, str) else getattr(transform, "__name__", None)
    fn = load_function(transform) if isinstance(transform, str) else transform
    dataset = StreamingJsonl(source, shuffle=shuffle)
    shards = dataset.shards
    report: dict[str, Any] = {
        "source": source if isinstance(source, str) else list(source),
        "shards": len(shards),
        "codecs": sorted({shard.codec or "none" for shard in shards}),
        "compressed": any(shard.codec for shard in shards),
        "stored_bytes": sum(shard.size or 0 for shard in shards),
        "transform": name,
        "batch_size": batch_size,
        "cpu_count": os.cpu_count(),
    }
    report.update(measure_stages(dataset, fn, records=records, seconds=seconds,
                                 progress=progress))
    mapped = dataset if fn is None else dataset.map(fn)
    report["loader"] = [
        measure_loader(mapped, num_workers=n, batch_size=batch_size, records=records,
                       seconds=seconds, mean_record_bytes=report["mean_record_bytes"],
                       progress=progress)
        for n in num_workers
    ]
    report["best_num_workers"] = _best_workers(report["loader"])
    report["bottleneck"], report["recommendations"] = _recommend(report)
    return report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table and recommendations."""
    out = [
        f"source: {report['source']}  ({report['shards']} shard(s), codec "
        f"{'/'.join(report['codecs'])}, {report['stored_bytes'] / MB:,.1f} MB stored)",
        f"measured {report['records']:,} records, {report['bytes'] / MB:,.1f} MB decoded, "
        f"{report['mean_record_bytes'] / 1000:,.1f} kB/record",
        "",
        f"{'stage (1 core)':<16}{'records/s':>12}{'MB/s':>10}{'us/rec':>10}{'share':>8}",
    ]
    for name, stage in report["stages"].items():
        out.append(
            f"{name:<16}{_fmt(stage['records_per_s'], ',.0f'):>12}"
            f"{_fmt(stage['mb_per_s'], ',.1f'):>10}{_fmt(stage['us_per_record'], ',.1f'):>10}"
            f"{100 * stage['share']:>7.0f}%"
        )
    out.append(f"{'all stages':<16}{_fmt(report['single_core_records_per_s'], ',.0f'):>12}")
    out += [
        "",
        f"{'DataLoader':<16}{'records/s':>12}{'MB/s':>10}{'1st batch':>11}",
    ]
    for run in report["loader"]:
        mark = "  <- best" if run["num_workers"] == report["best_num_workers"] else ""
        out.append(
            f"{'num_workers=' + str(run['num_workers']):<16}"
            f"{_fmt(run['records_per_s'], ',.0f'):>12}{_fmt(run['mb_per_s'], ',.1f'):>10}"
            f"{_fmt(run['time_to_first_batch_s'], '.2f'):>9} s{mark}"
        )
    out.append("")
    out += [f"- {note}" for note in report["recommendations"]]
    return "\n".join(out)


def _workers_arg(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 0,1,2,4, got {text!r}"
        ) from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 0, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _default_workers() -> list[int]:
    cores = os.cpu_count() or 1
    return [n for n in (0, 1, 2, 4, 8) if n <= cores]


def build_parser(prog: str = "streamds bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Measure the input pipeline on your data: per-stage speed, DataLoader "
        "throughput per num_workers, and where the time goes.",
    )
    parser.add_argument("source", nargs="+",
                        help="file, directory, glob or URL, as StreamingJsonl takes them")
    parser.add_argument("--num-workers", type=_workers_arg, default=None,
                        help="comma-separated worker counts to try (default: 0,1,2,4,8 up to "
                        "the CPU count)")
    parser.add_argument("--batch-size", type=_positive, default=32)
    parser.add_argument("--records", type=_positive, default=10_000,
                        help="records per measurement (default 10000)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="time limit per measurement (default 10)")
    parser.add_argument("--transform", default=None, metavar="MODULE:FUNCTION",
                        help="apply this function to each record, as ds.map(fn) would")
    parser.add_argument("--shuffle", action="store_true", help="include the shuffle buffer")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``streamds bench``: returns the process exit code."""
    args = build_parser().parse_args(argv)
    source = args.source[0] if len(args.source) == 1 else args.source
    try:
        report = run_bench(
            source,
            num_workers=args.num_workers or _default_workers(),
            batch_size=args.batch_size,
            records=args.records,
            seconds=args.seconds,
            transform=args.transform,
            shuffle=args.shuffle,
            progress=not args.quiet,
        )
    except (OSError, ValueError, ImportError) as err:
        print(f"streamds bench: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
