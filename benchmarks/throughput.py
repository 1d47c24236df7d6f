"""Loader throughput: StreamingJsonl against the machine's limit and against its peers.

Two corpora, generated once under bench-data/ (see `common.py`):

- PubMed layout: ~21 KB lines (article_text, abstract_text, sections, ...), 1 GB decoded at
  --scale 1, stored as a seekable .jsonl.zst (level 3, 4 MiB frames of whole lines), as plain
  .jsonl, and as 8 webdataset tar shards (one .json member per record).
- small lines: ~300-byte `{"id", "text", "label"}` lines, 300 MB decoded at --scale 1, in the
  same three layouts.

What runs, each reader through `torch.utils.data.DataLoader(batch_size=64,
collate_fn=keep_batch)` with num_workers 0, 1 and 2 (the loader's own costs are in every
number):

- limit: the machine's limit on one core, a plain loop doing zstd decompression (zstandard
  stream reader) + bulk line split (bytes.split) + orjson.loads of every line; and the same
  without decompression for the plain .jsonl. Its read size is the fastest of a few tried in
  the same run. "x limit" divides by the limit of the row's own input (.zst rows by the zstd
  limit; plain and tar rows by the plain limit). With workers a loader may use more than
  one core, so its ratio can exceed 1.
- limit in batches of 64: the zstd limit loop handing out lists of 64 records and keeping
  the last one while the next fills, as a training loop over a DataLoader does. Same work,
  more records alive: for ~21 KB PubMed records this alone costs a third of the limit on
  the reference machine (fewer of them stay in cache). It is the fairer ceiling for rows
  with batch_size=64.
- DataLoader only: records replayed from memory (nothing read or parsed), so the loader's
  per-record cost and, with workers, pickling, the pipe and unpickling in the main process.
  It bounds every reader that hands over the same records.
- StreamingJsonl on the seekable .jsonl.zst, and on the plain .jsonl for reference.
- Hugging Face `datasets`: load_dataset("json", data_files=<the .jsonl.zst>, streaming=True,
  split="train") through the same DataLoader (its IterableDataset is a torch one). It splits
  work by file, so with one file a second worker gets nothing.
- webdataset: WebDataset(<8 tar shards>, shardshuffle=False).map(parse), parse being
  orjson.loads of the .json member (the parser everyone else uses; `.decode()` would use
  the slower stdlib json).

Numbers are medians of --repeats timed runs after one untimed run (warm page cache,
imports); the plain loops (limit rows) count their fastest run, taken before and after the
other rows of their corpus. Records/s counts records; MB/s counts decoded JSONL bytes
(10^6), the same for every reader. Every full run must yield every record exactly once,
or the benchmark fails. Peers are slow on some corpora, so their runs stop after
--peer-cap seconds and count the records read by then (marked in the table);
StreamingJsonl and the limit always read all.

Other programs on the machine distort timings, so before each timed run the script waits
(within --quiet-wait bounds) until the rest of the machine is nearly idle, and it reports
the CPU that other processes used during the timed runs.

    python benchmarks/throughput.py                  # full size, ~12 minutes on 2 cores
    python benchmarks/throughput.py --scale 0.1      # a quick look
    python benchmarks/throughput.py --write-readme   # also put the table into README.md
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MB,
    README,
    Corpus,
    command_line,
    machine,
    machine_busy,
    own_cpu,
    pubmed_corpus,
    replace_section,
    small_lines_corpus,
)
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never ask the Hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

BATCH_SIZE = 64
LIMIT_READ_SIZES = (256 << 10, 1 << 20, 8 << 20)  # the limit loop keeps the fastest
REPLAY_POOL_BYTES = 64 << 20  # decoded bytes of records the DataLoader-only row cycles
BUSY = 0.25  # cores used by other processes that mark a row as measured on a busy machine


def keep_batch(batch: list) -> list:
    """collate_fn: the batch as the list of records it is (module-level, so it pickles)."""
    return batch


def parse_json_member(sample: dict) -> object:
    """webdataset map: a sample {"__key__": ..., "json": bytes} -> the parsed record."""
    import orjson

    return orjson.loads(sample["json"])


# -- the machine's limit -----------------------------------------------------------------------


def limit_zst(path: Path, read_size: int) -> int:
    """One core: zstd stream decompression, bulk line split, orjson.loads of every line."""
    import orjson
    import zstandard

    loads = orjson.loads
    records = 0
    tail = b""
    with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(
        raw, read_size=1 << 20, read_across_frames=True
    ) as reader:
        while data := reader.read(read_size):
            lines = (tail + data).split(b"\n")
            tail = lines.pop()
            parsed = [loads(line) for line in lines]
            records += len(parsed)
    return records + (1 if tail.strip() else 0)


def limit_zst_batches(path: Path, read_size: int, batch_size: int = BATCH_SIZE) -> int:
    """The zstd limit loop handing records out in lists of `batch_size`, the last list kept
    while the next one fills, as `for batch in loader:` keeps it: the same work, but more
    live records (a PubMed batch of 64 is ~1.3 MB of JSON), so fewer of them stay in cache.
    """
    import orjson
    import zstandard

    loads = orjson.loads
    records = 0
    tail = b""
    batch: list = []
    held: list = []
    with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(
        raw, read_size=1 << 20, read_across_frames=True
    ) as reader:
        while data := reader.read(read_size):
            lines = (tail + data).split(b"\n")
            tail = lines.pop()
            for line in lines:
                batch.append(loads(line))
                if len(batch) == batch_size:
                    held, batch = batch, []
                    records += len(held)
    return records + len(batch) + (1 if tail.strip() else 0)


def limit_plain(path: Path, read_size: int) -> int:
    """One core: unbuffered reads, bulk line split, orjson.loads of every line."""
    import orjson

    loads = orjson.loads
    records = 0
    tail = b""
    with open(path, "rb", buffering=0) as raw:
        while data := raw.read(read_size):
            lines = (tail + data).split(b"\n")
            tail = lines.pop()
            parsed = [loads(line) for line in lines]
            records += len(parsed)
    return records + (1 if tail.strip() else 0)


# -- loaders ---------------------------------------------------------------------------------


def _count(loader: DataLoader, cap: float | None = None) -> int:
    """Records the loader yields; with `cap`, stop after the batch that passes `cap` seconds."""
    records = 0
    deadline = None if cap is None else time.perf_counter() + cap
    for batch in loader:
        records += len(batch)
        if deadline is not None and time.perf_counter() > deadline:
            break
    return records


def _loader(dataset, workers: int) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=workers, collate_fn=keep_batch)


def streamds_run(path: Path, workers: int, cap: float | None = None) -> int:
    from streamds import StreamingJsonl

    return _count(_loader(StreamingJsonl(str(path)), workers), cap)


def hf_run(path: Path, workers: int, cap: float | None = None) -> int:
    import datasets

    datasets.logging.set_verbosity_error()  # "too many workers for 1 shard", every run
    dataset = datasets.load_dataset("json", data_files=str(path), streaming=True, split="train")
    return _count(_loader(dataset, workers), cap)


def wds_run(tars: Sequence[Path], workers: int, cap: float | None = None) -> int:
    import webdataset as wds

    urls = [str(tar) for tar in tars]
    dataset = wds.WebDataset(urls, shardshuffle=False).map(parse_json_member)
    return _count(_loader(dataset, workers), cap)


class ReplayRecords(IterableDataset):
    """`total` records cycled from `pool`, split over DataLoader workers; reads nothing."""

    def __init__(self, pool: list, total: int) -> None:
        self.pool = pool
        self.total = total

    def __iter__(self) -> Iterator[object]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        pool, size = self.pool, len(self.pool)
        for index in range(worker, self.total, workers):
            yield pool[index % size]


def replay_pool(corpus: Corpus) -> list:
    """The parsed records in the first REPLAY_POOL_BYTES of the corpus."""
    import orjson

    with open(corpus.plain, "rb") as f:
        lines = f.read(REPLAY_POOL_BYTES).split(b"\n")[:-1]
    return [orjson.loads(line) for line in lines]


def replay_run(pool: list, total: int, workers: int, cap: float | None = None) -> int:
    return _count(_loader(ReplayRecords(pool, total), workers), cap)


# -- measuring -------------------------------------------------------------------------------

class QuietWaiter:
    """Waits before a timed run until other processes leave the CPUs nearly idle.

    Each wait lasts at most `per_run` seconds and all waits together at most `total`, so a
    machine that never goes quiet costs a bounded delay (and the report says how busy it was).
    """

    def __init__(self, per_run: float, total: float, threshold: float = 0.25) -> None:
        self.per_run = per_run
        self.left = total
        self.threshold = threshold  # cores used by other processes that count as quiet

    def __call__(self) -> None:
        start = time.perf_counter()
        limit = min(self.per_run, self.left)
        while time.perf_counter() - start < limit:
            busy, own = machine_busy(), own_cpu()
            time.sleep(0.5)
            if (machine_busy() - busy - (own_cpu() - own)) / 0.5 < self.threshold:
                break
        self.left -= time.perf_counter() - start


@dataclass
class Result:
    corpus: Corpus
    reader: str
    source: str  # what it reads, for the table
    workers: int | None  # None: not a DataLoader (the plain loops)
    limit_key: str  # "zst" or "plain": the limit the ratio divides by
    note: str = ""
    is_limit: bool = False  # the row other rows divide by
    read_size: int = 0  # plain loops: bytes per read
    rates: list[float] = field(default_factory=list)  # records/s per timed run
    read: list[int] = field(default_factory=list)  # records per timed run
    cores: list[float] = field(default_factory=list)  # our CPU seconds / wall, per run
    others: list[float] = field(default_factory=list)  # cores others used, per run
    run: Callable[[], int] | None = field(default=None, repr=False)  # plain loops: the loop

    @property
    def records_per_s(self) -> float:
        """Median over the timed runs; for a plain loop, the fastest run (noise only slows)."""
        return max(self.rates) if self.workers is None else statistics.median(self.rates)

    @property
    def mb_per_s(self) -> float:
        """Decoded MB/s; a capped run's bytes are estimated from the mean line length."""
        return self.records_per_s * self.corpus.decoded_bytes / self.corpus.records / MB

    @property
    def partial(self) -> bool:
        return min(self.read) < self.corpus.records


def measure(
    result: Result,
    run: Callable[[], int],
    *,
    repeats: int,
    wait: QuietWaiter,
    log: Callable[[str], None],
    capped: bool = False,
) -> Result:
    """One untimed run, then `repeats` timed ones; a full run must yield every record once."""
    expected = result.corpus.records
    for attempt in range(repeats + 1):
        wait()
        busy, own = machine_busy(), own_cpu()
        start = time.perf_counter()
        records = run()
        wall = time.perf_counter() - start
        used = own_cpu() - own
        if records != expected and not (capped and 0 < records < expected):
            raise RuntimeError(
                f"{result.reader} ({result.source}, workers={result.workers}) yielded "
                f"{records} records; the corpus has {expected}"
            )
        if attempt:
            result.rates.append(records / wall)
            result.read.append(records)
            result.cores.append(used / wall)
            result.others.append(max(0.0, (machine_busy() - busy - used) / wall))
    share = f" ({min(result.read) / expected:.0%} read)" if result.partial else ""
    log(
        f"  {result.reader:<16} {result.source:<20} workers={result.workers!s:<4} "
        f"{result.mb_per_s:7.1f} MB/s{share}; runs: "
        + ", ".join(f"{r:,.0f} rec/s" for r in result.rates)
    )
    return result


def measure_limit(
    corpus: Corpus, key: str, *, repeats: int, wait: QuietWaiter, log: Callable[[str], None]
) -> Result:
    """The limit loop at the fastest of LIMIT_READ_SIZES (one timed pass each picks it).

    `again(result)` adds as many runs after the other rows of the corpus: the limit is the
    fastest of all, so a burst of load on the machine cannot make it look low.
    """
    path, loop = (corpus.zst, limit_zst) if key == "zst" else (corpus.plain, limit_plain)
    loop(path, LIMIT_READ_SIZES[0])  # page cache
    trials = {}
    for size in LIMIT_READ_SIZES:
        wait()
        start = time.perf_counter()
        loop(path, size)
        trials[size] = time.perf_counter() - start
    size = min(trials, key=trials.__getitem__)
    what = "zstd + split + orjson" if key == "zst" else "read + split + orjson"
    result = Result(corpus, "limit, 1 core", _source_name(path), None, key,
                    note=f"{what}, {size >> 10} KiB reads", is_limit=True, read_size=size)
    result.run = lambda: loop(path, size)
    return measure(result, result.run, repeats=repeats, wait=wait, log=log)


def measure_limit_batches(
    corpus: Corpus, limit: Result, *, repeats: int, wait: QuietWaiter,
    log: Callable[[str], None],
) -> Result:
    """The zstd limit loop in held batches of BATCH_SIZE, at the read size `limit` chose."""
    result = Result(corpus, f"limit in batches of {BATCH_SIZE}", _source_name(corpus.zst),
                    None, "zst", note="the last batch kept while the next fills",
                    read_size=limit.read_size)
    result.run = lambda: limit_zst_batches(corpus.zst, result.read_size)
    return measure(result, result.run, repeats=repeats, wait=wait, log=log)


def again(result: Result, *, repeats: int, wait: QuietWaiter, log: Callable[[str], None]) -> None:
    """More timed runs of a limit row (see measure_limit)."""
    measure(result, result.run, repeats=repeats, wait=wait, log=log)


def _source_name(path: Path) -> str:
    return "seekable .jsonl.zst" if path.name.endswith(".jsonl.zst") else ".jsonl"


# -- the report ------------------------------------------------------------------------------


def table(results: Sequence[Result]) -> str:
    limits = {(r.corpus.name, r.limit_key): r for r in results if r.is_limit}
    lines = [
        "| corpus | reader | input | workers | records/s | MB/s | x limit | cores used |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    shown = None
    for r in results:
        limit = limits[(r.corpus.name, r.limit_key)]
        corpus = "" if r.corpus.name == shown else _corpus_label(r.corpus)
        shown = r.corpus.name
        workers = "-" if r.workers is None else str(r.workers)
        source = f"{r.source} ({r.note})" if r.note else r.source
        if r.partial:
            source += f" (first {min(r.read) / r.corpus.records:.0%} of records)"
        busy = " †" if statistics.median(r.others) > BUSY else ""
        lines.append(
            f"| {corpus} | {r.reader} | {source} | {workers} | {r.records_per_s:,.0f} | "
            f"{r.mb_per_s:,.0f}{busy} | {r.mb_per_s / limit.mb_per_s:.2f} | "
            f"{statistics.median(r.cores):.1f} |"
        )
    return "\n".join(lines)


def _corpus_label(corpus: Corpus) -> str:
    line = corpus.decoded_bytes / corpus.records
    size = f"{line / 1000:.0f} KB" if line >= 1000 else f"{line:.0f} B"
    kind = "PubMed" if corpus.name.startswith("pubmed") else "small lines"
    return f"{kind}: {corpus.records:,} records, {corpus.decoded_bytes / MB:,.0f} MB, {size}/line"


def contention(results: Sequence[Result]) -> str:
    others = [o for r in results for o in r.others]
    flagged = sum(statistics.median(r.others) > BUSY for r in results)
    note = (
        f"Other processes used {statistics.fmean(others):.2f} cores on average during the "
        f"timed runs (worst run: {max(others):.2f})."
    )
    if flagged:
        note += f" † marks the {flagged} row(s) where they used more than {BUSY} cores."
    return note


# -- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="corpus size factor: 1 = 1 GB PubMed + 300 MB small lines")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--corpus", choices=["pubmed", "small"], nargs="+",
                        default=["pubmed", "small"])
    parser.add_argument("--readers", nargs="+", default=["replay", "streamds", "hf", "wds"],
                        choices=["replay", "streamds", "hf", "wds"],
                        help="rows besides the limit")
    parser.add_argument("--peer-cap", type=float, default=8.0,
                        help="seconds after which a peer's run stops (0: read everything)")
    parser.add_argument("--quiet-wait", type=float, nargs=2, default=[10.0, 150.0],
                        metavar=("PER_RUN", "TOTAL"),
                        help="max seconds to wait for an idle machine before each run, "
                        "and in all")
    parser.add_argument("--write-readme", action="store_true",
                        help=f"replace the bench:throughput section of {README.name}")
    args = parser.parse_args(argv)
    if args.scale <= 0 or args.repeats < 1 or args.peer_cap < 0:
        parser.error("--scale must be > 0, --repeats >= 1 and --peer-cap >= 0")

    command = command_line()
    host = machine()
    print(f"machine: {host}\ncommand: {command}\n", flush=True)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    corpora = []
    if "pubmed" in args.corpus:
        corpora.append(pubmed_corpus(round(1e9 * args.scale), log=log))
    if "small" in args.corpus:
        corpora.append(small_lines_corpus(round(3e8 * args.scale), log=log))

    options = {"repeats": args.repeats, "wait": QuietWaiter(*args.quiet_wait), "log": log}
    cap = args.peer_cap or None
    started = time.perf_counter()
    results: list[Result] = []
    for corpus in corpora:
        log(f"{corpus.name}: {corpus.records} records, {corpus.decoded_bytes / MB:.0f} MB")
        limits = [measure_limit(corpus, key, **options) for key in ("zst", "plain")]
        limits.append(measure_limit_batches(corpus, limits[0], **options))
        results.extend(limits)
        if "replay" in args.readers:
            pool = replay_pool(corpus)
            for workers in args.workers:
                result = Result(corpus, "DataLoader only", "records from memory", workers, "zst")
                run = partial(replay_run, pool, corpus.records, workers)
                results.append(measure(result, run, **options))
            del pool  # ~200 MB of records that would slow the collector in the rows below
            gc.collect()
        # (reader, limit key, input, run(workers) -> records, capped)
        rows: list[tuple[str, str, str, Callable[[int], int], bool]] = []
        if "streamds" in args.readers:
            rows.append(("StreamingJsonl", "zst", _source_name(corpus.zst),
                         lambda w, c=corpus: streamds_run(c.zst, w), False))
            rows.append(("StreamingJsonl", "plain", ".jsonl",
                         lambda w, c=corpus: streamds_run(c.plain, w), False))
        if "hf" in args.readers:
            rows.append(("HF datasets", "zst", _source_name(corpus.zst),
                         lambda w, c=corpus: hf_run(c.zst, w, cap), cap is not None))
        if "wds" in args.readers:
            rows.append(("webdataset", "plain", f"{len(corpus.tars)} tar shards",
                         lambda w, c=corpus: wds_run(c.tars, w, cap), cap is not None))
        for reader, key, source, run, capped in rows:
            for workers in args.workers:
                result = Result(corpus, reader, source, workers, key)
                results.append(
                    measure(result, lambda r=run, w=workers: r(w), capped=capped, **options)
                )
        for limit in limits:
            again(limit, **options)

    report = table(results)
    notes = contention(results)
    print(f"\n{report}\n\n{notes}\nmeasured in {time.perf_counter() - started:.0f}s", flush=True)
    if args.write_readme:
        body = (
            f"{report}\n\n"
            f"Machine: {host}. Medians of {args.repeats} runs after one untimed run; MB/s "
            "counts decoded JSONL bytes. \"x limit\" divides by one core running a plain "
            "loop over the same input (zstd decompression + `bytes.split` + `orjson.loads`; "
            "no decompression for `.jsonl` and tar), the fastest of its runs before and after "
            "the other rows; \"limit in batches of 64\" is that loop handing out lists of 64 "
            "records and keeping the last one while the next fills, as a training loop does "
            "(the fairer ceiling for batch_size=64). \"cores used\" is the loader's CPU time "
            f"over wall time. Every reader goes through DataLoader(batch_size={BATCH_SIZE}, "
            "collate_fn returning the list); \"DataLoader only\" replays parsed records from "
            "memory, the ceiling for any reader with that many workers. HF datasets splits "
            "work by file, so with one file only one worker reads; peers' runs stop after "
            f"{args.peer_cap:g} s. {notes} Compare rows within one table: between separate "
            "runs of the script on this shared VM, single rows moved by up to a third.\n\n"
            f"```\n{command}\n```"
        )
        replace_section(README, "throughput", body)
        log(f"wrote the table into {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
