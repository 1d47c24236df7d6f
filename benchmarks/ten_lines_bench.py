"""The README's ten-line example, timed: ``StreamingJsonl(shuffle=True, buffer_size=10_000)
.map(to_pair).batch(16)`` through ``DataLoader(batch_size=None, num_workers=w)`` at 0, 2 and 4
workers, and the same without the map, each run a fresh process (``gc.freeze()`` after its
imports), timed from the first batch to the last, medians of interleaved rounds.

The corpus is the workers benchmark's PubMed corpus (--scale 0.5: ~21 KB lines) read as a
folder of 6 copies of its shard (~150,000 records, runs of a few seconds).

    .venv/bin/python benchmarks/ten_lines_bench.py      # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import child_result, command_line, machine, publish, pubmed_corpus  # noqa: E402
from workers_bench import copied  # noqa: E402

CHILD = r"""
import gc, json, sys, time
from torch.utils.data import DataLoader
from streamds import StreamingJsonl

def to_pair(r):   # the README's
    return {"text": " ".join(r["article_text"]), "summary": r["abstract_text"]}

spec = json.loads(sys.argv[1])
ds = StreamingJsonl(spec["path"], shuffle=True, seed=0, buffer_size=10_000)
if spec["map"]:
    ds = ds.map(to_pair)
ds = ds.batch(16)
gc.freeze()
batches = iter(DataLoader(ds, batch_size=None, num_workers=spec["workers"]))
first = len(next(batches))
start = time.perf_counter()
records = sum(len(batch) for batch in batches)
print(json.dumps({"first": first, "records": records,
                  "seconds": time.perf_counter() - start}))
"""
ROWS = [(label, workers, mapped) for mapped, label in ((True, ".map(to_pair).batch(16)"),
                                                       (False, ".batch(16), no map"))
        for workers in (0, 2, 4)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=0.5)
    args = parser.parse_args(argv)
    corpus = pubmed_corpus(round(1e9 * args.scale))
    folder, copies = str(copied(corpus.zst, 6)), 6
    rates: dict[tuple[str, int], list[float]] = {}
    for repeat in range(args.repeats):
        turn = repeat % len(ROWS)
        for label, workers, mapped in ROWS[turn:] + ROWS[:turn]:
            result = child_result(["-c", CHILD], {"path": folder, "workers": workers,
                                                  "map": mapped}, what=f"{label}, {workers}")
            if result["first"] + result["records"] != corpus.records * copies:
                raise RuntimeError(f"{label}, {workers} workers: not every record once")
            rates.setdefault((label, workers), []).append(result["records"]
                                                          / result["seconds"])
    lines = ["| pipeline | 0 workers, records/s | 2 workers | 4 workers |", "|---|---:|---:|---:|"]
    for label in dict.fromkeys(label for label, *_ in ROWS):
        alone = statistics.median(rates[label, 0])
        cells = [f"{alone:,.0f}"] + [
            f"{statistics.median(rates[label, w]):,.0f} "
            f"({statistics.median(rates[label, w]) / alone:.2f}x)" for w in (2, 4)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    body = "\n".join(lines) + (
        f"\n\nShuffled (buffer 10,000), {corpus.records * copies:,} PubMed records a run, "
        f"medians of {args.repeats} interleaved rounds. Machine: {machine()}. "
        f"Command: `{command_line()}`.")
    publish("ten_lines_bench", body, [{"pipeline": label, "workers": workers, "rates": r}
                                      for (label, workers), r in rates.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
