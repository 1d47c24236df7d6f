"""Training beside DataLoader workers on 2 CPUs: what torch's intra-op threads in the main
process cost the steps, and what each setting users can reach for gives back.

A training step in the main process (a small transformer encoder built from `torch.nn`, batches
of 16 x 128 tokens, AdamW) fed by the tokenizing pipeline of `tokenize_bench.py`
(`ds.map(tokenize).batch(16, collate=PadCollate(...))`, a WordPiece tokenizer), at 0 and 2
DataLoader workers, with the main process's threads

- as torch sets them (one per CPU; GNU OpenMP's threads wait for work by spinning a while
  after each parallel region),
- `OMP_WAIT_POLICY=PASSIVE` (the waiting threads sleep at once),
- `torch.set_num_threads(1)`.

Each run is a fresh process (the OpenMP runtime reads its settings when torch loads), timed
from the first step to the last; rows are medians of interleaved rounds. "data wait" is the
share of the run spent waiting for the next batch; "cores busy" the process tree's CPU time
over wall time.

    .venv/bin/python benchmarks/threads_bench.py                # ~4 min on 2 cores
    .venv/bin/python benchmarks/threads_bench.py --write-docs   # into docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    add_write_docs,
    child_result,
    command_line,
    machine,
    own_cpu,
    publish,
    pubmed_corpus,
)

SEQ = 128
CLASSES = 1024  # the head predicts token ids modulo this: a step of tens of ms on 2 CPUs
SETTINGS = {
    "threads as torch sets them": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "torch.set_num_threads(1)": {"threads": 1},
}


def train(spec: dict[str, Any]) -> dict[str, float]:
    """Steps of the small model over the corpus in this process: steps, seconds, seconds spent
    waiting for batches, CPU seconds of the process tree."""
    if "OMP_WAIT_POLICY" in spec["setting"]:  # before torch loads its OpenMP runtime
        os.environ["OMP_WAIT_POLICY"] = spec["setting"]["OMP_WAIT_POLICY"]
    import torch
    from tokenize_bench import BATCH, Tokenize
    from torch import nn
    from torch.utils.data import DataLoader

    from streamds import PadCollate, StreamingJsonl, as_list

    if "threads" in spec["setting"]:
        torch.set_num_threads(spec["setting"]["threads"])
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, batch_first=True)
    model = nn.Sequential(nn.Embedding(8000, 64), nn.TransformerEncoder(layer, 2),
                          nn.Linear(64, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ds = StreamingJsonl(spec["path"]).map(Tokenize(Path(spec["tokenizer"])))
    ds = ds.batch(BATCH, collate=PadCollate(0, keys=("input_ids",)))
    loader = DataLoader(ds, batch_size=None, num_workers=spec["workers"], collate_fn=as_list)
    steps, waited = 0, 0.0
    batches = iter(loader)
    first = next(batches)  # the start-up is not what is compared
    cpu, start = own_cpu(), time.perf_counter()
    batch = first
    while True:
        ids = batch["input_ids"][:, :SEQ]
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten() % CLASSES)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        asked = time.perf_counter()
        batch = next(batches, None)
        waited += time.perf_counter() - asked
        if batch is None or steps == spec["steps"]:
            break
    wall = time.perf_counter() - start
    return {"steps": steps, "wall": wall, "waited": waited, "cpu": own_cpu() - cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=20, help="corpus size in MB")
    parser.add_argument("--steps", type=int, default=300, help="steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_write_docs(parser, "threads")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(train(json.loads(args.child))))
        return 0
    from tokenize_bench import train_tokenizer

    corpus = pubmed_corpus(args.mb * 10**6, record_chars=3000)
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_tokenizer(corpus.plain, Path(tmp))
        cases = [(name, workers) for workers in (0, 2) for name in SETTINGS]
        for round_ in range(args.rounds):
            for name, workers in cases if round_ % 2 == 0 else cases[::-1]:
                spec = {"path": str(corpus.plain), "tokenizer": str(tokenizer),
                        "workers": workers, "setting": SETTINGS[name], "steps": args.steps}
                run = child_result([__file__, "--child"], spec, what=f"{name}, {workers} workers")
                runs.setdefault((name, workers), []).append(run)
                print(f"round {round_ + 1}: {name}, {workers} workers: "
                      f"{run['steps'] / run['wall']:.2f} steps/s", flush=True)

    def per_second(name: str, workers: int, what: str) -> float:
        return statistics.median(r[what] / r["wall"] for r in runs[name, workers])

    base = per_second(next(iter(SETTINGS)), 0, "steps")
    lines = ["| main process threads | workers | steps/s | x first row | data wait | cores busy |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, workers in cases:
        rate = per_second(name, workers, "steps")
        lines.append(f"| {name} | {workers} | {rate:.2f} | {rate / base:.2f} | "
                     f"{per_second(name, workers, 'waited'):.0%} | "
                     f"{per_second(name, workers, 'cpu'):.2f} |")
    body = ("\n".join(lines) + f"\n\n{args.steps} steps per run after the first batch, a small "
            f"transformer encoder (2 layers, width 64, {SEQ} tokens) fed by "
            f"`ds.map(tokenize).batch(16, collate=PadCollate(...))` over "
            f"{corpus.records:,} PubMed-layout records; medians of {args.rounds} interleaved "
            f"rounds, each run a fresh process. Machine: {machine()}. Command: "
            f"`{command_line()}`.")
    publish("threads_bench", body, {f"{n} {w}": r for (n, w), r in runs.items()},
            "threads" if args.write_docs else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
