"""Bench: how fast the input pipeline runs on the user's data, and which stage holds it back.

``streamds bench SOURCE`` builds the dataset the options describe (``--shuffle``,
``--buffer-size``, ``--transform``) and measures, on the first ``--records`` records or for
``--seconds`` after the first batch, whichever ends first:

1. the real pipeline, in this process, stage by stage: the dataset runs with a
   `streamds.stages.timing.StageTimer` attached (``ds.timer``), which times each stage of the reader
   (read = lines, parse, transform, even_ranks, emit: the shuffle buffer or the record
   flattener) where it runs. The loop collects records into batches of ``--batch-size`` and,
   unless ``--no-state-every-batch``, takes ``ds.state_dict()`` after every batch, as torchdata's
   StatefulDataLoader does; those calls are timed on the same timer. What the wall time holds
   beyond the stages and the states (collation, the loop itself, starting the reader) is
   "collate/other";
2. each way users load, for each ``--num-workers`` value: records/s over the whole run and
   the time to the first batch. The ways (`WAYS`): a plain ``DataLoader(ds, batch_size=B,
   collate_fn=as_list)``; ``.batch``, whole batches made in the workers,
   ``DataLoader(ds.batch(B), batch_size=None)``; and ``ds.loader(B)``, the one-call
   ``StatefulDataLoader`` (small records cross in large messages, cut in the main process).

Every rate is over the whole run, from ``iter()`` on: the wait for the first batch (workers
starting; a shuffle buffer filling, each record through the transform where it runs before
the buffer) is part of what a training run pays, and a rate counted from the first batch
would leave it out (a buffer that drains without refilling runs at the shuffle's speed, not
the transform's). Each run goes on for ``--seconds`` after its first batch, so the part after
the wait is measured however long the wait was; the time to the first batch is reported apart.

It prints a table and recommendations in one voice: the fastest way and ``num_workers``
measured (from the whole-run rates) and why; the costliest stage and what to do about it,
never advising workers where no way with workers beat the best without; why the first batch
is slow, where it is. With ``--json``, one JSON object. Progress goes to stderr: a bar per
measurement over its time limit, so what it shows as remaining is the real remaining time.

`run_bench()` returns the same report as a dict, for programs and tests.

Each measurement starts after a full garbage collection: the collection that importing torch
leaves pending (a walk over some 10^5 objects, about 0.1 s) would otherwise land on whichever
stage allocates first. Stages pass chunks of one read (256 KiB) each, so the stages before
emit may have handled up to one read more than the records counted. Timing each record costs
the emit stage's wrapper two clock reads (well under a microsecond); for very small records
that shows up in "collate/other".
"""

from __future__ import annotations

import argparse
import gc
import json
import marshal
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader
from tqdm import tqdm

from ..checks import check_int
from ..datasets.dataset import StreamingJsonl
from ..redact import redact
from ..spec import load_function
from ..stages.pipeline import Reader
from ..stages.timing import StageTimer
from ..train.collate import as_list

__all__ = ["main", "run_bench"]

DOMINANT = 0.5  # a stage taking this share of the time is "the bottleneck"
IO_BOUND = 0.6  # a pass using the CPU less than this share of its time waits on storage
NEAR_BEST = 0.95  # a run within 5% of the fastest, with fewer workers, is advised instead
MIN_RATED = 1e-3  # seconds: a stage that took less shows no records/s in the table
# the ways users load, simplest last: between runs equally fast, the one named first is
# advised (ds.loader is one call and resumes exactly; .batch resumes exactly too)
WAYS = ("ds.loader", ".batch", "DataLoader")
SLOW_FIRST_BATCH = 5.0  # seconds: a first batch slower than this gets a note saying why
STATE_CALLS = "state_dict"  # the timer's name for the bench's ds.state_dict() calls
# report rows: the reader's stages (source first), then what the consumer loop adds
ROW_OF_STAGE = {"lines": "read", "parse": "parse", "transform": "transform",
                "even_ranks": "even_ranks", "emit": "emit"}
READER_ROWS = {stage: ROW_OF_STAGE[stage] for stage in Reader.STAGES}
ROWS = (*READER_ROWS.values(), "state", "other")


def _rate(count: float, seconds: float) -> float | None:
    """`count` per second; None where no time was measured."""
    return count / seconds if seconds > 0 else None


def _close(iterator: Iterator[Any]) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def measure_pipeline(
    dataset: StreamingJsonl,
    *,
    batch_size: int,
    records: int,
    seconds: float,
    state_every_batch: bool,
    progress: bool,
) -> dict[str, Any]:
    """One in-process pass over `dataset` with a `StageTimer` attached: each stage's own
    seconds, the ``state_dict()`` calls after each batch, and the rest of the wall time; the
    time to the first batch and each stage's seconds up to it. It ends after `records` or
    `seconds` after the first batch."""
    timer = StageTimer()
    clock, cpu = time.perf_counter, time.process_time
    count = batches = 0
    batch: list[Any] = []
    message_bytes: float | None = None  # a record's share of a worker's message
    first_at: float | None = None
    before_first: dict[str, float] = {}  # each stage's own seconds up to the first batch

    def end_batch() -> None:
        nonlocal count, batches, batch, message_bytes, first_at
        if not batches:
            first_at = clock() - started
            before_first.update(timer.exclusive(Reader.STAGES))
            message_bytes = _marshalled_bytes(batch)
        as_list(batch)  # the collate DataLoader uses in the loader runs below
        count += len(batch)
        batches += 1
        bar.batch(clock(), count)
        batch = []
        if state_every_batch:
            start = clock()
            dataset.state_dict()
            timer.add(STATE_CALLS, clock() - start)

    dataset.timer = timer
    gc.collect()
    cpu_start, started = cpu(), clock()
    try:
        bar = _Progress("pipeline, 1 process", seconds, progress)
        stream = iter(dataset)
        try:
            for record in stream:
                batch.append(record)
                if len(batch) == batch_size:
                    end_batch()
                    if count >= records or clock() - started > (first_at or 0) + seconds:
                        break
            else:
                if batch:  # the short last batch of the corpus
                    end_batch()
        finally:
            bar.close()
            _close(stream)
        wall = clock() - started
        cpu_time = cpu() - cpu_start
        counts = dict(dataset.counts)
    finally:
        dataset.timer = None
    own = timer.exclusive(Reader.STAGES)
    spent = {READER_ROWS[name]: own[name] for name in Reader.STAGES}
    spent["state"] = timer.seconds.get(STATE_CALLS, 0.0)
    spent["other"] = max(0.0, wall - timer.outermost(Reader.STAGES) - spent["state"])
    stages = {
        name: {
            "seconds": secs,
            "share": secs / wall if wall > 0 else 0.0,
            "records_per_s": _rate(count, secs),
            "us_per_record": 1e6 * secs / count if count else None,
        }
        for name, secs in spent.items()
    }
    return {
        "records": count,
        "batches": batches,
        "counts": counts,  # lines without a record in the chunks read: bad, blank, dropped
        "seconds": wall,
        "records_per_s": _rate(count, wall),
        "first_batch_s": first_at,
        # where the wait for the first batch went (a shuffle buffer filling, and what each
        # of its records went through on the way in)
        "first_batch_stages": {READER_ROWS[name]: secs for name, secs in before_first.items()},
        "cpu_share": min(1.0, cpu_time / wall) if wall > 0 else 1.0,
        "state_every_batch": state_every_batch,
        "bytes_per_record": message_bytes,
        "stages": stages,
        "timer_seconds": dict(timer.seconds),  # cumulative, as the seam recorded them
    }


def _marshalled_bytes(batch: list[Any]) -> float | None:
    """Bytes a record takes in a worker's message (`RecordBatch`es travel marshalled); None
    for records marshal cannot carry."""
    try:
        return len(marshal.dumps(batch)) / len(batch) if batch else None
    except ValueError:
        return None


class _Progress:
    """A bar over a measurement's time limit, counted from its first batch (the wait before it
    is shown as waiting): what it shows as remaining is the time the run has left, also where
    the records limit ends it earlier."""

    def __init__(self, desc: str, seconds: float, enabled: bool) -> None:
        self.bar = tqdm(total=round(seconds, 1), desc=desc, unit="s", disable=not enabled,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s "
                        "[{elapsed}<{remaining}{postfix}]")
        self.bar.set_postfix_str("waiting for the first batch", refresh=False)
        self.first: float | None = None

    def batch(self, now: float, records: int) -> None:
        if self.first is None:
            self.first = now
        self.bar.set_postfix_str(f"{records:,} records", refresh=False)
        self.bar.update(min(self.bar.total, now - self.first) - self.bar.n)

    def close(self) -> None:
        self.bar.close()


@dataclass
class LoaderRun:
    """What one loader run measured, in seconds from ``iter(loader)``: its end, its first
    batch, and the end of the first batch (`warm_at`, `warm_records` records in by then)."""

    way: str
    num_workers: int
    records: int
    batches: int
    seconds: float
    first_batch_s: float | None
    warm_at: float | None
    warm_records: int

    def report(self) -> dict[str, Any]:
        """The run's report entry. `records_per_s` is over the whole run, the wait for the
        first batch included: the rate a training run gets, and the one advice comes from;
        the rate after the first batch is kept for comparison."""
        after = None
        if self.warm_at is not None and self.records > self.warm_records:
            after = _rate(self.records - self.warm_records, self.seconds - self.warm_at)
        return {
            "way": self.way,
            "num_workers": self.num_workers,
            "records": self.records,
            "batches": self.batches,
            "seconds": self.seconds,
            "time_to_first_batch_s": self.first_batch_s,
            "records_per_s": _rate(self.records, self.seconds),
            "records_per_s_after_first_batch": after,
        }


def build_loader(dataset: StreamingJsonl, way: str, *, num_workers: int,
                 batch_size: int) -> Any:
    """The loader of `way` (one of `WAYS`), yielding lists of `batch_size` records."""
    if way == "DataLoader":
        return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                          collate_fn=as_list)
    if way == ".batch":
        return DataLoader(dataset.batch(batch_size), batch_size=None, num_workers=num_workers)
    if way == "ds.loader":
        return dataset.loader(batch_size, num_workers=num_workers)
    raise ValueError(f"way must be one of {WAYS}, got {way!r}")


def code_of(way: str, num_workers: int, batch_size: int) -> str:
    """How a user writes the loader of `way`."""
    if way == "DataLoader":
        return (f"DataLoader(ds, batch_size={batch_size}, num_workers={num_workers}, "
                "collate_fn=as_list)")
    if way == ".batch":
        return f"DataLoader(ds.batch({batch_size}), batch_size=None, num_workers={num_workers})"
    return f"ds.loader({batch_size}, num_workers={num_workers})"


def measure_loader(
    dataset: StreamingJsonl,
    *,
    num_workers: int,
    batch_size: int,
    records: int,
    seconds: float,
    progress: bool,
    way: str = "DataLoader",
) -> dict[str, Any]:
    """The throughput of the loader of `way` with `num_workers` (`LoaderRun.report`), for
    `seconds` after its first batch or up to `records`."""
    loader = build_loader(dataset, way, num_workers=num_workers, batch_size=batch_size)
    timer = time.perf_counter
    count = batches = 0
    first = None
    warm_at, warm_count = None, 0  # the rate after the wait counts from the first batch
    gc.collect()
    bar = _Progress(f"{way} num_workers={num_workers}", seconds, progress)
    started = timer()
    iterator = iter(loader)
    try:
        for batch in iterator:
            now = timer()
            if first is None:
                first = now - started
            count += len(batch)
            batches += 1
            if warm_at is None:
                warm_at, warm_count = now - started, count
            bar.batch(now, count)
            if count >= records or now - started > first + seconds:
                break
    finally:
        elapsed = timer() - started
        bar.close()
        _close(iterator)
        del iterator  # shuts the workers down
    return LoaderRun(way, num_workers, count, batches, elapsed, first, warm_at,
                     warm_count).report()


def best_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run to advise: among those within `NEAR_BEST` of the fastest whole-run rate, the
    one with the fewest workers, then the way named first in `WAYS`."""
    rated = [r for r in runs if r["records_per_s"] is not None and r["records"] > 0]
    if not rated:
        return None
    top = max(r["records_per_s"] for r in rated)
    close = [r for r in rated if r["records_per_s"] >= NEAR_BEST * top]
    return min(close, key=lambda r: (r["num_workers"], WAYS.index(r.get("way", "DataLoader"))))


def _workers_help(report: dict[str, Any]) -> bool:
    """False where the runs showed that worker processes do not pay off in any way."""
    tried = {run["num_workers"] for run in report["loader"]}
    best = report.get("best")
    return not (best is not None and best["num_workers"] == 0 and len(tried) > 1)


def _stage_fix(name: str, report: dict[str, Any]) -> tuple[str, str]:
    """What stage `name` is, in words, and the fix that makes it cheaper. Adding workers is
    only suggested where the loader runs did not show that workers fail to pay off."""
    more = _workers_help(report)

    def fixes(*options: str, workers: str = "add workers") -> str:
        chosen = [workers, *options] if more else list(options)
        if not chosen:
            return "little to gain here"
        return chosen[0] if len(chosen) == 1 else f"{', '.join(chosen[:-1])} or {chosen[-1]}"

    if name == "transform":
        return ("your transform", fixes("store its output once with ds.cache(directory, "
                                        "key=...) so later epochs and resumes read it back",
                                        "make it cheaper",
                                        workers="add workers (it runs in them)"))
    if name == "parse":
        return ("JSON parsing", fixes("drop the fields you do not use when converting"))
    if name == "read":
        if report["remote"]:
            return ("reading (network)", "convert the data to .jsonl.zst shards (fewer bytes, "
                    "large reads), or prefix the URL with simplecache:: to read it from a "
                    "local copy after the first pass")
        if report["cpu_share"] < IO_BOUND:
            idle = 100 * (1 - report["cpu_share"])
            return ("reading (storage)", f"the process was off the CPU {idle:.0f}% of the time "
                    "(waiting on storage, or on a busy machine); copy the data to a local "
                    "disk, or convert it to .jsonl.zst shards (fewer bytes to read)")
        if report["compressed"]:
            return ("decompression", fixes("convert with a lower --level"))
        return ("reading (splitting lines)", fixes(workers="add workers (each reads its own "
                                                   "blocks)"))
    if name == "even_ranks":
        return ("even ranks", "it only counts records; a cost this size is a bug, please "
                "report it")
    if name == "emit":
        if report["shuffle"]:
            return ("the shuffle buffer", fixes("use a smaller buffer_size",
                                                workers="add workers (each shuffles its share)"))
        return ("handing out records", fixes(workers="add workers (each hands out its share)"))
    if name == "state":
        return ("taking the state after every batch", "snapshot less often: "
                "StatefulDataLoader(..., snapshot_every_n_steps=N)")
    return ("collate and the loop around the pipeline",
            fixes("make collate_fn cheaper", workers="add workers (collate runs in them)"))


def _recommend(report: dict[str, Any]) -> tuple[str | None, str | None, list[str]]:
    """(costliest stage, bottleneck: the costliest if it dominates, else None, notes)."""
    notes: list[str] = []
    stages = report["stages"]
    shares = {name: s["share"] for name, s in stages.items()}
    costliest = max(shares, key=shares.__getitem__) if any(shares.values()) else None
    bottleneck = None
    if costliest is not None:
        what, fix = _stage_fix(costliest, report)
        stage = stages[costliest]
        cost = f"{100 * stage['share']:.0f}% of the time"
        if stage["us_per_record"] is not None:
            cost += f", {stage['us_per_record']:,.1f} us/record"
        if shares[costliest] >= DOMINANT:
            bottleneck = costliest
            notes.append(f"{what} is the bottleneck ({cost}); {fix}")
        else:
            notes.append(f"no single stage dominates; the costliest is {what} ({cost}); {fix}")
    best = report.get("best")
    if best is not None:
        notes += _loader_notes(report, best)
        notes += _first_batch_note(report, best["time_to_first_batch_s"])
    return costliest, bottleneck, notes


def _loader_notes(report: dict[str, Any], best: dict[str, Any]) -> list[str]:
    """The advised loader, why (its rate against the plainest run), and where the workers
    stand: still gaining at the most tried, or not paying off in any way."""
    runs = report["loader"]
    rate, first = best["records_per_s"], best["time_to_first_batch_s"]
    after = "" if first is None else f", the first batch after {first:.2f} s"
    code = code_of(best["way"], best["num_workers"], report["batch_size"])
    top = max(runs, key=lambda r: r["records_per_s"] or 0.0)
    if top is best or top["records_per_s"] == rate:
        why = "the fastest way measured"
    else:  # within NEAR_BEST of the fastest: fewer workers, or a way that resumes exactly
        fewer = best["num_workers"] < top["num_workers"]
        why = (f"within {100 * (1 - rate / top['records_per_s']):.0f}% of the fastest, "
               f"{code_of(top['way'], top['num_workers'], report['batch_size'])}, with "
               f"{'fewer workers' if fewer else 'less to set up'}")
    plain = [r for r in runs if r["way"] == "DataLoader" and r["num_workers"] == 0
             and r["records_per_s"]]
    if plain and rate > 1.05 * plain[0]["records_per_s"]:
        why += f", {rate / plain[0]['records_per_s']:.2f}x a plain DataLoader with no workers"
    if best["way"] != "DataLoader":
        why += "; its state_dict() resumes exactly after any batch"
    notes = [f"use {code}: {rate:,.0f} records/s over the whole run{after} ({why})"]
    tried = sorted({r["num_workers"] for r in runs})
    same_way = {r["num_workers"]: r["records_per_s"] or 0.0 for r in runs
                if r["way"] == best["way"]}
    if best["num_workers"] == tried[-1] and len(tried) > 1 and rate > 1.2 * same_way[tried[-2]]:
        notes.append(f"throughput still grows with workers; try more than {tried[-1]} if you "
                     "have the cores")
    if best["num_workers"] == 0 and len(tried) > 1:
        notes.append("worker processes did not pay off in any way measured: their start-up "
                     "and hand-over cost more than the work they take over")
    return notes


def _first_batch_note(report: dict[str, Any], first: float | None) -> list[str]:
    """Why the advised loader's first batch came after `first` seconds, where that is slow,
    and what shortens it; the in-process pass says where its own wait went."""
    if first is None or first <= SLOW_FIRST_BATCH:
        return []
    buffer = f"{report['buffer_size']:,} records per reader; each worker fills its own"
    if not report["shuffle"]:
        return [f"the first batch takes {first:.1f} s, every epoch; use "
                "persistent_workers=True so that workers start once"]
    waited = report.get("first_batch_s") or 0.0
    mapped = report.get("first_batch_stages", {}).get("transform", 0.0)
    if not (report["transform"] and mapped >= DOMINANT * waited > 0):
        return [f"the first batch takes {first:.1f} s, every epoch and after every resume: a "
                f"reader fills its shuffle buffer ({buffer}) before it yields a record; a "
                "smaller buffer_size shortens the wait"]
    return [
        f"the first batch takes {first:.1f} s, every epoch and after every resume: a reader "
        f"fills its shuffle buffer ({buffer}) before it yields a record, and {mapped:.1f} s "
        f"of the {waited:.1f} s that the pass in one process waited for its first batch went "
        "to your transform over those records (it runs before the buffer under even_ranks, "
        "where each rank's quota counts what it keeps). ds.cache(directory, key=...) stores "
        "its output in the first epoch, so later epochs and resumes fill the buffer from "
        "disk; a smaller buffer_size shortens the first epoch's wait"
    ]


def build_dataset(
    source: str | Sequence[str],
    *,
    shuffle: bool,
    buffer_size: int,
    transform: Callable[[Any], Any] | None,
) -> StreamingJsonl:
    """The dataset the user would train on, as the bench's options describe it."""
    dataset = StreamingJsonl(source, shuffle=shuffle, buffer_size=buffer_size)
    return dataset if transform is None else dataset.map(transform)


def run_bench(
    source: str | Sequence[str],
    *,
    num_workers: Sequence[int] = (0, 1, 2),
    batch_size: int = 32,
    records: int = 100_000,
    seconds: float = 10.0,
    transform: Callable[[Any], Any] | str | None = None,
    shuffle: bool = False,
    buffer_size: int = 1000,
    state_every_batch: bool = True,
    progress: bool = False,
) -> dict[str, Any]:
    """Measure the pipeline on `source`; the report `streamds bench --json` prints."""
    check_int("batch_size", batch_size, 1, "the number of records per batch")
    check_int("records", records, 1, "the number of records to measure")
    check_int("buffer_size", buffer_size, 1, "the shuffle buffer, in records")
    if not num_workers:
        raise ValueError("num_workers must name at least one worker count, such as [0, 2]")
    for n in num_workers:
        check_int("num_workers", n, 0, "0 loads in the main process")
    name = transform if isinstance(transform, str) else getattr(transform, "__name__", None)
    fn = load_function(transform) if isinstance(transform, str) else transform
    dataset = build_dataset(source, shuffle=shuffle, buffer_size=buffer_size, transform=fn)
    shards = dataset.shards
    report: dict[str, Any] = {
        # printed and saved as JSON: credentials redacted
        "source": redact(source) if isinstance(source, str) else [
            redact(os.fspath(item)) for item in source],
        "shards": len(shards),
        "codecs": sorted({shard.codec or "none" for shard in shards}),
        "compressed": any(shard.codec for shard in shards),
        "remote": any("://" in shard.url and not shard.url.startswith("file://")
                      for shard in shards),
        "stored_bytes": sum(shard.size or 0 for shard in shards),
        "transform": name,
        "shuffle": shuffle,
        "buffer_size": buffer_size,
        "batch_size": batch_size,
        "cpu_count": os.cpu_count(),
    }
    report.update(measure_pipeline(dataset, batch_size=batch_size, records=records,
                                   seconds=seconds, state_every_batch=state_every_batch,
                                   progress=progress))
    report["loader"] = [
        measure_loader(dataset, way=way, num_workers=n, batch_size=batch_size,
                       records=records, seconds=seconds, progress=progress)
        for n in num_workers for way in WAYS  # the ways in turn, so machine noise hits all
    ]
    report["best"] = best_run(report["loader"])
    report["best_num_workers"] = None if report["best"] is None else report["best"]["num_workers"]
    report["costliest"], report["bottleneck"], report["recommendations"] = _recommend(report)
    return report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _per_record_us(report: dict[str, Any]) -> float | None:
    return 1e6 * report["seconds"] / report["records"] if report["records"] else None


def _label(name: str, report: dict[str, Any]) -> str:
    if name == "emit":
        return "shuffle" if report["shuffle"] else "emit"
    if name == "state":
        return "state" if report["state_every_batch"] else "state (off)"
    if name == "other":
        return "collate/other"
    return name


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table and recommendations."""
    options = [f"batch_size={report['batch_size']}"]
    if report["shuffle"]:
        options.append(f"shuffle, buffer_size={report['buffer_size']}")
    if report["transform"]:
        options.append(f"transform={report['transform']}")
    if report["state_every_batch"]:
        options.append("state_dict() after every batch")
    out = [
        f"source: {report['source']}  ({report['shards']} shard(s), codec "
        f"{'/'.join(report['codecs'])}, {report['stored_bytes'] / 1e6:,.1f} MB stored)",
        f"pipeline, 1 process: {report['records']:,} records in {report['seconds']:.2f} s "
        f"({_fmt(report['records_per_s'], ',.0f')} records/s, the first batch after "
        f"{_fmt(report['first_batch_s'], '.2f')} s); {', '.join(options)}",
        "",
        f"{'stage':<16}{'seconds':>9}{'share':>8}{'us/rec':>10}{'records/s':>14}",
    ]
    for name, stage in report["stages"].items():
        # a stage that took (almost) no time has no meaningful rate of its own
        rate = stage["records_per_s"] if stage["seconds"] >= MIN_RATED else None
        out.append(
            f"{_label(name, report):<16}{stage['seconds']:>9.3f}{100 * stage['share']:>7.1f}%"
            f"{_fmt(stage['us_per_record'], ',.2f'):>10}{_fmt(rate, ',.0f'):>14}"
        )
    out.append(f"{'total':<16}{report['seconds']:>9.3f}{100.0:>7.1f}%"
               f"{_fmt(_per_record_us(report), ',.2f'):>10}"
               f"{_fmt(report['records_per_s'], ',.0f'):>14}")
    out += [
        "",
        "records/s: over the whole run, the wait for the first batch included",
        f"{'way':<12}{'workers':>8}{'records/s':>12}{'1st batch':>11}",
    ]
    for run in report["loader"]:
        mark = "  <- advised" if run == report["best"] else ""
        out.append(
            f"{run['way']:<12}{run['num_workers']:>8}"
            f"{_fmt(run['records_per_s'], ',.0f'):>12}"
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
            f"expected integers such as 0 1 2 or 0,1,2, got {text!r}"
        ) from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 0, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _default_workers() -> list[int]:
    cores = os.cpu_count() or 1
    return [n for n in (0, 1, 2, 4, 8) if n <= cores]


def build_parser(prog: str = "streamds bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Measure the input pipeline on your data: where the time goes, stage by "
        "stage, and the throughput of each way to load (DataLoader, .batch, ds.loader) per "
        "num_workers; advise the fastest.",
    )
    parser.add_argument("source", nargs="+",
                        help="file, directory, glob or URL, as StreamingJsonl takes them")
    parser.add_argument("--num-workers", type=_workers_arg, nargs="+", default=None,
                        metavar="N", help="worker counts to try, as 0 1 2 or 0,1,2 (default: "
                        "0,1,2,4,8 up to the CPU count)")
    parser.add_argument("--batch-size", type=_positive, default=32)
    parser.add_argument("--records", type=_positive, default=100_000,
                        help="records per measurement (default 100000)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="time limit per measurement, counted from its first batch "
                        "(default 10); the wait for the first batch, such as a shuffle "
                        "buffer filling, is measured in full")
    parser.add_argument("--transform", default=None, metavar="MODULE:FUNCTION",
                        help="apply this function to each record, as ds.map(fn) would")
    parser.add_argument("--shuffle", action="store_true", help="include the shuffle buffer")
    parser.add_argument("--buffer-size", type=_positive, default=1000,
                        help="shuffle buffer in records, with --shuffle (default 1000)")
    parser.add_argument("--state-every-batch", action=argparse.BooleanOptionalAction,
                        default=True, help="take ds.state_dict() after every batch, as "
                        "StatefulDataLoader does (default: on)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``streamds bench``: returns the process exit code."""
    args = build_parser().parse_args(argv)
    source = args.source[0] if len(args.source) == 1 else args.source
    workers = [n for group in args.num_workers for n in group] if args.num_workers else None
    try:
        report = run_bench(
            source,
            num_workers=workers or _default_workers(),
            batch_size=args.batch_size,
            records=args.records,
            seconds=args.seconds,
            transform=args.transform,
            shuffle=args.shuffle,
            buffer_size=args.buffer_size,
            state_every_batch=args.state_every_batch,
            progress=not args.quiet,
        )
    except (OSError, ValueError, ImportError) as err:
        print(f"streamds bench: error: {redact(str(err))}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
