"""Even ranks (DESIGN.md guarantee 5): every rank yields as many records, so DDP cannot hang.

First `streamds.balance.quotas` on its own (hypothesis), then datasets over deliberately uneven
shards for 2 and 3 ranks simulated in this process, then real processes: torchrun with gloo on
CPU, each rank syncing after every batch as DDP does, with a subprocess timeout as the hang
detector.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import corpus
import pytest
from hypothesis import given
from hypothesis import strategies as st
from resume_contract import ids
from torch.utils.data import DataLoader

from streamds import StreamingJsonl
from streamds.balance import quotas

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

WORKER = Path(__file__).with_name("ddp_worker.py")
SHARD_SIZES = (3, 50, 7, 120, 1)  # one block each: ranks get very different totals
HANG_TIMEOUT = 120  # seconds; a DDP loop with uneven ranks would wait forever


# -- quotas: a pure function -------------------------------------------------------------------


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[int], int]:
    world_size = draw(st.integers(1, 6))
    num_workers = draw(st.integers(1, 4))
    count = st.one_of(st.integers(0, 3), st.integers(0, 10_000))
    return draw(
        st.lists(count, min_size=world_size * num_workers, max_size=world_size * num_workers)
    ), world_size


def rank_totals(per_reader: list[int], world_size: int) -> list[int]:
    per_rank = len(per_reader) // world_size
    return [sum(per_reader[r * per_rank : (r + 1) * per_rank]) for r in range(world_size)]


@given(worlds())
def test_drop_quotas_are_equal_per_rank_and_never_exceed_counts(world: tuple[list[int], int]):
    counts, world_size = world
    quota = quotas(counts, world_size, "drop")
    assert len(quota) == len(counts)
    assert rank_totals(quota, world_size) == [min(rank_totals(counts, world_size))] * world_size
    assert all(0 <= q <= c for q, c in zip(quota, counts, strict=True))


@given(worlds())
def test_pad_quotas_are_equal_per_rank_and_never_below_counts(world: tuple[list[int], int]):
    counts, world_size = world
    quota = quotas(counts, world_size, "pad")
    assert len(quota) == len(counts)
    assert rank_totals(quota, world_size) == [max(rank_totals(counts, world_size))] * world_size
    assert all(q >= c for q, c in zip(quota, counts, strict=True))


def test_quotas_of_a_known_world() -> None:
    # 2 ranks x 2 workers: rank totals 10 and 4
    assert quotas([7, 3, 4, 0], 2, "drop") == [2, 2, 4, 0]
    assert quotas([7, 3, 4, 0], 2, "pad") == [7, 3, 7, 3]


# -- datasets in one process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[int]]:
    directory = tmp_path_factory.mktemp("even") / "uneven"
    directory.mkdir()
    start = 0
    for shard, size in enumerate(SHARD_SIZES):
        part = [{"id": i, "text": f"record {i}"} for i in range(start, start + size)]
        corpus.write_plain(directory / f"part-{shard}.jsonl", corpus.jsonl(part))
        start += size
    return str(directory), list(range(start))


def per_rank(
    source: str, world_size: int, workers: int, shuffle: bool, mode: str | None, keep=None
) -> list[list[int]]:
    out = []
    for rank in range(world_size):
        dataset = StreamingJsonl(
            source,
            shuffle=shuffle,
            seed=2,
            buffer_size=8,
            rank=rank,
            world_size=world_size,
            even_ranks=mode,
        )
        if keep is not None:
            dataset = dataset.filter(keep)
        loader = DataLoader(dataset, batch_size=8, num_workers=workers, collate_fn=ids)
        out.append([i for batch in loader for i in batch])
    return out


def assert_even(drop: list[list[int]], pad: list[list[int]], every: list[int]) -> None:
    """Drop and pad over the same world: each rank keeps to its own records.

    Even ranks cut a small corpus finer than a plain read does (streamds.plan), so a rank's own
    records are read off the "pad" run: all of them, then repeats of some of them.
    """
    own = [set(rank) for rank in pad]
    assert sorted(i for rank in own for i in rank) == every, "ranks' own records overlap"
    sizes = [len(rank) for rank in own]
    assert len(set(sizes)) > 1, f"the corpus must be uneven for this world: {sizes}"
    assert [len(rank) for rank in drop] == [min(sizes)] * len(drop)
    assert max(Counter(i for rank in drop for i in rank).values()) == 1, "drop repeated a record"
    for mine, theirs in zip(drop, own, strict=True):
        assert set(mine) <= theirs, "drop moved records between ranks"
    assert [len(rank) for rank in pad] == [max(sizes)] * len(pad)


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("world_size", [2, 3])
def test_even_ranks_in_one_process(
    uneven: tuple[str, list[int]], world_size: int, workers: int, shuffle: bool
) -> None:
    source, every = uneven
    natural = per_rank(source, world_size, workers, shuffle, None)
    sizes = [len(rank) for rank in natural]
    assert len(set(sizes)) > 1, f"the corpus must be uneven for this world: {sizes}"
    assert sorted(i for rank in natural for i in rank) == every

    drop = per_rank(source, world_size, workers, shuffle, "drop")
    pad = per_rank(source, world_size, workers, shuffle, "pad")
    assert_even(drop, pad, every)


def even_id(record: dict[str, Any]) -> bool:
    return record["id"] % 2 == 0


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_a_filter_keeps_rank_counts_equal(uneven: tuple[str, list[int]], mode: str) -> None:
    """Quotas count lines before filters (documented); a rank the filter leaves short repeats
    records, so the counts stay equal and DDP cannot hang."""
    source, _ = uneven
    natural = per_rank(source, 2, 0, False, None, keep=even_id)
    assert len(natural[0]) != len(natural[1])  # the filter alone would leave ranks uneven
    even = per_rank(source, 2, 0, False, mode, keep=even_id)
    assert len(even[0]) == len(even[1])
    assert all(i % 2 == 0 for rank in even for i in rank)
    if mode == "pad":
        assert set(i for rank in even for i in rank) == set(i for rank in natural for i in rank)


# -- real processes: torchrun, gloo, an all_reduce after every batch ----------------------------


def torchrun(nproc: int, source: str, out: Path, *, shuffle: bool) -> list[dict[str, Any]]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKER),
        source,
        str(out),
    ]
    if shuffle:
        command.append("--shuffle")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group, so a hang can be ended whole
    )
    try:
        output, _ = process.communicate(timeout=HANG_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun with {nproc} ranks hung (ranks out of step?):\n{output.decode()}")
    assert process.returncode == 0, output.decode()
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.parametrize(("nproc", "shuffle"), [(2, False), (3, True)])
def test_ddp_loop_with_even_ranks_does_not_hang(
    uneven: tuple[str, list[int]], tmp_path: Path, nproc: int, shuffle: bool
) -> None:
    source, every = uneven
    reports = torchrun(nproc, source, tmp_path, shuffle=shuffle)
    assert [report["rank"] for report in reports] == list(range(nproc))
    assert all(report["world_size"] == nproc for report in reports)
    by_mode = {
        mode: [report["modes"][mode] for report in reports] for mode in ("none", "drop", "pad")
    }

    # without even_ranks the same world is uneven: a DDP loop over it would hang
    natural = [rank["ids"] for rank in by_mode["none"]]
    sizes = [len(rank) for rank in natural]
    assert len(set(sizes)) > 1, sizes
    assert sorted(i for rank in natural for i in rank) == every  # ranks found from the group

    drop = [rank["ids"] for rank in by_mode["drop"]]
    pad = [rank["ids"] for rank in by_mode["pad"]]
    assert_even(drop, pad, every)
    for mode in ("drop", "pad"):
        steps = {rank["steps"] for rank in by_mode[mode]}
        assert len(steps) == 1 and steps != {0}, (mode, steps)
