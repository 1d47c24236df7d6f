"""`ds.cache` on the tokenizing pipeline (issue 29, item 6): records/s and peak memory of

- no cache: every epoch reads, parses and tokenizes (`ds.map(tokenize)`);
- the cache's first epoch (reads, tokenizes and stores every block) and a later one (reads
  the stored records back: nothing read from the source, parsed or tokenized);
- pre-tokenized shards written by ``streamds convert --transform`` (the ceiling: the same
  records, read and parsed, nothing tokenized),

all with ``shuffle=True`` over the same PubMed-layout corpus (seekable zstd with a manifest,
as the converter writes it) and the same WordPiece tokenizer (`tokenize_bench`, trained
locally on a sample of the corpus). Each measurement runs in a fresh process, so that its
peak memory (the process's and its DataLoader workers' maximum resident set) is its own.

    python benchmarks/cache_bench.py                  # ~32 MB of records, a minute or two
    python benchmarks/cache_bench.py --mb 200 --workers 2 --rounds 3

Prints a table (medians over `--rounds`); the issue asks for epoch 2 >= 5x epoch 1 and within
0.8 of the pre-tokenized shards.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_write_docs, command_line, machine, publish, pubmed_corpus

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BATCH = 64  # records per batch out of the workers (with --workers)
KINDS = ("no cache", "cache: epoch 1 (fills)", "cache: epoch 2 (stored)", "pre-tokenized")


def measure(kind: str, source: str, tokenizer: str, cache: str, workers: int,
            buffer_size: int, epoch: int) -> dict[str, Any]:
    """One epoch of `kind`, in this process: records, seconds, peak resident MB."""
    from tokenize_bench import Tokenize
    from torch.utils.data import DataLoader

    from streamds import StreamingJsonl, as_list

    ds = StreamingJsonl(source, shuffle=True, buffer_size=buffer_size, seed=0)
    if kind != "pre-tokenized":
        ds = ds.map(Tokenize(tokenizer))
    if kind.startswith("cache"):
        ds = ds.cache(cache, key="wordpiece-8000")
    ds.set_epoch(epoch)
    start = time.perf_counter()
    records, first, at_first = 0, None, 0
    batches = ds.batch(BATCH) if workers == 0 else DataLoader(
        ds.batch(BATCH), batch_size=None, num_workers=workers, collate_fn=as_list)
    for batch in batches:
        records += len(batch)
        if first is None:  # the steady rate counts from here (no start-up, no first fill)
            first, at_first = time.perf_counter() - start, records
    seconds = time.perf_counter() - start
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    steady = (records - at_first) / max(seconds - (first or 0.0), 1e-9)
    return {"records": records, "seconds": seconds, "first_s": first, "steady": steady,
            "peak_mb": peak}


def run(kind: str, args: argparse.Namespace, source: str, tokenizer: str, cache: str,
        epoch: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--measure", kind, "--source", source,
               "--tokenizer", tokenizer, "--cache", cache, "--workers", str(args.workers),
               "--buffer-size", str(args.buffer_size), "--epoch", str(epoch)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def pretokenize(plain: Path, tokenizer: str, out: Path) -> Path:
    """The corpus through ``streamds convert --transform`` (seekable zstd shards)."""
    if not (out / "manifest.json").exists():
        spec = f"tokenize_bench:Tokenize({tokenizer!r})"
        subprocess.run([sys.executable, "-m", "streamds.tools.cli", "convert", str(plain),
                        "--output", str(out), "--transform", spec, "--quiet"],
                       check=True, cwd=Path(__file__).parent)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=32, help="corpus size (decoded MB)")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--buffer-size", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=1)
    add_write_docs(parser, "cache")
    parser.add_argument("--measure", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--epoch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.source, args.tokenizer, args.cache,
                                 args.workers, args.buffer_size, args.epoch)))
        return

    from tokenize_bench import train_tokenizer

    corpus = pubmed_corpus(int(args.mb * 1e6))
    work = Path(tempfile.mkdtemp(prefix="cache-bench-"))
    try:
        tokenizer = str(train_tokenizer(corpus.plain, work))
        pretokenized = str(pretokenize(corpus.plain, tokenizer, work / "pretokenized"))
        source = str(corpus.zst.parent)
        results: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
        for round_ in range(args.rounds):
            cache = str(work / f"cache-{round_}")
            results["no cache"].append(run("no cache", args, source, tokenizer, cache, 0))
            results[KINDS[1]].append(run("cache: epoch 1 (fills)", args, source, tokenizer,
                                         cache, 0))
            results[KINDS[2]].append(run("cache: epoch 2 (stored)", args, source, tokenizer,
                                         cache, 1))
            results["pre-tokenized"].append(run("pre-tokenized", args, pretokenized,
                                                tokenizer, cache, 0))
            shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    counts = {r["records"] for runs in results.values() for r in runs}
    assert len(counts) == 1, f"the pipelines yielded different record counts: {counts}"
    rate = {kind: statistics.median(r["records"] / r["seconds"] for r in runs)
            for kind, runs in results.items()}
    steady = {kind: statistics.median(r["steady"] for r in runs)
              for kind, runs in results.items()}
    lines = ["| pipeline | records/s (epoch) | vs epoch 1 | vs pre-tokenized | records/s after "
             "the first batch | vs pre-tokenized | peak MB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for kind in KINDS:
        peak = statistics.median(r["peak_mb"] for r in results[kind])
        lines.append(f"| {kind} | {rate[kind]:,.0f} | {rate[kind] / rate[KINDS[1]]:.2f}x | "
                     f"{rate[kind] / rate['pre-tokenized']:.2f} | {steady[kind]:,.0f} | "
                     f"{steady[kind] / steady['pre-tokenized']:.2f} | {peak:,.0f} |")
    body = "\n".join(lines) + (
        f"\n\nMachine: {machine()}. Command: `{command_line()}`. {corpus.records:,} "
        f"PubMed-layout records ({args.mb:g} MB) in a seekable .jsonl.zst, shuffle=True, "
        f"buffer_size={args.buffer_size}, batches of {BATCH}, {args.workers} workers, one "
        f"epoch per fresh process (worker start-up included in records/s (epoch); the "
        f"second rate counts from the first batch on), medians of {args.rounds} round(s). "
        "Peak MB: the largest resident set of the process or one of its workers.")
    publish("cache_bench", body, results, "cache" if args.write_docs else None)


if __name__ == "__main__":
    main()
