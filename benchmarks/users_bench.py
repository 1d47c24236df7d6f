"""The users' configuration against the easy one: do two workers pay where users train?

The users' configuration (Colab-like): seekable shards through a FUSE mount that adds
--latency seconds to every request (`testbed.slowfs`, a fresh mount per run), shuffle=True
with buffer_size=10,000, a tokenizing `.map` (a WordPiece `tokenizers` model trained locally on
the corpus, truncating at 512 tokens), batches of 16 padded int64 tensors (`PadCollate`), a
checkpoint's `state_dict()` every 50 batches, 2 workers, built three ways:

- framework: ``StatefulDataLoader(ds, batch_size=16, collate_fn=pad, num_workers=2)``, as
  Trainer, accelerate and Lightning users build it;
- batch: ``StatefulDataLoader(ds.batch(16, collate=pad), batch_size=None, num_workers=2)``;
- loader: ``ds.loader(16, num_workers=2, collate=pad)``, the one call.

The easy configuration: the same shards on local disk, ``DataLoader(ds, batch_size=16,
collate_fn=pad)``, no workers, no shuffle, no state: the tokenizer runs in the main process.

Each run is a fresh process that reads one whole epoch, timed from building the loader to
its last batch (the first batch's wait included, and reported on its own); rows interleaved
in every round (each round starts at another row), medians of --rounds; every run checks
that it saw each record exactly once.

    .venv/bin/python benchmarks/users_bench.py           # ~300 MB, 3 rounds: ~6 min on 2 cores
    .venv/bin/python benchmarks/users_bench.py --quick   # ~40 MB, 1 round
    .venv/bin/python benchmarks/users_bench.py --write-docs  # the docs' performance page
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import add_write_docs, child_result, command_line, machine, publish, pubmed_corpus

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("easy", "framework", "batch", "loader")
BATCH = 16
BUFFER = 10_000
STATE_EVERY = 50

CHILD = r"""
import gc, json, os, sys, time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, "benchmarks")
spec = json.loads(sys.argv[1])
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from streamds import PadCollate, StreamingJsonl
from tokenize_bench import Tokenize

gc.freeze()
tokenize, pad = Tokenize(spec["tokenizer"]), PadCollate(pad_id=0, keys=("input_ids",))
start = time.perf_counter()
row = spec["row"]
if row == "easy":
    ds = StreamingJsonl(spec["path"]).map(tokenize)
    batches = DataLoader(ds, batch_size=16, collate_fn=pad)
else:
    ds = StreamingJsonl(spec["path"], shuffle=True, buffer_size=spec["buffer"]).map(tokenize)
    if row == "framework":
        batches = StatefulDataLoader(ds, batch_size=16, collate_fn=pad, num_workers=2)
    elif row == "batch":
        batches = StatefulDataLoader(ds.batch(16, collate=pad), batch_size=None, num_workers=2)
    else:
        batches = ds.loader(16, num_workers=2, collate=pad)
first = None
records = 0
for n, batch in enumerate(batches, 1):
    if first is None:
        first = time.perf_counter() - start
    records += batch["input_ids"].shape[0]
    if row != "easy" and n % spec["state_every"] == 0:
        batches.state_dict()
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "first": first, "records": records}))
"""


def run(row: str, corpus_dir: Path, tokenizer: Path, latency: float, buffer: int) -> dict:
    from testbed.slowfs import mount

    spec = {"row": row, "tokenizer": str(tokenizer), "buffer": buffer,
            "state_every": STATE_EVERY}
    if row == "easy":
        return child_result(["-c", CHILD], {**spec, "path": str(corpus_dir)}, what=row)
    with tempfile.TemporaryDirectory() as tmp, mount(
            corpus_dir, Path(tmp) / "mnt", latency=latency) as mounted:
        return child_result(["-c", CHILD], {**spec, "path": str(mounted)}, what=row)


def table(results: dict[str, list[dict]], records: int) -> str:
    easy = statistics.median(r["seconds"] for r in results["easy"])
    lines = ["| configuration | records/s (median) | / easy | first batch (s) | runs |",
             "|---|---:|---:|---:|---:|"]
    for row in ROWS:
        seconds = statistics.median(r["seconds"] for r in results[row])
        first = statistics.median(r["first"] for r in results[row])
        lines.append(f"| {row} | {records / seconds:,.0f} | {easy / seconds:.2f} | "
                     f"{first:.1f} | {len(results[row])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, help="corpus size in MB (300; quick 40)")
    parser.add_argument("--rounds", type=int, help="runs per row (median); 3, quick 1")
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--buffer", type=int, default=BUFFER)
    parser.add_argument("--quick", action="store_true")
    add_write_docs(parser, "users")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tokenize_bench import train_tokenizer

    corpus = pubmed_corpus((args.mb or (40 if args.quick else 300)) * 10**6)
    rounds = args.rounds or (1 if args.quick else 3)
    results: dict[str, list[dict]] = {row: [] for row in ROWS}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_tokenizer(corpus.plain, Path(tmp))
        for round_ in range(rounds):
            for row in ROWS[round_ % len(ROWS):] + ROWS[: round_ % len(ROWS)]:
                result = run(row, corpus.zst.parent, tokenizer, args.latency, args.buffer)
                if result["records"] != corpus.records:
                    raise RuntimeError(f"{row}: {result['records']} records, not "
                                       f"{corpus.records}")
                results[row].append(result)
                print(f"round {round_ + 1}, {row}: {result['seconds']:.1f} s "
                      f"(first batch {result['first']:.1f} s)", file=sys.stderr)
    body = (
        f"{table(results, corpus.records)}\n\n"
        f"Machine: {machine()}. Command: `{command_line()}`. {corpus.records:,} PubMed-layout "
        f"records ({corpus.decoded_bytes / 1e6:,.0f} MB) in a seekable .jsonl.zst; users' rows "
        f"through a FUSE mount adding {args.latency * 1000:.0f} ms a request, shuffle buffer "
        f"{args.buffer:,}, state_dict() every {STATE_EVERY} batches, 2 workers; whole epochs "
        "timed from building the loader, medians of the rounds, rows interleaved."
    )
    publish("users_bench", body, results, "users" if args.write_docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
