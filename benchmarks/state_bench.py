"""What taking the reader state costs: state_dict() itself, and StatefulDataLoader's epoch.

torchdata's StatefulDataLoader has every worker call `dataset.state_dict()` after every batch,
so the state must be cheap to take. This script measures, through the public API only (so the
same script runs against any version of the library):

1. state_dict() on a dataset iterated directly (shuffle=True, buffer_size 1k, 10k, 100k), once
   the buffer is full: the median of many calls a batch (32 records) apart, the first call
   right after the buffer fills and one call mid-way through the epoch (so amortised costs
   show), and the pickled size of the state.
2. Epoch throughput on ~300,000 short records (shuffle=True, buffer_size=10_000,
   batch_size=32, a collate returning the ids), 0, 1 and 2 workers: plain DataLoader vs
   StatefulDataLoader (default snapshot_every_n_steps=1, and snapshot_every_n_steps=64),
   interleaved; and the same with `.map(fn)` at the most workers. Next to them, in a "floor"
   column, the same loaders over FloorLines, a trivial stateful IterableDataset (lines ->
   orjson.loads, state = {"n": lines seen}, lines split across workers by index): its
   StatefulDataLoader / DataLoader ratio is torchdata's own per-batch cost, the most any
   reader can keep. Slow runs stop after --cap seconds and count the records read by then
   (marked in the table).
3. 0-worker throughput through DataLoader(batch_size=64), shuffle=False and shuffle=True
   (buffer_size=10_000), on a PubMed-layout corpus (~15 KB records) and on small lines
   (~300 B), both from `common.py`'s corpus makers (cached under bench-data/).

Every measurement runs in a child process (this script with --child) whose PYTHONPATH is the
tree under test. With --ref GITREF the script checks that ref out once into a detached
worktree (/tmp/streamds-ref-<sha>) and runs every measurement against it ("old") and against
this checkout ("new"), alternating which goes first per repeat so machine noise hits both;
the floor rows do not depend on the library and run once per repeat.
Values are medians of --repeats child runs; compare columns of one table, not runs. Before
each child run the script waits (within --quiet-wait bounds) for other processes to leave the
CPUs nearly idle, and marks with † the values measured while they were not.

Writes benchmarks/results/: state_bench.md (the table and its notes), state_bench.json (every
child run), state_bench.png (state_dict() µs against buffer_size, log-log, per version) and
state_ratio.png (StatefulDataLoader / DataLoader per worker count: each version and the floor).

    .venv/bin/python benchmarks/state_bench.py --ref a42025e --quick   # smoke run, < 2 min
    .venv/bin/python benchmarks/state_bench.py --ref a42025e           # ~15-20 min on 2 cores
    .venv/bin/python benchmarks/state_bench.py --ref a42025e --new-ref 2c266ff  # two commits
    .venv/bin/python benchmarks/state_bench.py --write-docs            # docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from torch.utils.data import IterableDataset

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BUFFERS = (1_000, 10_000, 100_000)
FILL_EXTRA = 300  # records iterated past buffer_size before the state is taken
STEP = 32  # records between two timed state_dict() calls: one batch
EPOCH_BUFFER = 10_000
SNAPSHOTS = (1, 64)  # StatefulDataLoader's snapshot_every_n_steps in the epoch rows
FLOOR = "floor"  # the runs of FloorLines: one column, measured once per repeat
BUSY = 0.25  # cores other processes used during a run that mark its value with †


# -- what the children run (imports come from the tree on PYTHONPATH) ----------------------


def batch_ids(batch: list[dict]) -> list[int]:
    """collate_fn for the epoch rows: the ids of the batch."""
    return [record["id"] for record in batch]


def keep_batch(batch: list[dict]) -> list[dict]:
    """collate_fn for the corpus rows: the batch as the list of records it is."""
    return batch


def add_length(record: dict) -> dict:
    """The cheap transform of the `.map(fn)` rows."""
    record["chars"] = len(record["text"])
    return record


class FloorLines(IterableDataset):
    """The floor: the least a stateful reader can do. Reads the lines, orjson.loads them,
    state = {"n": lines seen}. Worker k of n takes lines k, k + n, ... (by index, as
    StreamingJsonl does), so it does the same per-record work as StreamingJsonl without its
    shuffle buffer and state. Module level, so DataLoader workers can pickle it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.n = 0  # lines seen (all workers' lines, like StreamingJsonl's offsets)
        self.start = 0

    def __iter__(self) -> Iterator[dict]:
        import orjson
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        with open(self.path, "rb") as f:
            for i, line in enumerate(f):
                self.n = i + 1
                if i >= self.start and i % workers == worker:
                    yield orjson.loads(line)
        self.start = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["n"]


def _advance(records: Iterator, n: int) -> None:
    got = sum(1 for _ in islice(records, n))
    if got != n:
        raise RuntimeError(f"the corpus ran out {n - got} records early; make it larger")


def measure_state(path: str, buffer_size: int, records: int, calls: int, budget: float) -> dict:
    """state_dict() cost on a directly iterated shuffled dataset once its buffer is full."""
    from streamds import StreamingJsonl

    ds = StreamingJsonl(path, shuffle=True, buffer_size=buffer_size)
    stream = iter(ds)
    _advance(stream, buffer_size + FILL_EXTRA)
    start = time.perf_counter()
    state = ds.state_dict()
    first = time.perf_counter() - start
    size = len(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < 5 or (len(times) < calls and time.perf_counter() < deadline):
        _advance(stream, STEP)
        start = time.perf_counter()
        ds.state_dict()
        times.append(time.perf_counter() - start)
    done = buffer_size + FILL_EXTRA + STEP * len(times)
    mid = max(records // 2, done + STEP)
    if mid + buffer_size > records:
        raise RuntimeError(f"{records} records are too few for buffer_size={buffer_size}")
    _advance(stream, mid - done)
    start = time.perf_counter()
    ds.state_dict()
    return {
        "median_us": statistics.median(times) * 1e6,
        "calls": len(times),
        "first_us": first * 1e6,
        "mid_us": (time.perf_counter() - start) * 1e6,
        "mid_at": mid,
        "bytes": size,
    }


def measure_epoch(
    path: str, records: int, *, workers: int, stateful: bool, shuffle: bool, batch_size: int,
    collate: str, map_fn: bool, cap: float, snapshot: int = 1, floor: bool = False,
) -> dict:
    """Records/s over one epoch through a DataLoader (or StatefulDataLoader taking the state
    every `snapshot` batches), of StreamingJsonl or (floor=True) of FloorLines."""
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from streamds import StreamingJsonl

    if floor:
        ds = FloorLines(path)
    else:
        ds = StreamingJsonl(path, shuffle=shuffle, buffer_size=EPOCH_BUFFER)
    if map_fn:
        ds = ds.map(add_length)
    collate_fn = batch_ids if collate == "ids" else keep_batch
    options = {"batch_size": batch_size, "num_workers": workers, "collate_fn": collate_fn}
    if stateful:
        loader = StatefulDataLoader(ds, snapshot_every_n_steps=snapshot, **options)
    else:
        loader = DataLoader(ds, **options)
    read, capped = 0, False
    start = time.perf_counter()
    for batch in loader:
        read += len(batch)
        if cap and time.perf_counter() - start > cap:
            capped = True
            break
    seconds = time.perf_counter() - start
    if not capped and read != records:
        raise RuntimeError(f"an epoch yielded {read} records; the corpus has {records}")
    return {"rate": read / seconds, "share": read / records}


CHILDREN = {"state": measure_state, "epoch": measure_epoch}


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    import streamds

    where = Path(streamds.__file__).resolve()
    if not where.is_relative_to(Path(spec["tree"]).resolve()):
        raise RuntimeError(f"imported streamds from {where}, not from {spec['tree']}")
    print(json.dumps(CHILDREN[spec["kind"]](**spec["args"])))
    return 0


# -- the parent: corpora, versions, jobs, report --------------------------------------------


@dataclass(frozen=True)
class Version:
    name: str  # column heading
    tree: Path


@dataclass
class Job:
    key: str
    kind: str
    args: dict
    runs: dict[str, list[dict]] = field(default_factory=dict)  # version name -> child results
    floor: bool = False  # FloorLines: runs once per repeat (under FLOOR), not once per version


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def ref_worktree(ref: str) -> Path:
    """A detached worktree of `ref` under /tmp, made once and reused."""
    sha = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    tree = Path(tempfile.gettempdir()) / f"streamds-ref-{sha[:12]}"
    if not (tree.exists() and git("rev-parse", "HEAD", cwd=tree) == sha):
        git("worktree", "add", "--detach", str(tree), sha)
    return tree


def this_tree_name() -> str:
    dirty = git("status", "--porcelain", "--", "streamds")
    return f"new ({git('rev-parse', '--short', 'HEAD')}{' + edits' if dirty else ''})"


def write_short_records(path: Path, records: int) -> None:
    """`{"id": i, "text": ~100 chars}` lines, the same for every run."""
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
             for _ in range(2_000)]
    with open(path, "w") as f:
        for i in range(records):
            text, length = [], 0
            while length < 100:
                word = rng.choice(words)
                text.append(word)
                length += len(word) + 1
            f.write(json.dumps({"id": i, "text": " ".join(text)}) + "\n")


def run_child(job: Job, version: Version) -> dict:
    spec = {"kind": job.kind, "args": job.args, "tree": str(version.tree)}
    env = {**os.environ, "PYTHONPATH": str(version.tree)}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{job.key} on {version.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def epoch_key(workers: int, stateful: bool, snapshot: int = 1, *, floor: bool = False,
              mapped: bool = False) -> str:
    reader = "floor" if floor else "epoch"
    return f"{reader} {workers} {stateful} {mapped}" + (f" every {snapshot}" if stateful else "")


def make_jobs(args: argparse.Namespace, short: Path, short_records: int, corpora: list) -> list:
    jobs = []
    for buffer_size in BUFFERS:
        jobs.append(Job(f"state {buffer_size}", "state", {
            "path": str(short), "buffer_size": buffer_size, "records": short_records,
            "calls": args.calls, "budget": args.call_budget}))
    common = {"records": short_records, "shuffle": True, "batch_size": 32, "collate": "ids",
              "cap": args.cap}
    for workers in args.workers:
        for floor in (False, True):
            for stateful, snapshot in [(False, 1)] + [(True, n) for n in SNAPSHOTS]:
                jobs.append(Job(epoch_key(workers, stateful, snapshot, floor=floor), "epoch", {
                    "path": str(short), "workers": workers, "stateful": stateful,
                    "snapshot": snapshot, "floor": floor, "map_fn": False, **common},
                    floor=floor))
    for stateful in (False, True):
        jobs.append(Job(epoch_key(max(args.workers), stateful, mapped=True), "epoch", {
            "path": str(short), "workers": max(args.workers), "stateful": stateful,
            "map_fn": True, **common}))
    for corpus in corpora:
        for shuffle in (False, True):
            jobs.append(Job(f"corpus {corpus.name} {shuffle}", "epoch", {
                "path": str(corpus.plain), "records": corpus.records, "workers": 0,
                "stateful": False, "shuffle": shuffle, "batch_size": 64, "collate": "list",
                "map_fn": False, "cap": 0.0}))
    return jobs


def median_of(job: Job, version: str, metric: str) -> float:
    return statistics.median(run[metric] for run in job.runs[version])


def table(jobs: list[Job], versions: list[Version], corpora: list, args) -> str:
    names = [v.name for v in versions]
    by_key = {job.key: job for job in jobs}
    ratio = len(names) == 2
    head = ("| measurement | " + " | ".join(names) + (" | new/old" if ratio else "")
            + f" | {FLOOR} (FloorLines) |")
    lines = [head, "|---|" + "---:|" * (len(names) + ratio + 1)]

    def busy_marks(job: Job, among: list[str]) -> list[str]:
        return [" †" if median_of(job, v, "others") > BUSY else "" for v in among]

    def row(label: str, values: list[float], fmt: str = ",.0f", notes: list[str] = (),
            floor: tuple[float, str] | None = None) -> None:
        notes = notes or [""] * len(values)
        cells = [f"{v:{fmt}}{n}" for v, n in zip(values, notes, strict=True)]
        if ratio:
            cells.append(f"{values[1] / values[0]:.2f}" if values[0] else "-")
        cells.append(f"{floor[0]:{fmt}}{floor[1]}" if floor else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for buffer_size in BUFFERS:
        job = by_key[f"state {buffer_size}"]
        calls = min(run["calls"] for v in names for run in job.runs[v])
        mid = job.runs[names[0]][0]["mid_at"]
        b = f"buffer {buffer_size:,}"
        row(f"state_dict() µs, {b}: median of ≥{calls} calls, a batch apart",
            [median_of(job, v, "median_us") for v in names], notes=busy_marks(job, names))
        row(f"state_dict() µs, {b}: first call once full",
            [median_of(job, v, "first_us") for v in names])
        row(f"state_dict() µs, {b}: one call mid-way ({mid:,} records in)",
            [median_of(job, v, "mid_us") for v in names])
        row(f"pickled state bytes, {b}", [median_of(job, v, "bytes") for v in names])

    def rate(key: str, among: list[str]) -> tuple[list[float], list[str]]:
        job = by_key[key]
        values = [median_of(job, v, "rate") for v in among]
        notes = []
        for v, mark in zip(among, busy_marks(job, among), strict=True):
            share = min(run["share"] for run in job.runs[v])
            notes.append((f" ({share:.0%} read)" if share < 1 else "") + mark)
        return values, notes

    def floor_rate(key: str) -> tuple[float, str]:
        values, notes = rate(key, [FLOOR])
        return values[0], notes[0]

    for workers in args.workers:
        what = f"{workers} worker{'' if workers == 1 else 's'}"
        plain, plain_notes = rate(epoch_key(workers, False), names)
        floor_plain = floor_rate(epoch_key(workers, False, floor=True))
        row(f"short records/s, DataLoader, {what}", plain, notes=plain_notes, floor=floor_plain)
        for snapshot in SNAPSHOTS:
            loader = ("StatefulDataLoader" if snapshot == 1 else
                      f"StatefulDataLoader(snapshot_every_n_steps={snapshot})")
            stateful, stateful_notes = rate(epoch_key(workers, True, snapshot), names)
            floor_stateful = floor_rate(epoch_key(workers, True, snapshot, floor=True))
            row(f"short records/s, {loader}, {what}", stateful, notes=stateful_notes,
                floor=floor_stateful)
            row(f"**{loader} / DataLoader**, {what}",
                [s / p for s, p in zip(stateful, plain, strict=True)], ".3f",
                floor=(floor_stateful[0] / floor_plain[0], ""))
    workers = max(args.workers)
    what = f".map(fn), {workers} worker{'' if workers == 1 else 's'}"
    plain, plain_notes = rate(epoch_key(workers, False, mapped=True), names)
    stateful, stateful_notes = rate(epoch_key(workers, True, mapped=True), names)
    row(f"short records/s, DataLoader, {what}", plain, notes=plain_notes)
    row(f"short records/s, StatefulDataLoader, {what}", stateful, notes=stateful_notes)
    row(f"**StatefulDataLoader / DataLoader**, {what}",
        [s / p for s, p in zip(stateful, plain, strict=True)], ".3f")
    for corpus in corpora:
        size = corpus.decoded_bytes / corpus.records
        size_text = f"{size / 1000:.0f} KB" if size >= 1000 else f"{size:.0f} B"
        kind = "PubMed" if corpus.name.startswith("pubmed") else "small lines"
        for shuffle in (False, True):
            how = f"shuffle (buffer {EPOCH_BUFFER:,})" if shuffle else "no shuffle"
            values, notes = rate(f"corpus {corpus.name} {shuffle}", names)
            row(f"{kind} ({corpus.records:,} × {size_text}) records/s, {how}, 0 workers",
                values, notes=notes)
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(fig, path: Path, rect: tuple = (0, 0, 1, 1)) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=120)
    return f"plot: {path.relative_to(ROOT)}"


def plot_state(jobs: list[Job], versions: list[Version], path: Path) -> str:
    """state_dict() µs (median of the calls a batch apart) against buffer_size, log-log."""
    plt = _pyplot()
    if plt is None:
        return f"matplotlib is not installed in this environment: no {path.name}"
    by_key = {job.key: job for job in jobs}
    fig, ax = plt.subplots(figsize=(6, 4))
    for version in versions:
        times = [median_of(by_key[f"state {b}"], version.name, "median_us") for b in BUFFERS]
        ax.plot(BUFFERS, times, marker="o", label=version.name)
        for b, t in zip(BUFFERS, times, strict=True):
            ax.annotate(f"{t:,.0f}" if t >= 10 else f"{t:.1f}", (b, t),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="buffer_size (records)",
           ylabel="state_dict() µs (median)",
           title="state_dict() once the buffer is full, a batch apart")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_ratio(jobs: list[Job], versions: list[Version], workers: list[int], path: Path) -> str:
    """StatefulDataLoader / DataLoader records/s per worker count: each version and the floor,
    one panel per snapshot_every_n_steps."""
    plt = _pyplot()
    if plt is None:
        return f"matplotlib is not installed in this environment: no {path.name}"
    by_key = {job.key: job for job in jobs}
    series = [(v.name, False) for v in versions] + [(f"{FLOOR} (FloorLines)", True)]
    fig, axes = plt.subplots(1, len(SNAPSHOTS), figsize=(5 * len(SNAPSHOTS), 4), sharey=True)
    width = 0.8 / len(series)
    for ax, snapshot in zip(axes, SNAPSHOTS, strict=True):
        for i, (name, floor) in enumerate(series):
            column = FLOOR if floor else name
            ratios = [median_of(by_key[epoch_key(w, True, snapshot, floor=floor)], column, "rate")
                      / median_of(by_key[epoch_key(w, False, floor=floor)], column, "rate")
                      for w in workers]
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(workers))]
            bars = ax.bar(xs, ratios, width, label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(workers)), [str(w) for w in workers])
        ax.set(xlabel="num_workers", title=f"snapshot_every_n_steps={snapshot}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.12)
    axes[0].set_ylabel("StatefulDataLoader / DataLoader records/s")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(series), fontsize=9)
    fig.suptitle("What StatefulDataLoader keeps of DataLoader's throughput (short records, "
                 "batch_size=32; 1.0 = no loss)", fontsize=10)
    return _save(fig, path, rect=(0, 0.07, 1, 1))


def write_docs(body: str) -> str:
    """Replace the bench:state section of docs/performance.md with the table."""
    from common import PERFORMANCE, replace_section

    replace_section(PERFORMANCE, "state", body)
    return f"wrote the table into {PERFORMANCE.relative_to(ROOT)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", help="git ref of the old code (e.g. a42025e), in a worktree")
    parser.add_argument("--new-ref", help="git ref of the new code (default: this checkout, "
                        "edits included)")
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--repeats", type=int, help="child runs per row (median); 3, quick 1")
    parser.add_argument("--records", type=int, help="short records (300,000; quick 210,000)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--cap", type=float, help="seconds after which an epoch run stops "
                        "(20; quick 4; 0: never)")
    parser.add_argument("--quiet-wait", type=float, nargs=2, metavar=("PER_RUN", "TOTAL"),
                        help="max seconds to wait for an idle machine before each child run, "
                        "and in all (5 300; quick 1 10)")
    parser.add_argument("--write-docs", "--write-readme", dest="write_docs",
                        action="store_true", help="replace the bench:state section of "
                        "docs/performance.md (this checkout only: no --ref, --new-ref)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    if args.write_docs and (args.ref or args.new_ref):
        parser.error("--write-docs measures this checkout only (the docs show the current "
                     "code); leave out --ref and --new-ref")
    quick = args.quick
    args.repeats = args.repeats or (1 if quick else 3)
    args.records = args.records or (210_000 if quick else 300_000)
    args.cap = (4.0 if quick else 20.0) if args.cap is None else args.cap
    args.calls, args.call_budget = (10, 1.0) if quick else (100, 4.0)
    args.quiet_wait = args.quiet_wait or ((1.0, 10.0) if quick else (5.0, 300.0))
    if args.records < 2 * max(BUFFERS) + 5_000:
        parser.error(f"--records must be at least {2 * max(BUFFERS) + 5_000:,}")

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import machine, machine_busy, own_cpu, pubmed_corpus, small_lines_corpus
    from throughput import QuietWaiter

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    began = time.perf_counter()
    command = shlex.join(["python", "benchmarks/state_bench.py", *sys.argv[1:]])
    host = f"{machine()}; os.cpu_count()={os.cpu_count()}"
    print(f"machine: {host}\ncommand: {command}\n", flush=True)
    versions = [Version("streamds" if args.write_docs else this_tree_name(), ROOT)]
    if args.new_ref:
        tree = ref_worktree(args.new_ref)
        versions = [Version(f"new ({git('rev-parse', '--short', 'HEAD', cwd=tree)})", tree)]
    if args.ref:
        tree = ref_worktree(args.ref)
        versions.insert(0, Version(f"old ({git('rev-parse', '--short', 'HEAD', cwd=tree)})",
                                   tree))
    shas = {v.name: git("rev-parse", "HEAD", cwd=v.tree) for v in versions}
    print("versions: " + "; ".join(f"{name} = {sha}" for name, sha in shas.items())
          + f"; {FLOOR} = FloorLines (this script), run with the {versions[-1].name} tree\n",
          flush=True)
    floor_version = Version(FLOOR, versions[-1].tree)
    scale = 0.1 if quick else 1.0
    corpora = [pubmed_corpus(round(3e8 * scale), record_chars=7_000, log=log),
               small_lines_corpus(round(6e7 * scale), log=log)]
    with tempfile.TemporaryDirectory(prefix="streamds-state-bench-") as tmp:
        short = Path(tmp) / "short.jsonl"
        write_short_records(short, args.records)
        for path in [short, *(c.plain for c in corpora)]:
            path.read_bytes()  # into the page cache
        jobs = make_jobs(args, short, args.records, corpora)
        floors = sum(job.floor for job in jobs)
        log(f"corpora ready in {time.perf_counter() - began:.0f}s; ({len(jobs) - floors} rows x "
            f"{len(versions)} versions + {floors} floor rows) x {args.repeats} repeats")
        measured = time.perf_counter()
        busy_all, own_all = machine_busy(), own_cpu()
        wait = QuietWaiter(*args.quiet_wait)
        for repeat in range(args.repeats):
            order = versions if repeat % 2 == 0 else versions[::-1]
            for job in jobs:
                for version in [floor_version] if job.floor else order:
                    wait()
                    busy, own, start = machine_busy(), own_cpu(), time.perf_counter()
                    result = run_child(job, version)
                    theirs = machine_busy() - busy - (own_cpu() - own)
                    result["others"] = max(0.0, theirs / (time.perf_counter() - start))
                    job.runs.setdefault(version.name, []).append(result)
                    log(f"  [{repeat + 1}/{args.repeats}] {job.key:<28} {version.name:<24} "
                        + json.dumps(result))
        wall = time.perf_counter() - measured
        others = max(0.0, (machine_busy() - busy_all - (own_cpu() - own_all)) / wall)

    report = table(jobs, versions, corpora, args)
    notes = (
        f"Machine: {host}. Each value is the median of {args.repeats} child run(s)"
        + ("" if len(versions) == 1 else " (versions alternate which runs first); for µs "
           "rows new/old < 1 means the new code takes less time; a ratio row's new/old "
           "compares the two versions' ratios")
        + ". state_dict() rows: a shuffled dataset iterated directly, timed after "
        f"buffer_size + {FILL_EXTRA} records, then every {STEP} records. \"short records\": "
        f"{args.records:,} lines of {{\"id\", \"text\": ~100 chars}}, shuffle=True, "
        f"buffer_size={EPOCH_BUFFER:,}, batch_size=32, collate_fn returning the ids; "
        "StatefulDataLoader's workers take the state after every batch "
        "(snapshot_every_n_steps=1) or every 64 batches where the row says so; with 0 workers "
        "it takes none unless asked. The floor column: FloorLines, a trivial stateful "
        "IterableDataset defined in the script (reads the lines, orjson.loads each, state = "
        "{\"n\": lines seen}; worker k of n takes lines k, k + n, ...; no shuffle), measured "
        "once per repeat: its StatefulDataLoader / DataLoader ratio is what torchdata alone "
        "costs. Epoch runs stop "
        f"after {args.cap:g} s and count the records read by then (\"% read\"). PubMed and "
        "small lines: DataLoader(batch_size=64), collate_fn returning the list. Other "
        f"processes used {others:.2f} cores on average while measuring; † marks values "
        f"whose runs had them use more than {BUSY} cores (median of the runs). Measured in "
        f"{wall:.0f} s, {args.quiet_wait[1] - wait.left:.0f} s of it waiting for a quiet "
        "machine." + ("" if args.write_docs else " Versions: " + "; ".join(
            f"{name} = {sha}" for name, sha in shas.items()) + ".")
    )
    body = f"{report}\n\n{notes}\n\n```bash\n{command}\n```"
    print(f"\n{report}\n\n{notes}\n", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "state_bench.md").write_text(f"{body}\n")
    print(f"table: {(RESULTS / 'state_bench.md').relative_to(ROOT)}")
    raw = {"command": command, "machine": host, "versions": [v.name for v in versions],
           "shas": shas,
           "jobs": [{"key": j.key, "args": j.args, "runs": j.runs} for j in jobs]}
    (RESULTS / "state_bench.json").write_text(json.dumps(raw, indent=1))
    print(plot_state(jobs, versions, RESULTS / "state_bench.png"))
    print(plot_ratio(jobs, versions, args.workers, RESULTS / "state_ratio.png"))
    if args.write_docs:
        print(write_docs(body))
    print(f"measured in {wall:.0f}s, {time.perf_counter() - began:.0f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
