"""How StreamingJsonl's time and memory grow with corpus size, shuffle buffer and record size.

Three series, each point one full pass of a fresh process at num_workers=0 (the reader itself,
no DataLoader), shuffled; medians of --repeats timed passes after one untimed pass (warm page
cache); peak memory is the process's peak RSS (VmHWM) over the untimed pass, and
"above start" subtracts its RSS once streamds and torch are imported:

- corpus size (plain .jsonl, PubMed layout, ~21 KB lines, buffer 1,000 records): 0.1 GB
  generated, the 1 and 4 GB files are that one repeated (reading cost does not care). Time
  should grow linearly with the bytes and memory stay flat (DESIGN.md guarantee 6).
- shuffle buffer (300 B lines, 150 MB): 1k, 10k, 100k records. Memory grows with the buffer.
- record size (200 MB of lines of 300 B to 200 KB, buffer 1,000 records): records/s, MB/s
  and memory (a buffer of 1,000 records of 200 KB holds 200 MB).

Data goes to bench-data/scaling/ and is deleted afterwards unless --keep.

    python benchmarks/scaling.py --write-docs      # docs/performance.md and docs/img/scaling.png
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DATA_DIR,
    MB,
    PERFORMANCE,
    add_write_docs,
    command_line,
    machine,
    replace_section,
)

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "img" / "scaling.png"
SCALING_DIR = DATA_DIR / "scaling"
GB = 1e9


# -- one pass, in a process of its own ------------------------------------------------------


def one_pass(path: str, buffer_size: int, repeats: int) -> dict[str, float]:
    """Seconds per pass (untimed first pass, then `repeats`), records, peak and start RSS."""
    from streamds import StreamingJsonl

    start_rss = _rss_now()
    times, records = [], 0
    for attempt in range(repeats + 1):
        ds = StreamingJsonl(path, shuffle=True, seed=attempt, buffer_size=buffer_size)
        start = time.perf_counter()
        records = sum(1 for _ in ds)
        if attempt:
            times.append(time.perf_counter() - start)
        else:
            peak = _peak_rss()
    return {"seconds": statistics.median(times), "records": records,
            "peak_mb": peak / MB, "start_mb": start_rss / MB,
            "bytes": Path(path).stat().st_size}


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM). Not `ru_maxrss`: that one survives exec, so a process
    started by a big parent would report the parent's size at the fork."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(path: Path, buffer_size: int, repeats: int) -> dict[str, float]:
    call = json.dumps([str(path), buffer_size, repeats])
    out = subprocess.run([sys.executable, __file__, "--one", call], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# -- data ------------------------------------------------------------------------------------


def _generate(path: Path, write: Callable[[Path], object], log: Callable[[str], None]) -> Path:
    if not path.exists():
        log(f"generating {path.name}")
        tmp = path.with_suffix(".tmp")
        write(tmp)
        tmp.rename(path)
    return path


def _repeated(base: Path, times: int, log: Callable[[str], None]) -> Path:
    path = base.with_name(f"{base.stem}-x{times}.jsonl")
    if not path.exists():
        log(f"writing {path.name} ({times} copies of {base.name})")
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            for _ in range(times):
                with open(base, "rb") as part:
                    shutil.copyfileobj(part, out, 8 << 20)
        tmp.rename(path)
    return path


def size_corpora(sizes_gb: Sequence[float], log: Callable[[str], None]) -> list[Path]:
    from streamds.tools.synthetic import write_pubmed

    smallest = min(sizes_gb)
    base = _generate(SCALING_DIR / f"pubmed-{smallest:g}GB.jsonl",
                     lambda p: write_pubmed(p, target_bytes=round(smallest * GB),
                                            record_chars=10_000), log)
    return [base if size == smallest else _repeated(base, round(size / smallest), log)
            for size in sizes_gb]


def small_lines(total: int, line_bytes: int, log: Callable[[str], None]) -> Path:
    from streamds.tools.synthetic import write_small_lines

    return _generate(SCALING_DIR / f"lines-{total // 10**6}MB-{line_bytes}B.jsonl",
                     lambda p: write_small_lines(p, target_bytes=total, line_bytes=line_bytes),
                     log)


# -- report ----------------------------------------------------------------------------------


def table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    lines = ["| series | point | data | records | s per pass | MB/s | records/s | peak RSS | "
             "above start |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for series, point, r in rows:
        lines.append(
            f"| {series} | {point} | {r['bytes'] / MB:,.0f} MB | {r['records']:,} | "
            f"{r['seconds']:.2f} | {r['bytes'] / MB / r['seconds']:,.0f} | "
            f"{r['records'] / r['seconds']:,.0f} | {r['peak_mb']:,.0f} MB | "
            f"{r['peak_mb'] - r['start_mb']:,.0f} MB |"
        )
    return "\n".join(lines)


def plot(rows: list[tuple[str, str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    series = [("corpus size", "corpus size (GB)", lambda r: r["bytes"] / GB),
              ("shuffle buffer", "shuffle buffer (records)", None),
              ("record size", "record size (bytes)", lambda r: r["bytes"] / r["records"])]
    for ax, (name, label, x_of) in zip(axes, series, strict=True):
        points = [(point, r) for s, point, r in rows if s == name]
        if not points:
            ax.set_visible(False)
            continue
        xs = [float(p.replace(",", "")) if x_of is None else x_of(r) for p, r in points]
        seconds = [r["seconds"] for _, r in points]
        memory = [r["peak_mb"] - r["start_mb"] for _, r in points]
        if name == "record size":
            ax.plot(xs, [r["bytes"] / MB / r["seconds"] for _, r in points], "o-", color="C0")
            ax.set_ylabel("MB/s (decoded JSONL)", color="C0")
        else:
            ax.plot(xs, seconds, "o-", color="C0")
            ax.set_ylabel("seconds per pass", color="C0")
        ax.set_xlabel(label)
        ax.set_xscale("log" if name != "corpus size" else "linear")
        ax.set_ylim(bottom=0)
        twin = ax.twinx()
        twin.plot(xs, memory, "s--", color="C1")
        twin.set_ylabel("peak RSS above start (MB)", color="C1")
        twin.set_ylim(bottom=0, top=max(memory) * 1.3 + 50)
        ax.set_title(name)
    fig.suptitle("StreamingJsonl, one pass at num_workers=0, shuffled: time (blue) and memory "
                 "(orange)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# -- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.1, 1, 4])
    parser.add_argument("--buffers", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--record-bytes", type=int, nargs="+",
                        default=[300, 3_000, 30_000, 200_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    add_write_docs(parser, "scaling")  # and writes PLOT
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # internal: one measured pass in this fresh process
        print(json.dumps(one_pass(*json.loads(args.one))))
        return 0

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    command, host = command_line(), machine()
    SCALING_DIR.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, dict[str, float]]] = []
    try:
        sized = size_corpora(args.sizes_gb, log)
        lines = small_lines(150 * 10**6, 300, log)
        by_record = [small_lines(200 * 10**6, size, log) for size in args.record_bytes]
        for size, path in zip(args.sizes_gb, sized, strict=True):
            rows.append(("corpus size", f"{size:g} GB", measure(path, 1_000, args.repeats)))
            log(f"  {rows[-1]}")
        for buffer in args.buffers:
            rows.append(("shuffle buffer", f"{buffer:,}", measure(lines, buffer, args.repeats)))
            log(f"  {rows[-1]}")
        for line_bytes, path in zip(args.record_bytes, by_record, strict=True):
            rows.append(("record size", f"{line_bytes:,} B",
                         measure(path, 1_000, args.repeats)))
            log(f"  {rows[-1]}")
    finally:
        if not args.keep:
            shutil.rmtree(SCALING_DIR, ignore_errors=True)
    report = table(rows)
    print(f"machine: {host}\ncommand: {command}\n\n{report}")
    if args.write_docs:
        plot(rows, PLOT)
        image = PLOT.relative_to(PERFORMANCE.parent)
        body = (f"{report}\n\n![time and memory against corpus size, shuffle buffer and "
                f"record size]({image})\n\nMachine: {host}. Medians of "
                f"{args.repeats} passes after one untimed pass, each series in fresh "
                "processes; \"above start\" is the peak RSS less the RSS with streamds and "
                f"torch imported.\n\n```bash\n{command}\n```")
        replace_section(PERFORMANCE, "scaling", body)
        log(f"wrote {PLOT} and the table into {PERFORMANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
