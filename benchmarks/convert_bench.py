"""Conversion throughput, and the training-read speed-up that conversion buys.

Two inputs, generated once under bench-data/ (reused while their names match):

- a small-file tree: 50,000 one-record PubMed-layout ``.json`` files (~4.6 KB each) in
  folders of 3,000, the layout users start from (``streamds.tools.synthetic.write_small_files``);
- one big JSONL: 1 GB of PubMed-layout lines of ~21 KB (``write_pubmed``, the same file as
  ``throughput.py``'s plain corpus).

What runs (``--scale`` shrinks both; medians of ``--repeats`` timed runs, page cache warm):

- ``convert`` (``preprocess.convert.convert``, in-process, default options: level 3, 4 MiB
  frames, 256 MB shards) with 1 and 2 workers, into a fresh directory each run. MB/s is
  stored input bytes (10^6) per second, from the call to the manifest on disk.
- the limit: the ``zstd -3 -T1`` command compressing the same bytes (the big file; for the
  tree, its files concatenated into one file beforehand) to /dev/null. Conversion also
  reads, parses and re-serialises every record, so it cannot reach this.
- reading for training: ``StreamingJsonl`` over the converted tree vs over the small files
  themselves, one epoch through ``DataLoader(batch_size=64)`` with num_workers 0 and 2, the
  same settings for both; "open" is the dataset constructor (listing the files), "epoch"
  the iteration, records/s counts both.

With ``--mount-latency SECONDS`` (e.g. 0.02), conversion straight from a slow mount: a tree of
20,000 PubMed-layout ``.json`` files of 10-20 KB (``--scale`` shrinks it), in folders of
3,000, converted from local disk and through a `testbed.slowfs` FUSE mirror that adds the
latency to every request (a fresh mount per run, so nothing is cached): one file at a time
(``read_ahead=0``) against the default read-ahead (``--mount-read-ahead`` to add other
counts). Each mount row is one run (latency, not CPU, sets its time); the shards of every
row must be byte-identical. ``--mount-baseline-files N`` times one at a time on a tree of
the first N files of the same layout instead (it is linear in files and takes ~30 minutes
for 20,000 at 20 ms). ``--mount-only`` skips everything else.

Other programs distort timings, so before each timed run the script waits (up to
``--quiet-wait`` seconds) until the rest of the machine is nearly idle, and reports the CPU
others used during the timed runs.

    python benchmarks/convert_bench.py                  # full size: a few minutes on 2 cores
    python benchmarks/convert_bench.py --scale 0.1      # a quick look
    python benchmarks/convert_bench.py --write-docs   # also fill docs/performance.md's section
    python benchmarks/convert_bench.py --mount-only --mount-latency 0.02   # mount rows only
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # after the path tweak that makes `common` importable
    DATA_DIR,
    MB,
    PERFORMANCE,
    add_write_docs,
    command_line,
    machine,
    machine_busy,
    own_cpu,
    replace_section,
)

FILES_AT_SCALE_1 = 50_000
BIG_BYTES_AT_SCALE_1 = 10**9
SMALL_RECORD_CHARS = 2000
BIG_RECORD_CHARS = 10_000  # ~21 KB lines, as throughput.py's PubMed corpus
PER_FOLDER = 3000
READ_WORKERS = (0, 2)
BATCH_SIZE = 64
SECTION = "convert"
MOUNT_FILES_AT_SCALE_1 = 20_000
MOUNT_RECORD_CHARS = 7000  # PubMed-layout records of ~15 KB (10-20 KB)


def keep_batch(batch: list) -> list:
    """collate_fn: the batch as the list of records it is (module-level, so it pickles)."""
    return batch


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- inputs --------------------------------------------------------------------------------


def small_tree(files: int, record_chars: int = SMALL_RECORD_CHARS) -> Path:
    from streamds.tools.synthetic import write_small_files

    path = DATA_DIR / f"small-files-{files}-c{record_chars}-s0"
    if not path.is_dir():
        log(f"generating {path.name}/ ({files:,} files)")
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_small_files(tmp, records=files, per_folder=PER_FOLDER, record_chars=record_chars)
        os.replace(tmp, path)
    return path


def big_jsonl(target_bytes: int) -> Path:
    from streamds.tools.synthetic import write_pubmed

    name = f"pubmed-{_size_name(target_bytes)}-c{BIG_RECORD_CHARS}-s0.jsonl"  # = common.py's
    path = DATA_DIR / name
    if not path.exists():
        log(f"generating {name}")
        tmp = path.with_name(path.name + ".tmp")
        write_pubmed(tmp, target_bytes=target_bytes, record_chars=BIG_RECORD_CHARS)
        os.replace(tmp, path)
    return path


def _size_name(size: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def tree_files(root: Path) -> list[Path]:
    from streamds.preprocess.sources import Inputs

    return [Path(leaf.path) for leaf in Inputs([root]).leaves()]


def concatenate(paths: list[Path], out: Path) -> None:
    with open(out, "wb") as f:
        for path in paths:
            f.write(path.read_bytes())


# -- timing --------------------------------------------------------------------------------

_OTHERS: list[float] = []  # cores other processes used, per timed run


class Quiet:
    """Waits for an idle machine before a timed run; records the cores others used in it."""

    max_wait = 20.0

    def __enter__(self) -> Quiet:
        start = time.perf_counter()
        while time.perf_counter() - start < self.max_wait:
            busy, own = machine_busy(), own_cpu()
            time.sleep(0.5)
            if (machine_busy() - busy - (own_cpu() - own)) / 0.5 < 0.25:
                break
        self._busy, self._own, self._start = machine_busy(), own_cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._start
        others = machine_busy() - self._busy - (own_cpu() - self._own)
        _OTHERS.append(max(0.0, others / wall) if wall > 0 else 0.0)


@dataclass(frozen=True)
class Row:
    label: str
    stored: int  # input bytes
    workers: int
    seconds: float
    cpu: float  # CPU seconds of this process, all threads (median)
    shards: int
    output: int
    decoded: int


def median_seconds(run: Callable[[], object], repeats: int,
                   cpu_clock: Callable[[], float] = own_cpu) -> tuple[float, float]:
    """Median (wall seconds, CPU seconds by `cpu_clock`: this process and its reaped
    children by default) of `repeats` runs."""
    times, cpus = [], []
    for _ in range(repeats):
        with Quiet():
            start, cpu = time.perf_counter(), cpu_clock()
            run()
            times.append(time.perf_counter() - start)
            cpus.append(cpu_clock() - cpu)
    return statistics.median(times), statistics.median(cpus)


def time_convert(inputs: list[Path], label: str, stored: int, workers: int, repeats: int,
                 scratch: Path) -> tuple[Row, Path]:
    from streamds.preprocess.convert import convert

    out = scratch / f"out-{label.split()[0]}-{workers}"
    results = []
    times, cpus = [], []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        with Quiet():
            start, cpu = time.perf_counter(), own_cpu()
            results.append(convert(inputs, out, workers=workers))
            times.append(time.perf_counter() - start)
            cpus.append(own_cpu() - cpu)
    totals = results[-1].manifest.totals
    log(f"  convert {label}, {workers} worker(s): {statistics.median(times):.2f}s "
        f"(runs {', '.join(f'{t:.2f}' for t in times)}), CPU {statistics.median(cpus):.2f}s")
    row = Row(label, stored, workers, statistics.median(times), statistics.median(cpus),
              totals["shards"], totals["bytes"], totals["decoded_bytes"])
    return row, out


def time_zstd(path: Path, repeats: int) -> tuple[float, float] | None:
    zstd = shutil.which("zstd")
    if zstd is None:
        return None

    def run() -> None:
        subprocess.run([zstd, "-3", "-T1", "-q", "-c", str(path)], stdout=subprocess.DEVNULL,
                       check=True)

    return median_seconds(run, repeats)


def time_read(source: Path, workers: int, repeats: int) -> tuple[float, float, int]:
    """(open seconds, epoch seconds, records): medians over `repeats`."""
    from torch.utils.data import DataLoader

    from streamds import StreamingJsonl

    opens, epochs, records = [], [], 0
    for _ in range(repeats):
        with Quiet():
            start = time.perf_counter()
            ds = StreamingJsonl(source)
            opened = time.perf_counter()
            loader = DataLoader(ds, batch_size=BATCH_SIZE, num_workers=workers,
                                collate_fn=keep_batch)
            records = sum(len(batch) for batch in loader)
            epochs.append(time.perf_counter() - opened)
            opens.append(opened - start)
    return statistics.median(opens), statistics.median(epochs), records


# -- conversion through a slow mount ------------------------------------------------------


_RUNS = itertools.count()


@dataclass(frozen=True)
class MountRow:
    label: str
    files: int
    seconds: float
    read_ahead: int


def time_mount_convert(tree: Path, label: str, latency: float | None, read_ahead: int,
                       scratch: Path) -> tuple[MountRow, Path]:
    """One conversion of `tree` (through a fresh slowfs mount when `latency` is set)."""
    from contextlib import nullcontext

    from streamds.preprocess.convert import convert
    from testbed.slowfs import mount

    out = scratch / f"mount-out-{next(_RUNS)}"
    place = (mount(tree, scratch / "mnt", latency=latency) if latency is not None
             else nullcontext(tree))
    with place as source, Quiet():
        start = time.perf_counter()
        result = convert([source], out, read_ahead=read_ahead)
        seconds = time.perf_counter() - start
    files = result.manifest.totals["records"]  # one record per file
    log(f"  {label}: {files:,} files in {seconds:.1f} s = {files / seconds:,.1f} files/s")
    return MountRow(label, files, seconds, read_ahead), out


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("shard-*"))}


def mount_rows(args, scratch: Path) -> tuple[list[MountRow], str]:
    from streamds.preprocess.convert import DEFAULT_READ_AHEAD
    from testbed.slowfs import fuse_available

    reason = fuse_available()
    if reason is not None:
        raise SystemExit(f"--mount-latency needs FUSE: {reason}")
    files = max(100, round(MOUNT_FILES_AT_SCALE_1 * args.scale))
    tree = small_tree(files, MOUNT_RECORD_CHARS)
    latency = args.mount_latency
    ms = f"{latency * 1000:g} ms mount"
    counts = sorted({DEFAULT_READ_AHEAD, *args.mount_read_ahead})
    rows, outs = [], []
    log(f"conversion of {files:,} .json files: local disk vs a {ms}")
    row, out = time_mount_convert(tree, "local disk, default read-ahead", None,
                                  DEFAULT_READ_AHEAD, scratch)
    rows.append(row)
    outs.append(out)
    baseline_tree = tree
    if args.mount_baseline_files and args.mount_baseline_files < files:
        baseline_tree = small_tree(args.mount_baseline_files, MOUNT_RECORD_CHARS)
    row, out = time_mount_convert(baseline_tree, f"{ms}, one file at a time", latency, 0,
                                  scratch)
    rows.append(row)
    if baseline_tree == tree:
        outs.append(out)
    for count in counts:
        row, out = time_mount_convert(tree, f"{ms}, read-ahead {count}", latency, count,
                                      scratch)
        rows.append(row)
        outs.append(out)
    first = shard_bytes(outs[0])
    if any(shard_bytes(out) != first for out in outs[1:]):
        raise SystemExit("the shards differ between rows: the output must not depend on "
                         "where the files are or on read-ahead")
    base = rows[1].files / rows[1].seconds
    lines = [
        f"Conversion of {files:,} PubMed-layout `.json` files (~15 KB, folders of "
        f"{PER_FOLDER:,}) from local disk and through `testbed.slowfs` adding {latency * 1000:g} "
        "ms to every request (fresh mount per run); shards byte-identical in every row. "
        f"Command: `{command_line()}`.",
        "",
        "| source | read-ahead | files | time | files/s | vs one at a time |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        rate = row.files / row.seconds
        lines.append(f"| {row.label} | {row.read_ahead} | {row.files:,} | {row.seconds:,.2f} s "
                     f"| {rate:,.1f} | {rate / base:,.1f}x |")
    if baseline_tree != tree:
        lines += ["", f"One at a time was timed on the first {rows[1].files:,} files (same "
                  "layout): its cost is per file."]
    return rows, "\n".join(lines)


# -- report --------------------------------------------------------------------------------


def report(rows: list[Row], limits: dict[str, tuple[float, float] | None], reads: list[tuple],
           args) -> str:
    others = statistics.median(_OTHERS) if _OTHERS else 0.0
    lines = [
        f"Machine: {machine()}; other processes used a median {others:.2f} cores during "
        "the timed runs.",
        f"Command: `{command_line()}` (medians of {args.repeats} runs, warm page cache).",
        "",
        "| input | stored | workers | convert | MB/s | CPU | MB per CPU s "
        "| `zstd -3 -T1` MB/s (per CPU s) | shards | output | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        limit = limits[row.label]
        limit_text = "n/a"
        if limit:
            limit_text = f"{row.stored / limit[0] / MB:,.0f} ({row.stored / limit[1] / MB:,.0f})"
        lines.append(
            f"| {row.label} | {row.stored / MB:,.0f} MB | {row.workers} | {row.seconds:.2f} s "
            f"| {row.stored / row.seconds / MB:,.1f} | {row.cpu:.2f} s "
            f"| {row.stored / row.cpu / MB:,.1f} | {limit_text} | {row.shards} "
            f"| {row.output / MB:,.1f} MB | {row.decoded / row.output:.1f}x |"
        )
    lines += [
        "",
        f"Reading for training: `StreamingJsonl(dir)` in `DataLoader(batch_size={BATCH_SIZE})`, "
        "one epoch; records/s counts open + epoch; speed-up is against the small files with "
        "the same num_workers:",
        "",
        "| source | num_workers | records | open | epoch | records/s | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {workers: records / (opened + epoch)
            for label, workers, opened, epoch, records in reads if label == reads[0][0]}
    for label, workers, opened, epoch, records in reads:
        rate = records / (opened + epoch)
        lines.append(f"| {label} | {workers} | {records:,} | {opened:.2f} s | {epoch:.2f} s "
                     f"| {rate:,.0f} | {rate / base[workers]:.1f}x |")
    lines += [
        "",
        "MB/s counts stored input bytes (10^6) per wall second; CPU is the converter's CPU "
        "time over all its threads, which other programs on the machine do not inflate. The "
        "`zstd` column is the command compressing the same bytes on one core: the ceiling for "
        "the compression step alone; conversion also reads, parses (orjson), re-serialises and "
        "hashes every record, so one worker stays well below it. Small files here "
        "sit in the page cache of a local disk; on network storage (a mounted Drive) reading "
        "them directly is far slower, which is what conversion removes.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="fraction of 50,000 files and 1 GB (default 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=20.0,
                        help="max seconds to wait for an idle machine before each run")
    add_write_docs(parser, "convert")
    parser.add_argument("--mount-latency", type=float, default=None, metavar="SECONDS",
                        help="also convert through a testbed.slowfs mount with this latency")
    parser.add_argument("--mount-read-ahead", type=int, nargs="*", default=[], metavar="N",
                        help="read-ahead counts to time through the mount besides the default")
    parser.add_argument("--mount-baseline-files", type=int, default=0, metavar="N",
                        help="time one file at a time on a tree of N files (default: all)")
    parser.add_argument("--mount-only", action="store_true",
                        help="run only the mount rows (needs --mount-latency)")
    args = parser.parse_args(argv)
    Quiet.max_wait = args.quiet_wait
    if args.mount_only:
        if args.mount_latency is None:
            parser.error("--mount-only needs --mount-latency")
        with tempfile.TemporaryDirectory(prefix="convert-bench-", dir=DATA_DIR) as scratch:
            print(mount_rows(args, Path(scratch))[1])
        return 0
    files = max(100, round(FILES_AT_SCALE_1 * args.scale))
    big_bytes = max(10**6, round(BIG_BYTES_AT_SCALE_1 * args.scale / 10**6) * 10**6)

    tree = small_tree(files)
    big = big_jsonl(big_bytes)
    with tempfile.TemporaryDirectory(prefix="convert-bench-", dir=DATA_DIR) as scratch_name:
        scratch = Path(scratch_name)
        paths = tree_files(tree)
        tree_bytes = sum(p.stat().st_size for p in paths)
        concatenated = scratch / "tree-concatenated.jsonl"
        concatenate(paths, concatenated)
        tree_label = f"{files:,} small .json files"
        big_label = f"one {_size_name(big_bytes)} JSONL"
        limits = {}
        log("zstd -3 -T1 on the same bytes")
        limits[tree_label] = time_zstd(concatenated, args.repeats)
        limits[big_label] = time_zstd(big, args.repeats)
        concatenated.unlink()

        rows = []
        converted_tree = None
        for label, inputs, stored in ((tree_label, [tree], tree_bytes),
                                      (big_label, [big], big.stat().st_size)):
            for workers in (1, 2):
                row, out = time_convert(inputs, label, stored, workers, args.repeats, scratch)
                rows.append(row)
                if label == tree_label:
                    converted_tree = out
        assert converted_tree is not None

        log("reading for training")
        reads = []
        for workers in READ_WORKERS:
            for label, source in ((f"{files:,} small .json files", tree),
                                  ("the same, converted", converted_tree)):
                opened, epoch, records = time_read(source, workers, args.repeats)
                if records != files:
                    raise SystemExit(f"{label}: read {records} records, expected {files}")
                log(f"  {label}, num_workers={workers}: open {opened:.2f}s, epoch {epoch:.2f}s")
                reads.append((label, workers, opened, epoch, records))

        mount_text = mount_rows(args, scratch)[1] if args.mount_latency is not None else ""

    text = report(rows, limits, reads, args)
    if mount_text:
        text += "\n\n" + mount_text
    print(text)
    if args.write_docs:
        replace_section(PERFORMANCE, SECTION, text)
        log(f"updated {PERFORMANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
