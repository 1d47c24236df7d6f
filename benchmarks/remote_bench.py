"""Reading through a slow mount and over HTTP (issue 10, item 7): the seed's drive-mount
experiment (docs in /work/shared/notes/drive-mount.md) reproduced on a real FUSE mount and on a
loopback HTTP server, at 20 ms and 100 ms per request, against local disk, in one run.

    python benchmarks/remote_bench.py --quick          # 2,000 records, 1 repeat: ~3 min
    python benchmarks/remote_bench.py                  # 20,000 records, 3 repeats: ~40 min
    python benchmarks/remote_bench.py --write-docs     # also fill docs/performance.md

The corpus: PubMed-layout records of 10-20 KB (`streamds.tools.synthetic.write_small_files`,
record_chars=7000), one `.json` file per record in folders of 3,000 as users keep them, and the
same records converted with `python -m preprocess` into 5 seekable `.jsonl.zst` shards. Both live
under bench-data/ (git-ignored) and are reused while their name (records, seed) matches.

Sites, each read by every row:
- local: the corpus folder itself, the reference every ratio divides by;
- fuse: `testbed.slowfs.mount` of the corpus folder, `latency` added to every metadata and read
  request. Every timed run gets a fresh mount, so no kernel cache (pages, names, attributes)
  survives from an earlier run; within a run the kernel caches as it always does (no
  `kernel_cache`, so every open drops the file's pages; no `direct_io`, so requests are at most
  128 KiB and the kernel reads ahead);
- http: `testbed.http.serve` of the corpus folder in its own process (so it does not share
  the GIL with the loader), `Faults(latency=...)` on every request; a fresh server per run.

Rows, each through `DataLoader(batch_size=16, collate_fn=keep_batch)` at 0 and 2 workers
unless they say otherwise:
- one `.json` file per record, a map-style Dataset (list the folders, then open, read and
  `orjson.loads` each file; over HTTP one GET per file, URLs known in advance); these runs
  stop after `--cap` seconds and report records/s over what they read;
- `StreamingJsonl(shards)` with `readahead=0` and with the default (read-ahead on), a whole
  epoch, checked to yield every record exactly once (in corpus order at 0 workers);
- `StreamingJsonl(shards).batch(16)` through `DataLoader(batch_size=None)`: batches made in
  the workers, as the docs' ten-line example does, with the default `ahead="auto"` (on 2 CPUs and
  2 workers a thread makes up to 4 batches ahead) and with `ahead=0`, divided by the same
  batches read from local disk;
- `StreamingJsonl(shards, cache_dir=LOCAL)`: epoch 1 fills the cache, then epochs 2 (0 and 2
  workers) read it, each on a fresh mount or server with the cache kept;
- faults: EIO on every 50th read request of the mount, and `Faults(fail_every=20)` (every 20th
  ranged GET answers 503) over HTTP, both at 20 ms (--quick: every 10th and 5th, as its small
  corpus takes few requests): the epoch must equal the clean one.
Arguments this version of StreamingJsonl lacks (`readahead=`, `cache_dir=`, `.batch(ahead=)`,
found with `inspect.signature`) make their rows "n/a (not in this version)".

Each row is the median of `--repeats` rounds; a round runs every row once, the rows' order
rotating from round to round (cache rows stay together, fill first). Records/s and the first
batch time are measured from the moment the reader starts (listing included) to the last or
first batch. Before each run the script waits (within --quiet-wait) for other processes to
leave the CPUs nearly idle; values whose runs had them use more than a quarter of a core are
marked †. Writes benchmarks/results/remote_bench.json (every run) and .md (the tables), and
docs/img/remote_bench.png (ratio to local disk per row).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from common import (
    DATA_DIR,
    PERFORMANCE,
    ROOT,
    add_write_docs,
    command_line,
    machine,
    machine_busy,
    own_cpu,
    replace_section,
)
from torch.utils.data import DataLoader, Dataset

import streamds
from streamds import StreamingJsonl
from testbed.slowfs import fuse_available, mount

RESULTS = ROOT / "benchmarks" / "results"
PLOT = ROOT / "docs" / "img" / "remote_bench.png"
BATCH = 16
RECORD_CHARS = 7000  # ~15 KB of JSON a record
PER_FOLDER = 3000
SHARDS = 5
FAULT_LATENCY = 0.02
BUSY = 0.25  # cores other processes used during a run that mark its value with †
NA = "n/a (not in this version)"
BATCHED_LABEL = f"`StreamingJsonl(shards/).batch({BATCH})`, `batch_size=None` (defaults)"
PARAMS = inspect.signature(StreamingJsonl).parameters
HAS = {"readahead": "readahead" in PARAMS, "cache_dir": "cache_dir" in PARAMS,
       "ahead": "ahead" in inspect.signature(getattr(StreamingJsonl, "batch", len)).parameters}


def keep_batch(batch: list[dict]) -> list[dict]:
    """collate_fn: the batch as the list of records it is (PubMed's null labels do not
    collate)."""
    return batch


# -- the corpus ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    root: Path  # holds files/ and shards/
    records: int
    decoded_bytes: int
    shard_bytes: int

    @property
    def shard_names(self) -> list[str]:
        return sorted(p.name for p in (self.root / "shards").glob("*.jsonl.zst"))


def make_corpus(records: int, seed: int = 0) -> Corpus:
    """files/part_NNN/NNNNNNNN.json (one record each) and shards/ converted from them."""
    from streamds.tools.synthetic import write_small_files

    root = DATA_DIR / f"remote-pubmed-r{records}-c{RECORD_CHARS}-s{seed}"
    if not root.exists():
        tmp = root.with_name(root.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        start = time.perf_counter()
        print(f"generating {root.name}: {records:,} .json files", file=sys.stderr, flush=True)
        write_small_files(tmp / "files", records=records, per_folder=PER_FOLDER, seed=seed,
                          record_chars=RECORD_CHARS)
        total = sum(p.stat().st_size for p in (tmp / "files").rglob("*.json"))
        subprocess.run([sys.executable, "-m", "preprocess", str(tmp / "files"), "--output",
                        str(tmp / "shards"), "--shard-size", str(total // SHARDS + 64_000),
                        "--quiet"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        tmp.rename(root)
        print(f"  done in {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    manifest = json.loads((root / "shards" / "manifest.json").read_text())
    shards = manifest["shards"]
    return Corpus(root, sum(s["records"] for s in shards),
                  sum(s["decoded_bytes"] for s in shards), sum(s["bytes"] for s in shards))


def list_files(files: Path) -> list[str]:
    """The per-record files in corpus order, found as a user would: list each folder."""
    folders = sorted(os.listdir(files))
    return [os.path.join(files, d, name) for d in folders
            for name in sorted(os.listdir(os.path.join(files, d)))]


# -- the map-style readers -------------------------------------------------------------------


class JsonFiles(Dataset):
    """One record per file: open, read, orjson.loads (the parser streamds uses, so rows differ
    by reading only)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict:
        with open(self.paths[index], "rb") as f:
            return orjson.loads(f.read())


class JsonUrls(JsonFiles):
    """One record per URL: one GET each."""

    def __getitem__(self, index: int) -> dict:
        with urllib.request.urlopen(self.paths[index], timeout=120) as response:
            return orjson.loads(response.read())


# -- sites: where the corpus is read from ----------------------------------------------------


@dataclass
class Site:
    """The corpus seen from one place: how to list the files, and the shards source."""

    list_files: Callable[[], list[str]]
    shards: str | list[str]
    http: bool = False
    requests: dict[str, Any] = field(default_factory=dict)  # filled after the site closes


_SERVER = """
import json, sys
from pathlib import Path
from testbed.http import Faults, serve
with serve(Path(sys.argv[1]), Faults(**json.loads(sys.argv[2]))) as server:
    print(server.url, flush=True)
    sys.stdin.readline()
    log = server.log
print(json.dumps([[r.method, r.path, r.range, r.status] for r in log]), flush=True)
"""


@contextmanager
def open_site(corpus: Corpus, backend: str, latency: float, *, eio_every: int = 0,
              fail_every: int = 0) -> Iterator[Site]:
    if backend == "local":
        yield Site(lambda: list_files(corpus.root / "files"), str(corpus.root / "shards"))
    elif backend == "fuse":
        with tempfile.TemporaryDirectory(prefix="remote-bench-mnt-") as tmp:
            stats = Path(tmp) / "stats.json"
            site = Site(lambda: [], "")
            with mount(corpus.root, Path(tmp) / "mnt", latency=latency, eio_every=eio_every,
                       stats=stats) as mp:
                site.list_files = lambda: list_files(mp / "files")
                site.shards = str(mp / "shards")
                yield site
            if stats.exists():  # written when the filesystem unmounts cleanly
                site.requests = fuse_requests(json.loads(stats.read_text()))
    elif backend == "http":
        faults = {"latency": latency, "fail_every": fail_every}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        server = subprocess.Popen([sys.executable, "-c", _SERVER, str(corpus.root),
                                   json.dumps(faults)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        try:
            url = server.stdout.readline().strip()
            if not url.startswith("http://"):
                raise RuntimeError(f"the HTTP server did not start (said {url!r})")
            files = [f"{url}/files/{os.path.relpath(p, corpus.root / 'files')}"
                     for p in list_files(corpus.root / "files")]
            site = Site(lambda: files, [f"{url}/shards/{n}" for n in corpus.shard_names],
                        http=True)
            yield site
            server.stdin.write("stop\n")
            server.stdin.flush()
            site.requests = http_requests(json.loads(server.stdout.readline()))
            server.wait(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    else:
        raise ValueError(f"backend must be local, fuse or http, got {backend!r}")


def fuse_requests(stats: dict[str, Any]) -> dict[str, Any]:
    calls = stats["calls"]
    sizes = Counter({int(k): v for k, v in stats["read_sizes"].items()})
    return {
        "opens": calls.get("open", 0),
        "metadata": sum(calls.get(op, 0) for op in ("getattr", "readdir", "open", "readlink",
                                                      "statfs")),
        "reads": calls.get("read", 0),
        "read_kib": _median_of_counts(sizes) / 1024 if sizes else 0.0,
        "in_flight": stats["max_reads_in_flight"],
        "mb": stats["bytes_read"] / 1e6,
        "failed": stats["eio_injected"],
    }


def http_requests(log: list[list]) -> dict[str, Any]:
    sizes: Counter[int] = Counter()
    for method, _path, header, _status in log:
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", header or "")
        if method == "GET" and match:
            sizes[int(match[2]) - int(match[1]) + 1] += 1
    gets = sum(1 for method, *_ in log if method == "GET")
    return {
        "opens": None,
        "metadata": sum(1 for method, *_ in log if method == "HEAD"),
        "reads": gets,
        "read_kib": _median_of_counts(sizes) / 1024 if sizes else None,  # ranged GETs only
        "in_flight": None,
        "mb": sum(size * n for size, n in sizes.items()) / 1e6 if sizes else None,
        "failed": sum(1 for *_, status in log if status >= 500),
    }


def _median_of_counts(counts: Counter[int]) -> float:
    return statistics.median(counts.elements())


# -- one timed run -------------------------------------------------------------------------


@dataclass
class Run:
    records: int
    seconds: float
    first: float | None  # seconds to the first batch
    complete: bool  # read to the end (not stopped by the cap or an error)
    check: str  # "ok", "-" (capped: not checked) or what differs from a clean epoch
    error: str | None = None
    requests: dict[str, Any] = field(default_factory=dict)
    others: float = 0.0  # cores other processes used during the run

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


def drain(loader: DataLoader, start: float, cap: float) -> tuple[list[str], float | None, bool,
                                                                  str | None]:
    """(ids read, first batch seconds, complete, error) from iterating `loader`."""
    ids: list[str] = []
    first = None
    iterator = iter(loader)
    try:
        for batch in iterator:
            if first is None:
                first = time.perf_counter() - start
            ids.extend(record["article_id"] for record in batch)
            if cap and time.perf_counter() - start > cap:
                return ids, first, False, None
    except Exception as err:  # a fault reached the reader: the row reports it
        return ids, first, False, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    finally:
        del iterator  # shuts the workers down before the mount goes
    return ids, first, True, None


def compare(ids: list[str], expected: list[str], ordered: bool) -> str:
    if (ids == expected) if ordered else (sorted(ids) == sorted(expected)):
        return "ok"
    seen = Counter(ids)
    missing = len(set(expected) - set(seen))
    repeated = sum(n - 1 for n in seen.values() if n > 1)
    order = " (out of order)" if not missing and not repeated else ""
    return f"{missing} missing, {repeated} repeated{order}"


@dataclass(frozen=True)
class Job:
    """One timed run: a reader at one site."""

    row: str  # the row key
    backend: str
    latency: float
    kind: str  # files | stream | cache
    workers: int
    options: tuple[tuple[str, Any], ...] = ()  # StreamingJsonl keywords
    eio_every: int = 0
    fail_every: int = 0
    ahead: int | str | None = None  # None: records; else `.batch(BATCH, ahead=...)` batches


def run_job(job: Job, corpus: Corpus, expected: list[str], cap: float,
            cache_dir: Path) -> Run:
    busy, own, wall = machine_busy(), own_cpu(), time.perf_counter()
    with open_site(corpus, job.backend, job.latency, eio_every=job.eio_every,
                   fail_every=job.fail_every) as site:
        start = time.perf_counter()
        if job.kind == "files":
            paths = site.list_files()
            dataset: Dataset = (JsonUrls if site.http else JsonFiles)(paths)
        else:
            options = dict(job.options)
            if job.kind == "cache":
                options["cache_dir"] = str(cache_dir)
            if "storage" in PARAMS:  # versions with streamds.Storage: the settings go there
                options = {"storage": streamds.Storage(**options)} if options else {}
            dataset = StreamingJsonl(site.shards, **options)
        if job.ahead is None:  # records out of the workers, batched in the main process
            loader = DataLoader(dataset, batch_size=BATCH, num_workers=job.workers,
                                collate_fn=keep_batch)
        else:  # batches made in the workers
            batched = dataset.batch(BATCH, ahead=job.ahead)  # type: ignore[union-attr]
            loader = DataLoader(batched, batch_size=None, num_workers=job.workers)
        ids, first, complete, error = drain(loader, start, cap if job.kind == "files" else 0)
        seconds = time.perf_counter() - start
    others = machine_busy() - busy - (own_cpu() - own)  # the mount and server are reaped now
    if complete:
        check = compare(ids, expected, ordered=job.workers == 0)
    else:
        check = "-" if error is None else f"failed after {len(ids)} records"
    return Run(len(ids), seconds, first, complete, check, error, site.requests,
               max(0.0, others / (time.perf_counter() - wall)))


# -- the plan --------------------------------------------------------------------------------


@dataclass
class Row:
    key: str
    backend: str
    latency: float
    label: str
    workers: int
    local: str | None  # the key of the local row this one is divided by
    na: str | None = None
    runs: list[Run] = field(default_factory=list)

    def median(self, value: Callable[[Run], float | None]) -> float | None:
        values = [v for v in map(value, self.runs) if v is not None]
        return statistics.median(values) if values else None


def plan(args: argparse.Namespace, fuse: bool) -> tuple[dict[str, Row], list[list[Job]]]:
    """The rows, and the jobs grouped into what must run together (cache fill, then reads)."""
    rows: dict[str, Row] = {}
    groups: list[list[Job]] = []

    def add(job: Job, label: str, local: str | None, na: str | None = None) -> None:
        rows[job.row] = Row(job.row, job.backend, job.latency, label, job.workers, local, na)
        if na is None:
            groups.append([job])

    readahead_off = (("readahead", 0),)
    for w in args.workers:
        add(Job(f"local files {w}", "local", 0.0, "files", w), "one `.json` file per record",
            None)
        add(Job(f"local stream {w}", "local", 0.0, "stream", w), "`StreamingJsonl(shards/)`",
            None)
        add(Job(f"local batched {w}", "local", 0.0, "stream", w, ahead="auto"),
            BATCHED_LABEL, None, None if HAS["ahead"] else NA)
    backends = [b for b in args.backends if b != "fuse" or fuse]
    for backend in backends:
        for latency in args.latencies:
            key = f"{backend} {latency:g}"
            for w in args.workers:
                add(Job(f"{key} files {w}", backend, latency, "files", w),
                    "one `.json` file per record (map-style)", f"local files {w}")
            for w in args.workers:
                add(Job(f"{key} noahead {w}", backend, latency, "stream", w, readahead_off),
                    "`StreamingJsonl(shards/, readahead=0)`", f"local stream {w}",
                    None if HAS["readahead"] else NA)
            for w in args.workers:
                add(Job(f"{key} stream {w}", backend, latency, "stream", w),
                    "`StreamingJsonl(shards/)` (defaults" + (", read-ahead on)" if HAS[
                        "readahead"] else "; this version has no read-ahead)"),
                    f"local stream {w}")
            for w in args.workers:
                add(Job(f"{key} batched {w}", backend, latency, "stream", w, ahead="auto"),
                    BATCHED_LABEL, f"local batched {w}", None if HAS["ahead"] else NA)
            for w in (w for w in args.workers if w):
                add(Job(f"{key} batched-noahead {w}", backend, latency, "stream", w, ahead=0),
                    f"`StreamingJsonl(shards/).batch({BATCH}, ahead=0)`", f"local batched {w}",
                    None if HAS["ahead"] else NA)
            cache = [Job(f"{key} cache-fill 0", backend, latency, "cache", 0)] + [
                Job(f"{key} cache {w}", backend, latency, "cache", w) for w in args.workers]
            na = None if HAS["cache_dir"] else NA
            rows[cache[0].row] = Row(cache[0].row, backend, latency,
                                     "`cache_dir=`: epoch 1 (fills the cache)", 0,
                                     "local stream 0", na)
            for job in cache[1:]:
                rows[job.row] = Row(job.row, backend, latency, "`cache_dir=`: epoch 2 (from "
                                    "the cache)", job.workers, f"local stream {job.workers}", na)
            if na is None:
                groups.append(cache)
    if "fuse" in backends:
        eio = args.eio_every
        add(Job("fuse eio stream 0", "fuse", FAULT_LATENCY, "stream", 0, eio_every=eio),
            f"`StreamingJsonl(shards/)`, EIO on every {eio}th read", "local stream 0")
        add(Job("fuse eio files 0", "fuse", FAULT_LATENCY, "files", 0, eio_every=eio),
            f"one `.json` file per record, EIO on every {eio}th read", "local files 0")
    if "http" in backends:
        add(Job("http fail stream 0", "http", FAULT_LATENCY, "stream", 0,
                fail_every=args.fail_every), f"`StreamingJsonl(shards/)`, 503 on every "
            f"{args.fail_every}th ranged GET", "local stream 0")
    return rows, groups


# -- the report ------------------------------------------------------------------------------


def _rate(row: Row) -> str:
    if row.na:
        return row.na
    rate = row.median(lambda r: r.rate)
    busy = " †" if (row.median(lambda r: r.others) or 0) > BUSY else ""
    capped = "" if all(r.complete for r in row.runs) else "*"
    return f"{rate:,.1f}{capped}{busy}" if rate < 100 else f"{rate:,.0f}{capped}{busy}"


def _first(row: Row) -> str:
    first = row.median(lambda r: r.first)
    return "-" if row.na or first is None else f"{first:.2f} s"


def _ratio(row: Row, rows: dict[str, Row]) -> str:
    if row.na or row.local is None:
        return "-"
    rate, local = row.median(lambda r: r.rate), rows[row.local].median(lambda r: r.rate)
    if not local:
        return "-"
    ratio = rate / local
    return f"{ratio:.3f}" if ratio >= 0.01 else f"{ratio:.4f}"


def _check(row: Row) -> str:
    if row.na:
        return "-"
    checks = sorted({r.check for r in row.runs})
    return "; ".join(checks)


def site_table(rows: dict[str, Row], backend: str, latencies: list[float]) -> str:
    per_latency = [f"{lat * 1000:g} ms: records/s (first batch) | / local" for lat in latencies]
    head = "| reader | workers | local records/s | " + " | ".join(per_latency) + " | output |"
    lines = [head, "|---|---:|---:|" + "---:|---:|" * len(latencies) + "---|"]
    mine = [r for r in rows.values() if r.backend == backend and r.latency in latencies
            and " eio " not in r.key and " fail " not in r.key]
    seen: list[tuple[str, int]] = []
    for row in mine:
        if (row.label, row.workers) not in seen:
            seen.append((row.label, row.workers))
    for label, workers in seen:
        same = {r.latency: r for r in mine if r.label == label and r.workers == workers}
        local = next(iter(same.values())).local
        cells = [label, str(workers), _rate(rows[local]) if local else "-"]
        checks = []
        for latency in latencies:
            row = same.get(latency)
            if row is None:
                cells += ["-", "-"]
                continue
            first = _first(row)
            cells += [_rate(row) + (f" ({first})" if first != "-" else ""), _ratio(row, rows)]
            checks.append(_check(row))
        cells.append("; ".join(sorted(set(checks) - {"-"})) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def faults_table(rows: dict[str, Row]) -> str:
    lines = ["| site | reader | workers | records/s | seconds | / clean | output |",
             "|---|---|---:|---:|---:|---:|---|"]
    for row in rows.values():
        if " eio " not in row.key and " fail " not in row.key:
            continue
        clean_key = f"{row.backend} {row.latency:g} {'files' if 'files' in row.key else 'stream'}"
        clean = rows.get(f"{clean_key} {row.workers}")
        seconds = row.median(lambda r: r.seconds)
        ratio = "-"
        if clean and clean.runs and all(r.complete for r in row.runs + clean.runs):
            ratio = f"{seconds / clean.median(lambda r: r.seconds):.2f}x time"
        errors = sorted({r.error for r in row.runs if r.error})
        output = _check(row) + (f" ({errors[0]})" if errors else "")
        injected = row.median(lambda r: r.requests.get("failed"))
        site = f"{row.backend} {row.latency * 1000:g} ms"
        lines.append(f"| {site} | {row.label} | {row.workers} | {_rate(row)} | {seconds:.1f} | "
                     f"{ratio} | {output}; {injected:.0f} failed requests |")
    return "\n".join(lines)


def requests_table(rows: dict[str, Row]) -> str:
    lines = ["| row | workers | metadata requests | opens | reads (GETs) | median read KiB "
             "| max reads in flight | MB read |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows.values():
        if row.na or row.backend == "local" or not row.runs:
            continue
        req = row.runs[len(row.runs) // 2].requests
        if not req:
            continue
        cells = [f"{row.backend} {row.latency * 1000:g} ms: {row.label}", str(row.workers),
                 f"{req['metadata']:,}", _maybe(req["opens"], ","), f"{req['reads']:,}",
                 _maybe(req["read_kib"], ".0f"), _maybe(req["in_flight"], "d"),
                 _maybe(req["mb"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _maybe(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def plot(rows: dict[str, Row], backends: list[str], latencies: list[float], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed in this environment: no {path.name}"
    fig, axes = plt.subplots(1, len(backends), figsize=(9 * len(backends), 4.8), sharey=True,
                             squeeze=False)
    for ax, backend in zip(axes[0], backends, strict=True):
        mine = [r for r in rows.values() if r.backend == backend and " eio " not in r.key
                and " fail " not in r.key and r.latency == latencies[0]]
        names = [f"{_short(r.label)}\n{r.workers}w" for r in mine]
        width = 0.8 / len(latencies)
        missing: list[float] = []  # x of bars without a value (n/a rows)
        for i, latency in enumerate(latencies):
            values = []
            for r in mine:
                row = rows.get(r.key.replace(f" {latencies[0]:g} ", f" {latency:g} ", 1))
                ratio = _ratio(row, rows) if row else "-"
                values.append(float(ratio) if ratio != "-" else 0.0)
            xs = [x + (i - (len(latencies) - 1) / 2) * width for x in range(len(mine))]
            bars = ax.bar(xs, values, width, label=f"{latency * 1000:g} ms")
            ax.bar_label(bars, labels=[f"{v:.3g}" if v else "" for v in values],
                         fontsize=6, padding=2)
            missing += [x for x, v in zip(xs, values, strict=True) if not v]
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        bottom = ax.get_ylim()[0]
        for x in missing:
            ax.text(x, bottom * 1.3, "n/a", ha="center", va="bottom", fontsize=7, rotation=90,
                    color="grey")
        ax.set_xticks(range(len(mine)), names, fontsize=7)
        ax.set_title({"fuse": "through a FUSE mount (testbed.slowfs)",
                      "http": "over HTTP (testbed.http)"}.get(backend, backend))
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(title="per request", fontsize=8)
    axes[0][0].set_ylabel("records/s / local disk records/s (log)")
    fig.suptitle("Reading 10-20 KB PubMed records from a slow source, relative to local disk "
                 "(1 = as fast)", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path.relative_to(ROOT)}"


def _short(label: str) -> str:
    for long, short in (("one `.json` file per record (map-style)", "per-file"),
                        ("`StreamingJsonl(shards/, readahead=0)`", "readahead\n=0"),
                        ("`cache_dir=`: epoch 1 (fills the cache)", "cache\nfill"),
                        ("`cache_dir=`: epoch 2 (from the cache)", "cache\nepoch 2"),
                        (BATCHED_LABEL, f".batch({BATCH})"),
                        (f"`StreamingJsonl(shards/).batch({BATCH}, ahead=0)`",
                         f".batch({BATCH})\nahead=0")):
        if label == long:
            return short
    return "default" if label.startswith("`StreamingJsonl(shards/)`") else label


def write_docs(body: str) -> str:
    """Replace the bench:remote section of docs/performance.md with the tables."""
    replace_section(PERFORMANCE, "remote", body)
    return f"wrote the tables into {PERFORMANCE.relative_to(ROOT)}"


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 records, 1 repeat, 6 s "
                        "per-file cap, faults every 10th read / 5th GET: a few minutes")
    parser.add_argument("--records", type=int, help="records in the corpus (20,000; quick 2,000)")
    parser.add_argument("--repeats", type=int, help="rounds; each row is their median (3; "
                        "quick 1)")
    parser.add_argument("--cap", type=float, help="seconds after which a per-file run stops "
                        "(20; quick 6)")
    parser.add_argument("--eio-every", type=int, help="the mount fails every Nth read request "
                        "in the fault rows (50; quick 10: the small corpus takes few reads)")
    parser.add_argument("--fail-every", type=int, help="the server answers 503 to every Nth "
                        "ranged GET in the fault rows (20; quick 5)")
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.02, 0.1],
                        help="seconds per request (default 0.02 0.1)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--backends", nargs="+", choices=("fuse", "http"),
                        default=["fuse", "http"])
    parser.add_argument("--quiet-wait", type=float, nargs=2, metavar=("PER_RUN", "TOTAL"),
                        help="max seconds to wait for an idle machine before each run, and in "
                        "all (5 300; quick 1 10)")
    add_write_docs(parser, "remote")
    args = parser.parse_args(argv)
    args.records = args.records or (2_000 if args.quick else 20_000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.cap = args.cap if args.cap is not None else (6.0 if args.quick else 20.0)
    args.eio_every = args.eio_every or (10 if args.quick else 50)
    args.fail_every = args.fail_every or (5 if args.quick else 20)
    args.quiet_wait = args.quiet_wait or ((1.0, 10.0) if args.quick else (5.0, 300.0))
    if 0 not in args.workers:
        parser.error("--workers must include 0 (the cache fill and the fault rows use it)")

    from throughput import QuietWaiter

    began = time.perf_counter()
    host = machine()
    command = command_line()
    print(f"machine: {host}\ncommand: {command}", flush=True)
    why_not = fuse_available()
    if why_not is not None and "fuse" in args.backends:
        print(f"FUSE IS NOT AVAILABLE on this machine ({why_not}): the mount rows are left "
              "out; running the HTTP rows only.", flush=True)
    missing = [name for name, present in HAS.items() if not present]
    if missing:
        print(f"this StreamingJsonl has no {', '.join(missing)} argument: those rows are "
              f"'{NA}'", flush=True)
    corpus = make_corpus(args.records)
    expected = [json.loads(Path(p).read_bytes())["article_id"]
                for p in list_files(corpus.root / "files")]
    rows, groups = plan(args, why_not is None)
    runs = sum(len(g) for g in groups)
    print(f"corpus: {corpus.records:,} records, {corpus.decoded_bytes / 1e6:.0f} MB as .json "
          f"files, {len(corpus.shard_names)} shards of {corpus.shard_bytes / 1e6:.1f} MB in all; "
          f"{runs} runs x {args.repeats} repeats\n", flush=True)

    wait = QuietWaiter(*args.quiet_wait)
    with tempfile.TemporaryDirectory(prefix="remote-bench-cache-") as tmp:
        for repeat in range(args.repeats):
            shift = repeat * len(groups) // max(args.repeats, 1)
            for group in groups[shift:] + groups[:shift]:
                cache_dir = Path(tmp) / f"cache-{repeat}-{group[0].row.replace(' ', '_')}"
                for job in group:
                    wait()
                    run = run_job(job, corpus, expected, args.cap, cache_dir)
                    rows[job.row].runs.append(run)
                    req = run.requests
                    said = (f"  requests: {req['reads']} reads, {req['metadata']} metadata, "
                            f"{_maybe(req['mb'], '.1f')} MB" if req else "")
                    print(f"  [{repeat + 1}/{args.repeats}] {job.row:<24} {run.rate:9.1f} "
                          f"records/s  {run.records:6d} in {run.seconds:6.1f}s  first "
                          f"{run.first or 0:5.2f}s  {run.check}{said}"
                          + (f"  {run.error}" if run.error else ""), flush=True)

    backends = [b for b in args.backends if b != "fuse" or why_not is None]
    sections = []
    for backend in backends:
        title = {"fuse": "Through a FUSE mount (`testbed.slowfs`, a fresh mount per run)",
                 "http": "Over HTTP (`testbed.http`, range GETs, a fresh server per run)"}[backend]
        sections.append(f"**{title}**\n\n{site_table(rows, backend, args.latencies)}")
    if why_not is not None and "fuse" in args.backends:
        sections.insert(0, f"FUSE is not available on this machine ({why_not}); HTTP rows only.")
    sections.append(f"**Faults, {FAULT_LATENCY * 1000:g} ms per request**\n\n"
                    f"{faults_table(rows)}")
    notes = (
        f"{corpus.records:,} PubMed-layout records of 10-20 KB ({corpus.decoded_bytes / 1e6:.0f}"
        f" MB; {len(corpus.shard_names)} seekable shards, {corpus.shard_bytes / 1e6:.1f} MB), "
        f"`DataLoader(batch_size={BATCH})` (the `.batch({BATCH})` rows: "
        f"`DataLoader(batch_size=None)`), medians of {args.repeats} interleaved round(s); "
        "records/s from the reader's start (listing included) to its last batch, first batch "
        "in brackets; / local divides by the same reader and workers on local disk (files in the "
        "page cache; the stream rows by `StreamingJsonl(shards/)` on local disk, the `.batch("
        f"{BATCH})` rows, `ahead=0` too, by `.batch({BATCH})` with its defaults there). "
        f"\\* per-file runs stop after {args.cap:g} s (records/s over what they read). "
        f"† other processes used more than {BUSY} cores. output: every record exactly once "
        "(in order at 0 workers) = ok. Machine: "
        f"{host}."
    )
    report = "\n\n".join(sections) + f"\n\n{notes}\n\n```bash\n{command}\n```"
    requests = requests_table(rows)
    print(f"\n{report}\n\nWhat the mount and the server saw (the median run of each row):\n\n"
          f"{requests}\n", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "remote_bench.md").write_text(f"{report}\n\n{requests}\n")
    raw = {"command": command, "machine": host, "features": HAS, "fuse": why_not or "available",
           "records": corpus.records, "args": {k: v for k, v in vars(args).items()},
           "rows": [{"key": r.key, "label": r.label, "backend": r.backend,
                     "latency": r.latency, "workers": r.workers, "local": r.local, "na": r.na,
                     "runs": [{**vars(run), "rate": run.rate} for run in r.runs]}
                    for r in rows.values()]}
    (RESULTS / "remote_bench.json").write_text(json.dumps(raw, indent=1))
    print(f"results: {(RESULTS / 'remote_bench.json').relative_to(ROOT)}, "
          f"{(RESULTS / 'remote_bench.md').relative_to(ROOT)}")
    if backends:
        print(plot(rows, backends, args.latencies, PLOT))
    if args.write_docs:
        print(write_docs(report))
    print(f"done in {time.perf_counter() - began:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
