"""One rank of a DDP-style epoch over StreamingJsonl, for test_even_ranks (run by torchrun).

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/ddp_worker.py \\
        SOURCE OUT_DIR [--shuffle] [--workers W] [--batch B] [--buffer S] \\
        [--modes none drop pad] [--batching loader dataset]

Each rank joins a gloo process group, then for each even_ranks mode and each way of batching
reads one epoch: "loader" batches in the DataLoader (batch_size=B), "dataset" in the reader
(``.batch(B)``, batch_size=None), with W DataLoader workers. Under "drop" and "pad" every
batch is followed by an all_reduce, as a DDP gradient sync would be: a rank with more batches
than another waits there forever (the test's subprocess timeout turns that into a failure).
Under "none" the ranks only count, so the uneven world is shown without hanging. The rank and
world size are never passed to the dataset: RANK and WORLD_SIZE are removed from the
environment after the group is up, so they can only come from torch.distributed. Each rank
writes OUT_DIR/rank-R.json: ``{"rank": R, "world_size": N, "modes": {mode: {batching:
{"ids": [...], "sizes": [batch sizes], "steps": S}}}}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from streamds import StreamingJsonl, detect_world

MODES = {"none": None, "drop": "drop", "pad": "pad"}


def ids(batch: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in batch]


def one_epoch(args: argparse.Namespace, mode: str, batching: str) -> dict[str, Any]:
    dataset = StreamingJsonl(args.source, shuffle=args.shuffle, seed=1, buffer_size=args.buffer,
                             even_ranks=MODES[mode])
    if batching == "dataset":
        loader = DataLoader(dataset.batch(args.batch, collate=ids), batch_size=None,
                            num_workers=args.workers)
    else:
        loader = DataLoader(dataset, batch_size=args.batch, num_workers=args.workers,
                            collate_fn=ids)
    seen: list[int] = []
    sizes: list[int] = []
    steps = 0
    for batch in loader:
        seen.extend(batch)
        sizes.append(len(batch))
        if mode != "none":
            size = torch.tensor([len(batch)], dtype=torch.int64)
            dist.all_reduce(size)  # every rank must reach this as often as every other
            steps += 1
    dist.barrier()
    return {"ids": seen, "sizes": sizes, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--buffer", type=int, default=8)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--batching", nargs="+", choices=["loader", "dataset"],
                        default=["loader"])
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(name, None)  # the world must come from torch.distributed
    rank, world_size = dist.get_rank(), dist.get_world_size()
    detected = detect_world()
    if (detected.rank, detected.world_size) != (rank, world_size):
        raise SystemExit(f"detect_world() gave {detected}, torch.distributed rank {rank}")
    modes = {mode: {batching: one_epoch(args, mode, batching) for batching in args.batching}
             for mode in args.modes}
    report = {"rank": rank, "world_size": world_size, "modes": modes}
    (args.out / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
