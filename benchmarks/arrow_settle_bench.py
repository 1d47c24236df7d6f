"""What building a dataset over a remote Arrow IPC file-format file costs, and what one epoch
then fetches: GET requests, bytes served and seconds, for a file of many small record batches
and one of few large ones, over a loopback HTTP server (`testbed.http.serve`, in this process)
with `--latency` seconds added to every request.

    python benchmarks/arrow_settle_bench.py                    # ~20 MB files, 0 and 20 ms
    python benchmarks/arrow_settle_bench.py --mb 5 --latency 0

Run it under two checkouts (PYTHONPATH=...) to compare them; the files are written afresh in
a temporary folder each run. Times are wall seconds on this machine (share its load).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from streamds import StreamingJsonl
from testbed.http import Faults, Request, serve

ROW_TEXT = 100  # characters of text per row


def write_file(path: Path, batches: int, rows: int) -> None:
    """An Arrow IPC file-format file of `batches` record batches of `rows` rows."""
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for k in range(batches):
            ids = list(range(k * rows, (k + 1) * rows))
            writer.write_batch(pa.record_batch(
                [pa.array(ids), pa.array([f"{i:>{ROW_TEXT}}" for i in ids])], schema=schema))


def served_bytes(log: list[Request], size: int) -> int:
    """Body bytes sent for the GETs in `log` (a ranged GET its range, a plain one the file)."""
    total = 0
    for request in log:
        if request.method != "GET" or request.status >= 400:
            continue
        if request.range is None:
            total += size
            continue
        first, last = request.range.removeprefix("bytes=").split("-")
        total += min(int(last), size - 1) - int(first) + 1
    return total


def measure(server, name: str, size: int) -> dict[str, float]:
    url = f"{server.url}/{name}"
    server.reset_log()
    began = time.perf_counter()
    ds = StreamingJsonl(url, columns=["id"])
    built = time.perf_counter() - began
    log = [r for r in server.log if r.path == f"/{name}"]
    gets, sent = sum(r.method == "GET" for r in log), served_bytes(log, size)
    rows = len(ds)
    server.reset_log()
    began = time.perf_counter()
    count = sum(1 for _ in ds)
    read = time.perf_counter() - began
    assert count == rows, (count, rows)
    log = [r for r in server.log if r.path == f"/{name}"]
    return {"build_gets": gets, "build_mb": sent / 1e6, "build_s": built,
            "epoch_gets": sum(r.method == "GET" for r in log),
            "epoch_mb": served_bytes(log, size) / 1e6, "epoch_s": read, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0, help="size of each file, about")
    parser.add_argument("--latency", type=float, nargs="*", default=[0.0, 0.02])
    args = parser.parse_args()
    rows_total = int(args.mb * 1e6 / (ROW_TEXT + 12))
    shapes = {"many small batches": (rows_total // 50, 50),
              "few large batches": (4, rows_total // 4)}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for batches, rows in shapes.values():
            write_file(root / f"{batches}x{rows}.arrow", batches, rows)
        print("| file | latency | build: GETs | build: MB served | build: s "
              "| epoch: GETs | epoch: MB served | epoch: s |")
        print("|---|---|---|---|---|---|---|---|")
        for latency in args.latency:
            with serve(root, Faults(latency=latency)) as server:
                for label, (batches, rows) in shapes.items():
                    name = f"{batches}x{rows}.arrow"
                    size = (root / name).stat().st_size
                    got = measure(server, name, size)
                    print(f"| {label} ({batches} x {rows} rows, {size / 1e6:.1f} MB) "
                          f"| {latency * 1000:.0f} ms | {got['build_gets']} "
                          f"| {got['build_mb']:.2f} | {got['build_s']:.2f} "
                          f"| {got['epoch_gets']} | {got['epoch_mb']:.1f} "
                          f"| {got['epoch_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
