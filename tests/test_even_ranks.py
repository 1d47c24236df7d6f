"""Even ranks (DESIGN.md guarantee 5): every rank yields as many records, so DDP cannot hang.

First `streamds.stages.balance.quotas` on its own (hypothesis), then datasets over deliberately
uneven shards for 2 and 3 ranks simulated in this process, then real processes: torchrun with
gloo on CPU, each rank syncing after every batch as DDP does, with a subprocess timeout as the hang
detector.
"""

from __future__ import annotations

import json
import logging
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
from streamds.stages.balance import quotas
from streamds.world import World

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


def per_worker(per_reader: list[int], world_size: int) -> list[list[int]]:
    per_rank = len(per_reader) // world_size
    return [per_reader[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]


@given(worlds())
def test_drop_quotas_give_every_rank_one_worker_vector_and_never_exceed_counts(
    world: tuple[list[int], int]
) -> None:
    counts, world_size = world
    quota = quotas(counts, world_size, "drop")
    assert len(quota) == len(counts)
    vectors = per_worker(quota, world_size)
    assert all(vector == vectors[0] for vector in vectors)  # the same batches on every rank
    assert all(0 <= q <= c for q, c in zip(quota, counts, strict=True))  # never a repeat
    # the fewest dropped under that rule: each worker index keeps the least any rank has
    assert vectors[0] == [min(column) for column in zip(*per_worker(counts, world_size),
                                                        strict=True)]


@given(worlds())
def test_pad_quotas_give_every_rank_one_worker_vector_and_never_go_below_counts(
    world: tuple[list[int], int]
) -> None:
    counts, world_size = world
    quota = quotas(counts, world_size, "pad")
    assert len(quota) == len(counts)
    vectors = per_worker(quota, world_size)
    assert all(vector == vectors[0] for vector in vectors)
    assert all(q >= c for q, c in zip(quota, counts, strict=True))  # never a record dropped
    assert vectors[0] == [max(column) for column in zip(*per_worker(counts, world_size),
                                                        strict=True)]


def test_quotas_of_a_known_world() -> None:
    # 2 ranks x 2 workers: (7, 3) and (4, 0); even rank totals alone, e.g. (2, 2) and (4, 0),
    # would give rank 0 two batches of 2 and rank 1 one batch of 4
    assert quotas([7, 3, 4, 0], 2, "drop") == [4, 0, 4, 0]
    assert quotas([7, 3, 4, 0], 2, "pad") == [7, 3, 7, 3]
    assert quotas([5, 9], 2, "drop") == [5, 5]  # no workers: one reader per rank


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


def assert_even(
    drop: list[list[int]], pad: list[list[int]], every: list[int], *, one_reader: bool = True
) -> None:
    """Drop and pad over the same world: each rank keeps to its own records.

    Even ranks cut a small corpus finer than a plain read does (streamds.storage.plan), so a rank's
    own records are read off the "pad" run: all of them, then repeats of some of them.
    """
    own = [set(rank) for rank in pad]
    assert sorted(i for rank in own for i in rank) == every, "ranks' own records overlap"
    sizes = [len(rank) for rank in own]
    assert len(set(sizes)) > 1, f"the corpus must be uneven for this world: {sizes}"
    # one reader per rank: the rank totals are evened; with workers each worker index is,
    # which may drop or repeat a few more
    kept, padded = [len(rank) for rank in drop], [len(rank) for rank in pad]
    assert len(set(kept)) == 1 and len(set(padded)) == 1, (kept, padded)
    assert kept[0] == min(sizes) if one_reader else kept[0] <= min(sizes)
    assert padded[0] == max(sizes) if one_reader else padded[0] >= max(sizes)
    assert max(Counter(i for rank in drop for i in rank).values()) == 1, "drop repeated a record"
    for mine, theirs in zip(drop, own, strict=True):
        assert set(mine) <= theirs, "drop moved records between ranks"


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
    assert_even(drop, pad, every, one_reader=workers <= 1)


def even_id(record: dict[str, Any]) -> bool:
    return record["id"] % 2 == 0


def test_a_filter_keeps_rank_counts_equal_under_pad(uneven: tuple[str, list[int]]) -> None:
    """Quotas count lines before filters (documented); under "pad" a rank the filter leaves
    short repeats records, so the counts stay equal and DDP cannot hang."""
    source, _ = uneven
    natural = per_rank(source, 2, 0, False, None, keep=even_id)
    assert len(natural[0]) != len(natural[1])  # the filter alone would leave ranks uneven
    even = per_rank(source, 2, 0, False, "pad", keep=even_id)
    assert len(even[0]) == len(even[1])
    assert all(i % 2 == 0 for rank in even for i in rank)
    assert set(i for rank in even for i in rank) == set(i for rank in natural for i in rank)


def test_a_filter_under_drop_is_refused_naming_the_fix(uneven: tuple[str, list[int]]) -> None:
    """"drop" never repeats a record, and a filter would make its ranks repeat most of theirs
    (2 ranks with a filter keeping half read nearly every record twice)."""
    source, _ = uneven
    dataset = StreamingJsonl(source, rank=0, world_size=2, even_ranks="drop")
    with pytest.raises(ValueError, match=r"filter\(\) under even_ranks='drop'.*streamds convert "
                                         r"--transform.*even_ranks='pad'"):
        dataset.filter(even_id)


def none_for_odd(record: dict[str, Any]) -> dict[str, Any] | None:
    return record if record["id"] % 2 == 0 else None


def test_a_map_that_drops_under_drop_says_it_repeats(
    uneven: tuple[str, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """A map returning None cannot be refused in advance: the repeats it forces are logged."""
    source, _ = uneven
    caplog.set_level(logging.WARNING, logger="streamds.stages.balance")
    got = []
    for rank in range(2):
        dataset = StreamingJsonl(source, rank=rank, world_size=2, even_ranks="drop")
        got.append([record["id"] for record in dataset.map(none_for_odd)])
    assert len(got[0]) == len(got[1])
    repeated = sum(len(ids) - len(set(ids)) for ids in got)
    assert repeated
    said = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    assert said and "repeats" in said[0]
    shorts = [int(m.split("ran out ")[1].split(" short")[0]) for m in said]
    assert sum(shorts) == repeated


# -- real processes: torchrun, gloo, an all_reduce after every batch ----------------------------


def torchrun(
    nproc: int, source: str, out: Path, *, shuffle: bool, options: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKER),
        source,
        str(out),
        *options,
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
        mode: [report["modes"][mode]["loader"] for report in reports]
        for mode in ("none", "drop", "pad")
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


@pytest.fixture(scope="module")
def two_workers_per_rank(
    issue_corpus: tuple[str, int], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """The ranks' reports of one torchrun (2 ranks x 2 DataLoader workers, batches of 16)
    that runs both modes, one after the other: one launch, asserted per mode below."""
    source, _ = issue_corpus
    return torchrun(2, source, tmp_path_factory.mktemp("two-workers"), shuffle=True, options=(
        "--workers", "2", "--batch", "16", "--buffer", "256", "--modes", "drop", "pad",
        "--batching", "loader", "dataset"))


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_ddp_with_two_workers_per_rank_makes_equal_batches(
    issue_corpus: tuple[str, int], two_workers_per_rank: list[dict[str, Any]], mode: str
) -> None:
    """Issue 26: torchrun, 2 ranks x 2 DataLoader workers, batches of 16 made by the loader
    and by ``.batch(16)``: an all_reduce after every batch finishes (was a hang: 63 batches
    on one rank, 64 on the other), and both ranks see the same batch sizes."""
    _, total = issue_corpus
    reports = two_workers_per_rank
    for batching in ("loader", "dataset"):
        runs = [report["modes"][mode][batching] for report in reports]
        assert runs[0]["sizes"] == runs[1]["sizes"], batching
        assert runs[0]["steps"] == runs[1]["steps"] == len(runs[0]["sizes"]) > 0
        read = [i for run in runs for i in run["ids"]]
        if mode == "drop":
            assert len(read) == len(set(read)) >= 0.95 * total
        else:
            assert set(read) == set(range(total))


# -- the issue's numbers: batch sizes, not only records, are even -------------------------------

ISSUE_RECORDS = 2010


@pytest.fixture(scope="module")
def issue_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    path = tmp_path_factory.mktemp("issue26") / "corpus.jsonl"
    part = [{"id": i, "text": "t" * (20 + i % 50)} for i in range(ISSUE_RECORDS)]
    corpus.write_plain(path, corpus.jsonl(part))
    return str(path), ISSUE_RECORDS


def issue_dataset(source: str, mode: str, rank: int) -> StreamingJsonl:
    return StreamingJsonl(source, shuffle=True, seed=0, buffer_size=256, even_ranks=mode,
                          rank=rank, world_size=2)


def worker_quotas(source: str, mode: str, workers: int) -> list[int]:
    """The per-reader quotas of the issue's world (white box: from the plan's counts)."""
    dataset = issue_dataset(source, mode, 0)
    world = World(0, 2, 0, workers)
    assert dataset._block_counts is not None
    counts = dataset._plan.reader_records(0, world, dataset._block_counts)
    return quotas(counts, 2, mode)


def batch_sizes(source: str, mode: str, rank: int, **loader: Any) -> list[int]:
    dataset: Any = issue_dataset(source, mode, rank)
    if loader.pop("in_reader", False):
        dataset = dataset.batch(loader.pop("batch_size"), collate=ids)
        loader["batch_size"] = None
    else:
        loader["collate_fn"] = ids
    made = DataLoader(dataset, num_workers=2, **loader)
    return [len(batch) for batch in made]


def uneven_batch(source: str, mode: str) -> int:
    """A batch size at which the two workers make different numbers of batches, so the
    DataLoader's round-robin goes on with one worker after the other ran out."""
    vector = worker_quotas(source, mode, 2)[:2]
    for size in range(2, 64):
        if -(-vector[0] // size) != -(-vector[1] // size):
            return size
    raise AssertionError(f"no batch size gives workers of {vector} different batch counts")


@pytest.mark.parametrize("mode", ["drop", "pad"])
@pytest.mark.parametrize("loader", [
    {"batch_size": 16}, {"batch_size": 16, "drop_last": True},
    {"batch_size": 16, "in_reader": True}, {"batch_size": "uneven"}],
    ids=["batch16", "drop_last", "dot_batch16", "worker_runs_out"])
def test_every_rank_makes_the_same_batch_sizes_with_two_workers(
    issue_corpus: tuple[str, int], mode: str, loader: dict[str, Any]
) -> None:
    """Issue 26's repro: 2,010 records, 2 ranks x 2 workers. Evening rank totals alone gave
    the ranks different batch sequences (63 and 64 batches)."""
    source, _ = issue_corpus
    loader = dict(loader)
    if loader["batch_size"] == "uneven":
        loader["batch_size"] = uneven_batch(source, mode)
    sizes = [batch_sizes(source, mode, rank, **loader) for rank in range(2)]
    assert sizes[0] == sizes[1]
    assert sizes[0] and sum(sizes[0]) == sum(worker_quotas(source, mode, 2)[:2]) - (
        sum(size % loader["batch_size"] for size in worker_quotas(source, mode, 2)[:2])
        if loader.get("drop_last") else 0)


def test_worker_quotas_are_one_vector_and_lose_little(issue_corpus: tuple[str, int]) -> None:
    source, total = issue_corpus
    drop, pad = worker_quotas(source, "drop", 2), worker_quotas(source, "pad", 2)
    assert drop[:2] == drop[2:] and pad[:2] == pad[2:]
    assert total - sum(drop) <= 0.03 * total and sum(pad) - total <= 0.03 * total
