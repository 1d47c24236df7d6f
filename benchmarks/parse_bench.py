"""Parse-bound reading: streamds iterated directly (no DataLoader, one core) against the
one-core loop over the same seekable `.jsonl.zst`, side by side in one run.

The loop is what one core can do at all: a `zstandard` stream reader, `bytes.split(b"\\n")`
and `orjson.loads` of every line (`throughput.limit_zst`), and the same handing out lists of
64 (`throughput.limit_zst_batches`). streamds runs as `for record in StreamingJsonl(path)`
and `for batch in StreamingJsonl(path).batch(64)`: the reader, the exact-integer search,
the state kept per record, nothing else. With `--compare DIR` the streamds rows are also
run from another checkout (e.g. ``git worktree add ../base main``), by putting DIR first on
the children's PYTHONPATH, in the same rounds.

Every run is a fresh process (imports done before the clock starts) that reads the whole
file `--repeats` times; the rounds interleave every row, and each figure is the median over
the rounds of the row's median run ("x loop": the loop's median time in the same round over
the row's, median over the rounds). The corpus (`streamds.tools.synthetic` PubMed layout, written
as seekable zstd with a manifest, as `streamds convert` writes it) is generated under
`bench-data/` and kept for the next run unless `--delete-corpus`.

    .venv/bin/python benchmarks/parse_bench.py                    # ~3 min on 2 cores
    .venv/bin/python benchmarks/parse_bench.py --compare ../base --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (
    DATA_DIR,
    MB,
    PERFORMANCE,
    ROOT,
    _size_name,
    _write_seekable,
    add_write_docs,
    command_line,
    machine,
    publish,
    replace_section,
)

BATCH = 64
# row -> what the child runs: the loops need no checkout, the streamds rows run from one
ROWS = {
    "loop": "the one-core loop (zstd stream + split + orjson.loads)",
    "loop_batches": "the one-core loop in lists of 64",
    "records": "streamds, per record",
    "batches": "streamds, `.batch(64)`",
}


def corpus(size: int, record_chars: int, seed: int) -> tuple[Path, int, int]:
    """(the seekable .jsonl.zst, records, decoded bytes), generated when missing."""
    from streamds.tools.synthetic import write_pubmed

    name = f"parse-pubmed-{_size_name(size)}-c{record_chars}-s{seed}"
    zst = DATA_DIR / f"{name}.seekable-l3" / "shard-000000.jsonl.zst"
    if not zst.exists():
        DATA_DIR.mkdir(parents=True, exist_ok=True)
        plain = DATA_DIR / f"{name}.jsonl.tmp"
        try:
            print(f"generating {zst.parent.name}/ ({size / MB:,.0f} MB of JSON lines)",
                  file=sys.stderr)
            write_pubmed(plain, target_bytes=size, seed=seed, record_chars=record_chars)
            _write_seekable(plain, zst, level=3, frame_size=4 << 20)
        finally:
            plain.unlink(missing_ok=True)  # only the compressed shard is kept
    manifest = json.loads((zst.parent / "manifest.json").read_text())
    (entry,) = manifest["shards"]
    return zst, entry["records"], entry["decoded_bytes"]


def child(row: str, checkout: str, path: str, repeats: int, records: int) -> None:
    """Run `row` `repeats` times over `path` with the streamds of `checkout`; print the
    seconds of each run as JSON."""
    sys.path.insert(0, checkout)  # before `common`'s entry for this checkout
    from throughput import limit_zst, limit_zst_batches

    import streamds

    def run() -> int:
        if row == "loop":
            return limit_zst(Path(path), 1 << 20)
        if row == "loop_batches":
            return limit_zst_batches(Path(path), 1 << 20, BATCH)
        if row == "records":
            return sum(1 for _ in streamds.StreamingJsonl(path))
        return sum(map(len, streamds.StreamingJsonl(path).batch(BATCH)))

    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        got = run()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if got != records:
            raise SystemExit(f"{row}: read {got} records, the corpus holds {records}")
    print(json.dumps({"wall": wall, "cpu": cpu, "streamds": streamds.__file__}))


def run_child(row: str, checkout: Path, path: Path, repeats: int, records: int
              ) -> tuple[float, float]:
    """The median (wall, CPU) seconds of `row` run from `checkout` in a fresh process."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", row, str(checkout), str(path), str(repeats),
         str(records)],
        capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode:
        raise RuntimeError(f"{row} from {checkout} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["streamds"]).resolve().is_relative_to(checkout.resolve()):
        raise RuntimeError(f"{row}: imported {result['streamds']}, not from {checkout}")
    return statistics.median(result["wall"]), statistics.median(result["cpu"])


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5], int(sys.argv[5]), int(sys.argv[6]))
        return 0
    from streamds.units import size_argument

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=size_argument, default=300 * 10**6,
                        help="decoded size of the corpus (default 300MB)")
    parser.add_argument("--record-chars", type=int, default=10_000,
                        help="article characters a record (~2.1x bytes a line)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="runs per process")
    parser.add_argument("--compare", type=Path, metavar="DIR",
                        help="another checkout whose streamds rows run in the same rounds")
    parser.add_argument("--delete-corpus", action="store_true")
    add_write_docs(parser, "parse_bench")
    args = parser.parse_args(argv)
    path, records, decoded = corpus(args.bytes, args.record_chars, seed=0)
    checkouts = {"this checkout": ROOT}
    if args.compare is not None:
        checkouts["--compare"] = args.compare
    runs: list[tuple[str, str]] = [("loop", "this checkout"), ("loop_batches", "this checkout")]
    runs += [(row, name) for row in ("records", "batches") for name in checkouts]
    wall: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    cpu: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    for round_ in range(args.rounds):
        for run in runs:
            row, name = run
            seconds, cpu_seconds = run_child(row, checkouts[name], path, args.repeats, records)
            wall[run].append(seconds)
            cpu[run].append(cpu_seconds)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)

    def over_loop(times: dict[tuple[str, str], list[float]], run: tuple[str, str]) -> float:
        loop = times["loop", "this checkout"]
        return statistics.median(a / b for a, b in zip(loop, times[run], strict=True))

    def table(shown: list[tuple[str, str]], with_code: bool) -> str:
        command = command_line()
        if not with_code and args.compare is not None:  # the docs: the current code's run
            command = command.replace(f" --compare {args.compare}", "")
        lines = ["| reader |" + (" code |" if with_code else "") +
                 " records/s | MB/s | x loop (CPU time) | x loop (wall time) |",
                 "|---|" + ("---|" if with_code else "") + "---:|---:|---:|---:|"]
        for run in shown:
            row, name = run
            median = statistics.median(wall[run])
            code = "-" if row.startswith("loop") else (
                "this checkout" if name == "this checkout" else str(args.compare))
            lines.append(f"| {ROWS[row]} |" + (f" {code} |" if with_code else "") +
                         f" {records / median:,.0f} | {decoded / median / MB:,.0f} | "
                         f"{over_loop(cpu, run):.2f} | {over_loop(wall, run):.2f} |")
        return "\n".join(lines) + (
            f"\n\n{records:,} PubMed-layout records ({decoded / MB:,.0f} MB of JSON lines, "
            f"{decoded / path.stat().st_size:.0f}x compressed) in one seekable `.jsonl.zst`, "
            f"read whole on one core, no DataLoader. Medians of {args.rounds} interleaved "
            f"rounds, each the median of {args.repeats} runs in a fresh process; \"x loop\": "
            "the loop's seconds over the row's, in the same round (CPU time: the process's, "
            "which other programs on a shared machine disturb less than wall time). Machine: "
            f"{machine()}. Command: `{command}`.")

    compared = args.compare is not None  # a column naming the code; the docs get none
    publish("parse_bench", table(runs, compared),
            [{"row": row, "code": str(checkouts[name]), "wall": wall[row, name],
              "cpu": cpu[row, name]} for row, name in runs])
    if args.write_docs:  # the current code only
        replace_section(PERFORMANCE, "parse_bench",
                        table([run for run in runs if run[1] == "this checkout"], False))
    if args.delete_corpus:
        shutil.rmtree(path.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
