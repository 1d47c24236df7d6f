"""`ds.loader` with large records: CPU seconds per batch handed on at 0 workers, from this
checkout and (``--compare DIR``) another, in interleaved fresh processes.

The loader's large-records route makes whole batches in the dataset; what the loader then
does to a batch is all this measures beyond reading (a conversion that walks every value
of a batch of PubMed articles costs milliseconds a batch).

    .venv/bin/python benchmarks/loader_hand_on.py --compare ../base     # ~1 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, command_line, machine
from parse_bench import corpus

BATCHES = 200


def child(checkout: str, path: str, batch_size: int) -> None:
    sys.path.insert(0, checkout)
    from streamds import StreamingJsonl

    start, count = time.process_time(), 0
    for _ in StreamingJsonl(path).loader(batch_size, num_workers=0, small_records=False):
        count += 1
        if count == BATCHES:
            break
    print(json.dumps({"cpu": (time.process_time() - start) / count}))


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", type=Path, metavar="DIR")
    args = parser.parse_args()
    path, _, _ = corpus(300 * 10**6, 10_000, seed=0)
    checkouts = [ROOT] + ([args.compare] if args.compare else [])
    cpu: dict[Path, list[float]] = {checkout: [] for checkout in checkouts}
    for _ in range(args.rounds):
        for checkout in checkouts:
            done = subprocess.run([sys.executable, __file__, "--child", str(checkout),
                                   str(path), str(args.batch_size)],
                                  capture_output=True, text=True, check=True)
            cpu[checkout].append(json.loads(done.stdout.strip().splitlines()[-1])["cpu"])
    print(f"| code | CPU ms per batch of {args.batch_size} |\n|---|---:|")
    for checkout, times in cpu.items():
        print(f"| {checkout} | {statistics.median(times) * 1000:.2f} |")
    print(f"\nMedians of {args.rounds} interleaved fresh processes, {BATCHES} batches each, "
          f"reading included. Machine: {machine()}. Command: `{command_line()}`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
