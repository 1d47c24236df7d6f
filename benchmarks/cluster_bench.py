"""Conversion in parts: in-process, on a 2-process pool and on a 2-worker Dask cluster.

The inputs of ``convert_bench.py`` (generated once under bench-data/): one 1 GB JSONL of
~21 KB PubMed-layout lines and 50,000 small ``.json`` files (``--scale`` shrinks both).
Each is converted (default options, ``--parts`` parts, 8 by default) by:

- ``in-process, 1 part``: the plain conversion, as before parts existed;
- ``in-process``: the same parts, one after another in this process (executor None);
- ``process pool``: ``ProcessPoolExecutor(2)`` (spawn), started before the timing;
- ``Dask``: ``distributed.LocalCluster(n_workers=2, threads_per_worker=1)`` on loopback,
  started before the timing, through ``Client.get_executor()``.

MB/s is stored input bytes (10^6) per wall second; CPU is the CPU seconds of this process
and every process under it (pool and Dask workers, the scheduler) over the run; "per core"
is MB per CPU second, set against the ``zstd -3 -T1`` command compressing the same bytes
(the big file; the tree's files concatenated). Two ``zstd -3 -T1`` at once on the big file
say what two processes can get from the machine, and a cProfile of one conversion (of the
first 200 MB of the big file) says where its CPU goes. The outputs of the three parted rows
must be byte-identical (checked). Medians of
``--repeats`` runs, page cache warm; before each run the script waits for an idle machine
(up to ``--quiet-wait`` seconds) and reports the cores other programs used.

    python benchmarks/cluster_bench.py                 # full size, a few minutes on 2 cores
    python benchmarks/cluster_bench.py --scale 0.2     # a quick look
    python benchmarks/cluster_bench.py --write-docs  # also fill docs/performance.md's section
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
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
from convert_bench import (
    _OTHERS,
    BIG_BYTES_AT_SCALE_1,
    FILES_AT_SCALE_1,
    Quiet,
    big_jsonl,
    concatenate,
    log,
    median_seconds,
    small_tree,
    time_zstd,
    tree_files,
)

SECTION = "cluster"
STEP_BYTES = 200 * 10**6  # bytes of the big file converted under cProfile


def tree_cpu() -> float:
    """CPU seconds of this process and all processes under it, alive now."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


@dataclass(frozen=True)
class Row:
    input: str
    executor: str
    parts: int
    stored: int
    seconds: float
    cpu: float


@contextmanager
def executors() -> Iterator[dict[str, Executor | None]]:
    """The executors, started and warmed up (each worker has imported the converter)."""
    import distributed

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=context) as pool, distributed.LocalCluster(
        n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
        host="127.0.0.1",
    ) as cluster, distributed.Client(cluster) as client:
        dask = client.get_executor()
        for executor in (pool, dask):
            list(executor.map(_warm, range(4)))
        yield {"in-process": None, "process pool (2)": pool, "Dask, 2 workers": dask}


def _warm(_: int) -> None:
    import streamds.preprocess.parts  # noqa: F401


def output_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and not any(s.startswith(".") for s in p.relative_to(directory).parts)}


STEPS = {"compression (python-zstandard)": "'compress' of 'zstandard",
         "parsing (orjson)": "orjson.loads", "serialising (orjson)": "orjson.dumps"}


def step_shares(path: Path, scratch: Path) -> tuple[float, dict[str, float]]:
    """(MB, CPU seconds per step) of one in-process conversion of the first STEP_BYTES of
    `path` under cProfile; "the rest" is everything else (reading, splitting lines, the
    loop, hashing, writing)."""
    import cProfile
    import pstats

    from streamds.preprocess.convert import convert

    with open(path, "rb") as f:
        data = f.read(STEP_BYTES)
    prefix = scratch / "prefix.jsonl"
    prefix.write_bytes(data[: data.rfind(b"\n") + 1])
    profiler = cProfile.Profile()
    profiler.enable()
    convert([prefix], scratch / "steps-out")
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    seconds = dict.fromkeys(STEPS, 0.0)
    total = 0.0
    for (_file, _line, name), (_cc, _nc, own, _cum, _callers) in stats.items():
        total += own
        for step, pattern in STEPS.items():
            if pattern in name:
                seconds[step] += own
    seconds["the rest"] = total - sum(seconds.values())
    size = prefix.stat().st_size / MB
    prefix.unlink()
    shutil.rmtree(scratch / "steps-out")
    return size, seconds


def zstd_pair_speedup(path: Path, repeats: int) -> float:
    """Throughput of two `zstd -3 -T1` processes at once on `path` over one alone: what two
    processes can get from this machine."""
    zstd = shutil.which("zstd")
    assert zstd is not None
    command = [zstd, "-3", "-T1", "-q", "-c", str(path)]

    def run(count: int) -> None:
        procs = [subprocess.Popen(command, stdout=subprocess.DEVNULL) for _ in range(count)]
        if any(proc.wait() for proc in procs):
            raise SystemExit(f"{command} failed")

    one = median_seconds(lambda: run(1), repeats)[0]
    two = median_seconds(lambda: run(2), repeats)[0]
    return 2 * one / two


def report(rows: list[Row], zstd: dict[str, float], shares: tuple[float, dict[str, float]],
           pair: float, args) -> str:
    size, steps = shares
    big = rows[0].input
    both = size / (steps["compression (python-zstandard)"] + steps["parsing (orjson)"])
    others = statistics.median(_OTHERS) if _OTHERS else 0.0
    lines = [
        f"Machine: {machine()}; other processes used a median {others:.2f} cores during the "
        "timed runs.",
        f"Command: `{command_line()}` (medians of {args.repeats} runs, warm page cache; the "
        "pool and the cluster started before the timing). Outputs of the three parted rows "
        "byte-identical (checked).",
        "",
        "| input | executor | parts | time | MB/s | vs in-process | CPU | MB per CPU s "
        "| vs `zstd -3 -T1` per core |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {row.input: row.seconds for row in rows
            if row.executor == "in-process" and row.parts == args.parts}
    for row in rows:
        per_core = row.stored / row.cpu / MB
        lines.append(
            f"| {row.input} | {row.executor} | {row.parts} | {row.seconds:.2f} s "
            f"| {row.stored / row.seconds / MB:,.0f} | {base[row.input] / row.seconds:.2f}x "
            f"| {row.cpu:.2f} s | {per_core:,.0f} | {per_core / zstd[row.input]:.2f} |"
        )
    lines += [
        "",
        "`zstd -3 -T1` on the same bytes, MB per CPU s: "
        + "; ".join(f"{name}: {speed:,.0f}" for name, speed in zstd.items()) + ". Two "
        f"`zstd -3 -T1` at once on the big file: {pair:.2f}x the throughput of one (the most "
        "two processes get from this machine).",
        "",
        f"Where one process's CPU goes (cProfile of converting the first {size:,.0f} MB of "
        "the big file): " + "; ".join(f"{step} {cpu / sum(steps.values()):.0%}"
                                      for step, cpu in steps.items())
        + ". Parsing and compressing alone would run at "
        f"{both:,.0f} MB per CPU s, {both / zstd[big]:.2f} of `zstd -3 -T1`.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="fraction of 50,000 files and 1 GB (default 1)")
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=20.0,
                        help="max seconds to wait for an idle machine before each run")
    add_write_docs(parser, "cluster")
    args = parser.parse_args(argv)
    Quiet.max_wait = args.quiet_wait
    from streamds.preprocess.convert import convert

    files = max(100, round(FILES_AT_SCALE_1 * args.scale))
    big_bytes = max(10**6, round(BIG_BYTES_AT_SCALE_1 * args.scale / 10**6) * 10**6)
    tree, big = small_tree(files), big_jsonl(big_bytes)
    rows: list[Row] = []
    zstd: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="cluster-bench-", dir=DATA_DIR) as name:
        scratch = Path(name)
        paths = tree_files(tree)
        concatenated = scratch / "tree.jsonl"
        concatenate(paths, concatenated)
        inputs = {f"one {big_bytes // 10**6:,} MB JSONL": (big, big.stat().st_size),
                  f"{files:,} small .json files": (tree, sum(p.stat().st_size for p in paths))}
        log("zstd -3 -T1 on the same bytes")
        for label, same in zip(inputs, (big, concatenated), strict=True):
            timed = time_zstd(same, args.repeats)
            if timed is None:
                raise SystemExit("the zstd command is not installed")
            zstd[label] = inputs[label][1] / timed[1] / MB
        concatenated.unlink()
        pair = zstd_pair_speedup(big, args.repeats)
        shares = step_shares(big, scratch)
        with executors() as pool:
            for label, (source, stored) in inputs.items():
                runs = [("in-process", None, 1)] + [(name, ex, args.parts)
                                                    for name, ex in pool.items()]
                outputs = []
                for executor_name, executor, parts in runs:
                    out = scratch / f"out-{len(rows)}"

                    def run(out: Path = out, executor: Executor | None = executor,
                            parts: int = parts, source: Path = source) -> None:
                        shutil.rmtree(out, ignore_errors=True)
                        convert([source], out, parts=parts, executor=executor)

                    seconds, cpu = median_seconds(run, args.repeats, tree_cpu)
                    log(f"  {label}, {executor_name}, {parts} parts: {seconds:.2f} s, "
                        f"CPU {cpu:.2f} s")
                    rows.append(Row(label, executor_name, parts, stored, seconds, cpu))
                    if parts == args.parts:
                        outputs.append(output_files(out))
                    shutil.rmtree(out)
                if any(output != outputs[0] for output in outputs[1:]):
                    raise SystemExit(f"{label}: the executors wrote different bytes")
    text = report(rows, zstd, shares, pair, args)
    print(text)
    if args.write_docs:
        replace_section(PERFORMANCE, SECTION, text)
        log(f"updated {PERFORMANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
