"""One rank of a checkpointed epoch over a Parquet folder, for test_parquet_torchrun (run by
torchrun, gloo on CPU).

    python -m torch.distributed.run --standalone --nproc_per_node=N \\
        tests/parquet_ddp_worker.py SOURCE OUT_DIR --stop B [--loader stateful|streamds]
    python -m torch.distributed.run ... SOURCE OUT_DIR --elastic

The rank and world size come from torch.distributed only (RANK and WORLD_SIZE are removed from
the environment once the group is up). Without --elastic, each rank reads `--stop` + rank
batches of one shuffled epoch with 2 DataLoader workers (``StatefulDataLoader`` or
``ds.loader``), takes the loader's state, writes it to OUT_DIR/state-R.pt (a checkpoint on
disk), reads the rest of the epoch (the uninterrupted run), then builds a fresh dataset and
loader, loads the state from disk and reads the rest again (the resumed run). With --elastic,
the states of every rank of the run before are merged (`streamds.merge_states`) and this
world, of another size, finishes the epoch with `with_resume`. Ranks meet at a barrier
between the phases (a rank out of step would hang there: the test's timeout fails that); the
ranks' counts are not evened (test_even_ranks does that). Each rank writes
OUT_DIR/rank-R.json (``{"consumed": [...], "rest": [...], "resumed": [...]}``, batches of
ids) or OUT_DIR/elastic-R.json (``{"rest": [...]}``).
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
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import StreamingJsonl, merge_states

BATCH = 8
WORKERS = 2


def ids(records: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in records]


def dataset(source: str) -> StreamingJsonl:
    return StreamingJsonl(source, shuffle=True, seed=5, buffer_size=32, columns=["id", "text"])


def loader(data: StreamingJsonl, kind: str) -> Any:
    if kind == "streamds":
        return data.loader(BATCH, num_workers=WORKERS, collate=ids)
    return StatefulDataLoader(data, batch_size=BATCH, num_workers=WORKERS, collate_fn=ids)


def checkpointed(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    made = loader(dataset(args.source), args.loader)
    batches = iter(made)
    consumed = [next(batches) for _ in range(args.stop + rank)]
    state_file = args.out / f"state-{rank}.pt"
    torch.save(made.state_dict(), state_file)
    rest = list(batches)
    dist.barrier()
    again = loader(dataset(args.source), args.loader)  # a fresh process's view: from disk
    again.load_state_dict(torch.load(state_file, weights_only=False))
    resumed = list(again)
    return {"consumed": consumed, "rest": rest, "resumed": resumed}


def elastic(args: argparse.Namespace) -> dict[str, Any]:
    states = [torch.load(path, weights_only=False)
              for path in sorted(args.out.glob("state-*.pt"))]
    data = dataset(args.source).with_resume(merge_states(states))
    return {"rest": list(loader(data, "stateful"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source")
    parser.add_argument("out", type=Path)
    parser.add_argument("--stop", type=int, default=3)
    parser.add_argument("--loader", choices=["stateful", "streamds"], default="stateful")
    parser.add_argument("--elastic", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(name, None)  # the world must come from torch.distributed
    rank = dist.get_rank()
    if args.elastic:
        (args.out / f"elastic-{rank}.json").write_text(json.dumps(elastic(args)))
    else:
        (args.out / f"rank-{rank}.json").write_text(json.dumps(checkpointed(args, rank)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
