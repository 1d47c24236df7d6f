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
- limit, 2 cores: two zstd limit loops at once, one process each (a pool started before the
  timing): the records/s both deliver together, the ceiling for any loader with workers on
  a 2-core machine (caches, memory bandwidth and the VM's host are shared).
- limit in batches of 64: the zstd limit loop handing out lists of 64 records and keeping
  the last one while the next fills, as a training loop over a DataLoader does. Same work,
  more records alive: for ~21 KB PubMed records this alone costs a third of the limit on
  the reference machine (fewer of them stay in cache). It is the fairer ceiling for rows
  with batch_size=64.
- DataLoader only: records replayed from memory (nothing read or parsed), so the loader's
  per-record cost and, with workers, pickling, the pipe and unpickling in the main process.
  It bounds every reader that hands over the same records.
- StreamingJsonl on the seekable .jsonl.zst, and on the plain .jsonl for reference.
- StreamingJsonl .batch(64): the same reader handing the DataLoader whole batches
  (``DataLoader(ds.batch(64), batch_size=None)``, no collate_fn): one message per batch; a
  worker's batch is written into a ring of shared memory and only a descriptor crosses the
  pipe (`streamds.stages.batch.RecordBatch`, `streamds.handover.shm_ring`). The row with
  prefetch_factor=8 lets each worker run 8 batches ahead instead of the DataLoader's 2; the
  "~300 KB a batch" row sizes batches in bytes rather than records (16 PubMed records, 1024
  small lines), the message size that measured best with 2 workers. From a worker those
  batches cross as their JSON lines and the main process parses them
  (`streamds.stages.parse_later`); the "parsed in the workers" row runs the same batches with
  on_error='skip', which needs the values in the worker (parse, marshal, send): the path
  every batch took before.
- DataLoader only, batches: the replayed records in lists of 64 yielded by the dataset as
  whole batches, as pickled lists and as RecordBatch (marshal through shared memory, what
  `.batch()` sends): the ceiling of the batched path.
- Hugging Face `datasets`: load_dataset("json", data_files=<the .jsonl.zst>, streaming=True,
  split="train") through the same DataLoader (its IterableDataset is a torch one). It splits
  work by file, so with one file a second worker gets nothing.
- webdataset: WebDataset(<8 tar shards>, shardshuffle=False).map(parse), parse being
  orjson.loads of the .json member (the parser everyone else uses; `.decode()` would use
  the slower stdlib json).

Numbers are medians of --repeats timed runs after one untimed run (warm page cache). Every
DataLoader run is a fresh process that imports its reader, calls ``gc.freeze()`` (as the
docs recommend after a training script's imports) and reads; its records/s count from the
first batch to the last (the start-up is the "first batch" column; "x limit, whole run" counts
it in). One long process running every row made rows depend on what ran before (small lines
with workers 0.57x of 0 workers there, ~1x in fresh processes). The plain loops (limit rows)
run in this process and count their fastest run, taken before and after the other rows of
their corpus. Records/s counts records; MB/s counts decoded JSONL bytes
(10^6), the same for every reader. Every full run must yield every record exactly once,
or the benchmark fails. Peers are slow on some corpora, so their runs stop after
--peer-cap seconds and count the records read by then (marked in the table);
StreamingJsonl and the limit always read all.

Every DataLoader row also reports the time to its first batch (from building the dataset
to holding the first batch, median of the runs) and the peak memory of the whole process tree
(main process plus workers, sum of RSS sampled every 10 ms by psutil) in one run of its own in
a fresh process, so that no row inherits another's memory. A second table gives the cost of
one batch crossing from a worker: pickle.dumps + pickle.loads of a list of 64 records against
orjson.dumps + orjson.loads and marshal.dumps + marshal.loads of the same list.

Other programs on the machine distort timings, so before each timed run the script waits
(within --quiet-wait bounds) until the rest of the machine is nearly idle, and it reports
the CPU that other processes used during the timed runs.

    python benchmarks/throughput.py                  # full size, ~12 minutes on 2 cores
    python benchmarks/throughput.py --scale 0.1      # a quick look
    python benchmarks/throughput.py --write-docs   # also put the table into docs/performance.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import multiprocessing
import os
import pickle
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MB,
    PERFORMANCE,
    Corpus,
    add_write_docs,
    child_result,
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


def limit_zst_pair(pool: Any, path: Path, read_size: int) -> int:
    """Two zstd limit loops at once, each in a process of `pool` over the whole corpus: what
    the machine's two cores deliver together (they share caches, memory bandwidth and, on a
    VM, the host). Returns the records both read."""
    return sum(pool.starmap(limit_zst, [(path, read_size)] * 2))


def limit_zst_batches(path: Path, read_size: int, batch_size: int | None = None) -> int:
    """The zstd limit loop handing records out in lists of `batch_size`, the last list kept
    while the next one fills, as `for batch in loader:` keeps it: the same work, but more
    live records (a PubMed batch of 64 is ~1.3 MB of JSON), so fewer of them stay in cache.
    """
    import orjson
    import zstandard

    loads = orjson.loads
    batch_size = batch_size or BATCH_SIZE
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


# the last loader run: seconds from building the dataset to the first batch, and the records
# and seconds after it (the steady part, start-up aside)
LAST_RUN: dict[str, float] = {}


def _count(loader: DataLoader, cap: float | None = None, *, started: float) -> int:
    """Records the loader yields; with `cap`, stop after the batch that passes `cap` seconds.
    Sets LAST_RUN from `started` (before the dataset was built)."""
    records = 0
    deadline = None if cap is None else time.perf_counter() + cap
    first_at = None
    for batch in loader:
        if first_at is None:
            first_at = time.perf_counter()
            LAST_RUN.update(first=first_at - started, first_records=len(batch))
        records += len(batch)
        if deadline is not None and time.perf_counter() > deadline:
            break
    if first_at is not None:
        LAST_RUN.update(steady_seconds=time.perf_counter() - first_at,
                        steady_records=records - LAST_RUN["first_records"])
    return records


def _loader(dataset, workers: int) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=workers, collate_fn=keep_batch)


def streamds_run(path: Path, workers: int, cap: float | None = None) -> int:
    started = time.perf_counter()
    from streamds import StreamingJsonl

    return _count(_loader(StreamingJsonl(str(path)), workers), cap, started=started)


def streamds_batched_run(
    path: Path, workers: int, cap: float | None = None, prefetch: int | None = None,
    size: int | None = None, parse_in_workers: bool = False,
) -> int:
    """Whole batches out of the reader, the DataLoader's default conversion (a RecordBatch
    passes it untouched); `prefetch`: the DataLoader's prefetch_factor with workers; `size`:
    records per batch (default BATCH_SIZE); `parse_in_workers`: on_error='skip', which needs
    the records parsed in the workers (no line is malformed), for comparison."""
    started = time.perf_counter()
    from streamds import StreamingJsonl

    ahead = {"prefetch_factor": prefetch} if prefetch and workers else {}
    on_error = "skip" if parse_in_workers else "raise"
    loader = DataLoader(StreamingJsonl(str(path), on_error=on_error).batch(size or BATCH_SIZE),
                        batch_size=None, num_workers=workers, **ahead)
    return _count(loader, cap, started=started)


SIZED_BATCH_BYTES = 300_000  # the message size that measured best with 2 workers


def sized_batch(mean_line: float) -> int:
    """Records per batch for ~SIZED_BATCH_BYTES of JSON a batch: the nearest power of two."""
    sizes = [1 << i for i in range(16)]
    return min(sizes, key=lambda n: abs(math.log(n * mean_line / SIZED_BATCH_BYTES)))


def hf_run(path: Path, workers: int, cap: float | None = None) -> int:
    started = time.perf_counter()
    import datasets

    datasets.logging.set_verbosity_error()  # "too many workers for 1 shard", every run
    dataset = datasets.load_dataset("json", data_files=str(path), streaming=True, split="train")
    return _count(_loader(dataset, workers), cap, started=started)


def wds_run(tars: Sequence[Path], workers: int, cap: float | None = None) -> int:
    started = time.perf_counter()
    import webdataset as wds

    urls = [str(tar) for tar in tars]
    dataset = wds.WebDataset(urls, shardshuffle=False).map(parse_json_member)
    return _count(_loader(dataset, workers), cap, started=started)


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


def replay_pool(plain: Path) -> list:
    """The parsed records in the first REPLAY_POOL_BYTES of the plain .jsonl `plain`."""
    import orjson

    with open(plain, "rb") as f:
        lines = f.read(REPLAY_POOL_BYTES).split(b"\n")[:-1]
    return [orjson.loads(line) for line in lines]


def replay_run(pool: list, total: int, workers: int, cap: float | None = None) -> int:
    started = time.perf_counter()
    return _count(_loader(ReplayRecords(pool, total), workers), cap, started=started)


class ReplayBatches(ReplayRecords):
    """The replayed records in whole batches of BATCH_SIZE, as lists or as `as_batch`."""

    def __init__(self, pool: list, total: int, as_batch: Callable[[list], object]) -> None:
        super().__init__(pool, total)
        self.as_batch = as_batch

    def __iter__(self) -> Iterator[object]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        pool, size, as_batch = self.pool, len(self.pool), self.as_batch
        for first in range(worker * BATCH_SIZE, self.total, workers * BATCH_SIZE):
            start = first % size
            batch = pool[start : start + BATCH_SIZE]
            if len(batch) < BATCH_SIZE:
                batch += pool[: BATCH_SIZE - len(batch)]
            yield as_batch(batch[: self.total - first])


def replay_batches_run(pool: list, total: int, workers: int, as_record_batch: bool) -> int:
    from streamds import RecordBatch

    started = time.perf_counter()
    dataset = ReplayBatches(pool, total, RecordBatch if as_record_batch else list)
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=keep_batch)
    return _count(loader, started=started)


def crossing_costs(pool: list, rounds: int = 200) -> dict[str, float]:
    """Microseconds per batch of BATCH_SIZE records to write and read back, as a pickled list,
    as JSON and marshalled (what `.batch()` sends from a worker when the worker needs the
    values; plain records cross as JSON lines, parsed in the main process)."""
    import marshal

    import orjson

    batch = pool[:BATCH_SIZE]
    costs = {}
    for name, dump, load in (("pickle", pickle.dumps, pickle.loads),
                             ("json", orjson.dumps, orjson.loads),
                             ("marshal", marshal.dumps, marshal.loads)):
        blob = dump(batch)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(rounds):
                load(dump(batch))
            times.append((time.perf_counter() - start) / rounds)
        costs[name] = min(times) * 1e6
        costs[f"{name} bytes"] = len(blob)
    return costs


# -- peak memory of a process tree -------------------------------------------------------------


def _tree_rss() -> int:
    import psutil

    me = psutil.Process()
    total = 0
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a worker that exited in between
            total += process.memory_info().rss
    return total


def peak_rss_of(function: str, *args: object) -> float:
    """MB: the peak RSS of a fresh process (and its workers) running `function(*args)`."""
    call = json.dumps([function, *[str(a) if isinstance(a, Path) else a for a in args]])
    out = subprocess.run([sys.executable, __file__, "--batch-size", str(BATCH_SIZE),
                          "--probe-rss", call], check=True, capture_output=True,
                         text=True).stdout
    return float(out.strip().splitlines()[-1]) / MB


def _probe_rss(call: str) -> None:
    """Run one call in this process while a thread samples the tree's RSS; print the peak."""
    function, *args = json.loads(call)
    peak = [_tree_rss()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], _tree_rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    globals()[function](*[Path(a) if isinstance(a, str) else a for a in args])
    done.set()
    sampler.join()
    print(max(peak[0], _tree_rss()))


# -- one timed run -----------------------------------------------------------------------------

# what a run's function reads with, imported before the timing as a training script has it
# at its top; the other functions use streamds
READERS = {"hf_run": ("datasets", "load_dataset"), "wds_run": ("webdataset", "WebDataset")}


@dataclass
class Outcome:
    """One timed run: records, wall seconds and CPU seconds (the process and its reaped
    workers); a DataLoader run also has its first batch and the steady part after it."""

    records: int
    seconds: float
    cpu: float
    first: float | None = None  # seconds from building the dataset to the first batch
    steady_records: int = 0  # records after the first batch ...
    steady_seconds: float = 0.0  # ... and the seconds they took

    @property
    def rate(self) -> float:
        """records/s after the first batch where there is a steady part, else of the run."""
        if self.steady_records and self.steady_seconds > 0:
            return self.steady_records / self.steady_seconds
        return self.records / self.seconds


def in_process(loop: Callable[[], int]) -> Callable[[], Outcome]:
    """A plain loop (the limit rows), timed in this process."""

    def run() -> Outcome:
        own, start = own_cpu(), time.perf_counter()
        records = loop()
        return Outcome(records, time.perf_counter() - start, own_cpu() - own)

    return run


def in_child(function: str, *args: object) -> Callable[[], Outcome]:
    """A DataLoader run, `function(*args)`, each time in a fresh process (see _run_once)."""
    call = [function, *[str(a) if isinstance(a, Path) else a for a in args]]
    command = [str(Path(__file__).resolve()), "--batch-size", str(BATCH_SIZE), "--run-once"]

    def run() -> Outcome:
        return Outcome(**child_result(command, call, what=f"{function}{tuple(call[1:])}"))

    return run


def _run_once(call: list) -> None:
    """Time one call in this fresh process and print its Outcome as JSON. Its reader's module
    is imported and, for the replay rows, the pool of records built first; then `gc.freeze()`
    (as the docs recommend after a training script's imports), so that every run starts
    from the same small heap: a long process that has run other rows does not (see the docs)."""
    function, *args = call
    module, name = READERS.get(function, ("streamds", "StreamingJsonl"))
    getattr(importlib.import_module(module), name)  # streamds imports its parts on first use
    if function.startswith("replay"):
        args[0] = replay_pool(Path(args[0]))
    args = [Path(a) if isinstance(a, str) else a for a in args]
    gc.collect()
    gc.freeze()
    own, start = own_cpu(), time.perf_counter()
    records = globals()[function](*args)
    seconds = time.perf_counter() - start
    print(json.dumps({"records": records, "seconds": seconds, "cpu": own_cpu() - own,
                      **{key: LAST_RUN[key] for key in ("first", "steady_records",
                                                        "steady_seconds") if key in LAST_RUN}}))


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
    copies: int = 1  # how many times a run reads the corpus (the 2-core limit: twice at once)
    rates: list[float] = field(default_factory=list)  # records/s per timed run (steady part)
    whole: list[float] = field(default_factory=list)  # records/s of the whole run, start-up in
    read: list[int] = field(default_factory=list)  # records per timed run
    cores: list[float] = field(default_factory=list)  # our CPU seconds / wall, per run
    others: list[float] = field(default_factory=list)  # cores others used, per run
    run: Callable[[], Outcome] | None = field(default=None, repr=False)  # limit rows: the loop
    first: list[float] = field(default_factory=list)  # seconds to the first batch, per run
    peak_mb: float | None = None  # peak RSS of the process tree, in a run of its own

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
    run: Callable[[], Outcome],
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
        outcome = run()
        span = time.perf_counter() - start  # a child's start-up and imports included
        records = outcome.records
        if records != expected * result.copies and not (capped and 0 < records < expected):
            raise RuntimeError(
                f"{result.reader} ({result.source}, workers={result.workers}) yielded "
                f"{records} records; the corpus has {expected}"
            )
        if attempt:
            result.rates.append(outcome.rate)
            result.whole.append(records / outcome.seconds)
            result.read.append(records // result.copies)
            result.cores.append(outcome.cpu / outcome.seconds)
            result.others.append(max(0.0, (machine_busy() - busy - (own_cpu() - own)) / span))
            if outcome.first is not None:
                result.first.append(outcome.first)
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
    result.run = in_process(lambda: loop(path, size))
    return measure(result, result.run, repeats=repeats, wait=wait, log=log)


def measure_limit_batches(
    corpus: Corpus, limit: Result, *, repeats: int, wait: QuietWaiter,
    log: Callable[[str], None],
) -> Result:
    """The zstd limit loop in held batches of BATCH_SIZE, at the read size `limit` chose."""
    result = Result(corpus, f"limit in batches of {BATCH_SIZE}", _source_name(corpus.zst),
                    None, "zst", note="the last batch kept while the next fills",
                    read_size=limit.read_size)
    result.run = in_process(lambda: limit_zst_batches(corpus.zst, result.read_size))
    return measure(result, result.run, repeats=repeats, wait=wait, log=log)


def measure_limit_pair(
    corpus: Corpus, limit: Result, *, repeats: int, wait: QuietWaiter,
    log: Callable[[str], None],
) -> Result:
    """The zstd limit loop in two processes at once, at the read size `limit` chose."""
    result = Result(corpus, "limit, 2 cores", _source_name(corpus.zst), None, "zst",
                    note="two of those loops at once, one process each", copies=2,
                    read_size=limit.read_size)
    with multiprocessing.get_context("fork").Pool(2) as pool:  # started before the timing
        result.run = in_process(lambda: limit_zst_pair(pool, corpus.zst, result.read_size))
        measure(result, result.run, repeats=repeats, wait=wait, log=log)
    result.run = None  # the pool is gone; `again` is for the 1-core limits
    return result


def again(result: Result, *, repeats: int, wait: QuietWaiter, log: Callable[[str], None]) -> None:
    """More timed runs of a limit row (see measure_limit)."""
    measure(result, result.run, repeats=repeats, wait=wait, log=log)


def _source_name(path: Path) -> str:
    return "seekable .jsonl.zst" if path.name.endswith(".jsonl.zst") else ".jsonl"


# -- the report ------------------------------------------------------------------------------


def table(results: Sequence[Result]) -> str:
    limits = {(r.corpus.name, r.limit_key): r for r in results if r.is_limit}
    lines = [
        "| corpus | reader | input | workers | records/s | MB/s | x limit | x limit, whole run "
        "| cores used | first batch | peak RSS |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
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
        # the 2-core limit's loops run in a pool: their CPU is not this process tree's
        pooled = r.copies > 1
        busy = " †" if statistics.median(r.others) > BUSY and not pooled else ""
        cores = "2 processes" if pooled else f"{statistics.median(r.cores):.1f}"
        whole = (f"{statistics.median(r.whole) / limit.records_per_s:.2f}" if r.first
                 else "-")  # with a start-up of its own (a DataLoader row)
        lines.append(
            f"| {corpus} | {r.reader} | {source} | {workers} | {r.records_per_s:,.0f} | "
            f"{r.mb_per_s:,.0f}{busy} | {r.mb_per_s / limit.mb_per_s:.2f} | {whole} | {cores} | "
            f"{f'{statistics.median(r.first) * 1e3:,.0f} ms' if r.first else '-'} | "
            f"{'-' if r.peak_mb is None else f'{r.peak_mb:,.0f} MB'} |"
        )
    return "\n".join(lines)


PEERS = (  # (reader, input) of the headline rows, with the label they get there
    ("StreamingJsonl .batch(64)", "seekable .jsonl.zst",
     "streamds, `ds.batch(64)`, `DataLoader(batch_size=None)`"),
    ("StreamingJsonl", "seekable .jsonl.zst", "streamds, `DataLoader(ds, batch_size=64)`"),
    ("HF datasets", "seekable .jsonl.zst", "Hugging Face `datasets` (streaming)"),
    ("webdataset", None, "webdataset (tar shards)"),
)


def peers_table(results: Sequence[Result]) -> str:
    """The headline: records/s of streamds and its peers on the first corpus, per workers."""
    corpus = results[0].corpus
    rows = [r for r in results if r.corpus.name == corpus.name and r.workers is not None]
    workers = sorted({r.workers for r in rows})
    lines = [f"Records a second over {_corpus_label(corpus)} (one seekable `.jsonl.zst`; "
             "webdataset: tar shards of the same records), batches of 64:", "",
             "| reader | " + " | ".join(f"{w} worker{'' if w == 1 else 's'}" for w in workers)
             + " |", "|---|" + "---:|" * len(workers)]
    for reader, source, label in PEERS:
        rates = {r.workers: r.records_per_s for r in rows
                 if r.reader == reader and (source is None or r.source == source)}
        lines.append(f"| {label} | "
                     + " | ".join(f"{rates[w]:,.0f}" if w in rates else "-" for w in workers)
                     + " |")
    return "\n".join(lines)


def _corpus_label(corpus: Corpus) -> str:
    line = corpus.decoded_bytes / corpus.records
    size = f"{line / 1000:.0f} KB" if line >= 1000 else f"{line:.0f} B"
    kind = "PubMed" if corpus.name.startswith("pubmed") else "small lines"
    return f"{kind}: {corpus.records:,} records, {corpus.decoded_bytes / MB:,.0f} MB, {size}/line"


def crossing_table(crossing: Sequence[tuple[Corpus, dict[str, float]]]) -> str:
    """Per-batch cost of crossing from a worker: pickle, JSON and marshal."""
    lines = [f"| corpus | one batch of {BATCH_SIZE} records | pickle (dumps + loads) | "
             "JSON (orjson dumps + loads) | marshal (dumps + loads) | marshal / pickle |",
             "|---|---:|---:|---:|---:|---:|"]
    for corpus, costs in crossing:
        lines.append(
            f"| {_corpus_label(corpus).split(':')[0]} | {costs['pickle bytes'] / 1e3:,.0f} KB "
            f"pickled, {costs['marshal bytes'] / 1e3:,.0f} KB marshalled | "
            f"{costs['pickle']:,.0f} us | {costs['json']:,.0f} us | {costs['marshal']:,.0f} us "
            f"| {costs['marshal'] / costs['pickle']:.2f} |"
        )
    return "\n".join(lines)


def contention(results: Sequence[Result]) -> str:
    measured = [r for r in results if r.copies == 1]  # a pool's loops count as others
    others = [o for r in measured for o in r.others]
    flagged = sum(statistics.median(r.others) > BUSY for r in measured)
    note = (
        f"Other processes used {statistics.fmean(others):.2f} cores on average during the "
        f"timed runs (worst run: {max(others):.2f})."
    )
    if flagged:
        note += f" † marks the {flagged} row(s) where they used more than {BUSY} cores."
    return note


def docs_body(
    report: str, notes: str, *, host: str, repeats: int, peer_cap: float, command: str
) -> str:
    """The throughput section of docs/performance.md: the tables, what the columns mean, the
    command."""
    return (
        f"{report}\n\n"
        f"Machine: {host}. Medians of {repeats} runs after one untimed run; every "
        "DataLoader run in a fresh process (its reader imported, then `gc.freeze()`), its "
        "records/s counted from the first batch to the last (the start-up is the \"first "
        "batch\" column; \"x limit, whole run\" counts it in); MB/s "
        "counts decoded JSONL bytes. \"x limit\" divides by one core running a plain "
        "loop over the same input (zstd decompression + `bytes.split` + `orjson.loads`; "
        "no decompression for `.jsonl` and tar), the fastest of its runs before and after "
        f"the other rows; \"limit in batches of {BATCH_SIZE}\" is that loop handing out "
        f"lists of {BATCH_SIZE} records and keeping the last one while the next fills, as a "
        "training loop does (the fairer ceiling for the batched rows); \"limit, 2 cores\" "
        "runs two of the 1-core loops at once in two processes (what the machine's two cores "
        "deliver together, the ceiling for rows with workers). \"cores used\" is the "
        "loader's CPU time over wall time. Every reader goes through "
        f"DataLoader(batch_size={BATCH_SIZE}, collate_fn returning the list), except "
        f"\".batch({BATCH_SIZE})\" rows: DataLoader(ds.batch({BATCH_SIZE}), batch_size=None), "
        "no collate_fn. \"DataLoader only\" replays parsed records from memory, the ceiling "
        "for any reader with that many workers; its \"batches\" rows have the dataset yield "
        "whole batches, as pickled lists or as RecordBatch (marshalled into shared memory, a "
        "descriptor through the pipe: what `.batch()` sends when the worker needs the values; "
        "plain records cross as their JSON lines, parsed in the main process). \"first "
        "batch\" is the time from building the dataset to holding the first batch; \"peak "
        "RSS\" is the whole process tree's (main process and workers, sum of RSS sampled "
        "every 10 ms; pages shared after the fork count once per process) in a run of its "
        "own in a fresh process. HF datasets splits work by file, so with one file only one "
        f"worker reads; peers' runs stop after {peer_cap:g} s. {notes} Compare rows within "
        "one table: between separate runs of the script on this shared VM, single rows "
        "moved by up to a third.\n\n"
        f"```bash\n{command}\n```"
    )


# -- main ------------------------------------------------------------------------------------


def _set_batch_size(size: int) -> None:
    global BATCH_SIZE
    BATCH_SIZE = size


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
    add_write_docs(parser, "throughput")
    parser.add_argument("--no-rss", action="store_true",
                        help="skip the peak-memory runs (one fresh process per row)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                        help="records per batch for every DataLoader row and the held-batches "
                        "limit")
    parser.add_argument("--probe-rss", metavar="CALL", help=argparse.SUPPRESS)
    parser.add_argument("--run-once", metavar="CALL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _set_batch_size(args.batch_size)
    if args.probe_rss:  # internal: one run in a fresh process, for its peak memory
        _probe_rss(args.probe_rss)
        return 0
    if args.run_once:  # internal: one timed run in a fresh process
        _run_once(json.loads(args.run_once))
        return 0
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
    crossing: list[tuple[Corpus, dict[str, float]]] = []

    def peak(function: str, *call: object) -> float | None:
        return None if args.no_rss else peak_rss_of(function, *call)

    for corpus in corpora:
        log(f"{corpus.name}: {corpus.records} records, {corpus.decoded_bytes / MB:.0f} MB")
        limits = [measure_limit(corpus, key, **options) for key in ("zst", "plain")]
        limits.append(measure_limit_batches(corpus, limits[0], **options))
        pair = measure_limit_pair(corpus, limits[0], **options)
        for limit in limits:
            loop = {"zst": "limit_zst", "plain": "limit_plain"}[limit.limit_key]
            if not limit.is_limit:
                loop = "limit_zst_batches"
            path = corpus.plain if limit.source == ".jsonl" else corpus.zst
            limit.peak_mb = peak(loop, path, limit.read_size)
        results.extend([*limits, pair])
        if "replay" in args.readers:
            crossing.append((corpus, crossing_costs(replay_pool(corpus.plain))))
            gc.collect()
            for workers in args.workers:
                result = Result(corpus, "DataLoader only", "records from memory", workers, "zst")
                run = in_child("replay_run", corpus.plain, corpus.records, workers)
                results.append(measure(result, run, **options))
            for as_batch, how in ((False, "pickled lists"), (True, "RecordBatch")):
                for workers in args.workers:
                    result = Result(corpus, f"DataLoader only, batches of {BATCH_SIZE}",
                                    f"records from memory, {how}", workers, "zst")
                    run = in_child("replay_batches_run", corpus.plain, corpus.records, workers,
                                   as_batch)
                    results.append(measure(result, run, **options))
        # (reader, limit key, input, function(path, workers, cap, *more), its path, capped,
        #  more: the function's further arguments)
        rows: list[tuple[str, str, str, str, object, bool, tuple]] = []
        if "streamds" in args.readers:
            zst = _source_name(corpus.zst)
            rows.append(("StreamingJsonl", "zst", zst, "streamds_run", corpus.zst, False, ()))
            rows.append((f"StreamingJsonl .batch({BATCH_SIZE})", "zst", zst,
                         "streamds_batched_run", corpus.zst, False, ()))
            rows.append((f"StreamingJsonl .batch({BATCH_SIZE}), prefetch_factor=8", "zst", zst,
                         "streamds_batched_run", corpus.zst, False, (8,)))
            sized = sized_batch(corpus.decoded_bytes / corpus.records)
            if sized != BATCH_SIZE:
                rows.append((f"StreamingJsonl .batch({sized}), ~{SIZED_BATCH_BYTES // 1000} KB "
                             "a batch", "zst", zst, "streamds_batched_run", corpus.zst, False,
                             (None, sized)))
                rows.append((f"StreamingJsonl .batch({sized}), parsed in the workers "
                             "(on_error='skip')", "zst", zst, "streamds_batched_run", corpus.zst,
                             False, (None, sized, True)))
            rows.append(("StreamingJsonl", "plain", ".jsonl", "streamds_run", corpus.plain,
                         False, ()))
            rows.append((f"StreamingJsonl .batch({BATCH_SIZE})", "plain", ".jsonl",
                         "streamds_batched_run", corpus.plain, False, ()))
        if "hf" in args.readers:
            rows.append(("HF datasets", "zst", _source_name(corpus.zst), "hf_run", corpus.zst,
                         cap is not None, ()))
        if "wds" in args.readers:
            rows.append(("webdataset", "plain", f"{len(corpus.tars)} tar shards", "wds_run",
                         [str(tar) for tar in corpus.tars], cap is not None, ()))
        for reader, key, source, function, path, capped, more in rows:
            for workers in args.workers:
                call = (path, workers, cap if capped else None, *more)
                result = Result(corpus, reader, source, workers, key)
                results.append(measure(result, in_child(function, *call), capped=capped,
                                       **options))
                result.peak_mb = peak(function, *call)
        for limit in limits:
            again(limit, **options)

    report = table(results)
    if crossing:
        report += "\n\n" + crossing_table(crossing)
    notes = contention(results)
    print(f"\n{report}\n\n{notes}\nmeasured in {time.perf_counter() - started:.0f}s", flush=True)
    if args.write_docs:
        body = docs_body(report, notes, host=host, repeats=args.repeats,
                           peer_cap=args.peer_cap, command=command)
        replace_section(PERFORMANCE, "throughput", body)
        replace_section(PERFORMANCE, "peers", peers_table(results))
        log(f"wrote the table into {PERFORMANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
