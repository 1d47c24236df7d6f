"""Dealing: blocks go to the readers in turn, or, for Parquet, in contiguous runs.

In turn, the readers' record counts even out where record sizes drift along the corpus. A
Parquet reader owns a run of the epoch's order, and a shuffle keeps a row group's ranges
together and in file order, so the row ranges of one row group go to one reader, which
decodes the row group once, forward; a deal in turn (or a shuffle of single ranges) made
every reader decode every row group (issue 35). Exactly once over any world is
`test_guarantees.py::test_assign_gives_every_block_to_exactly_one_reader`.
"""

from __future__ import annotations

import itertools
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_parquet import assert_exactly_once, fake_worker, write_parquet_files

from streamds import StreamingJsonl
from streamds.formats import parquet
from streamds.resume.merge import share_of
from streamds.storage.plan import (
    Plan,
    assign,
    deal_position,
    decode_units,
    epoch_order,
    reader_at,
    unit_lengths,
)
from streamds.world import World


def worlds(world_size: int, num_workers: int) -> list[World]:
    return [World(rank, world_size, worker, num_workers)
            for rank in range(world_size) for worker in range(num_workers)]


@given(num_blocks=st.integers(0, 200), world_size=st.integers(1, 4),
       num_workers=st.integers(1, 4), shuffle=st.booleans(), epoch=st.integers(0, 3))
def test_each_reader_owns_a_contiguous_run_in_deal_order(
        num_blocks, world_size, num_workers, shuffle, epoch):
    order = epoch_order(num_blocks, seed=7, epoch=epoch, shuffle=shuffle)
    runs = {deal_position(world): assign(order, world, runs=True)
            for world in worlds(world_size, num_workers)}
    # the runs, taken in deal position order, are the order itself: contiguous, in turn
    assert [block for position in sorted(runs) for block in runs[position]] == order
    sizes = [len(runs[position]) for position in sorted(runs)]
    assert max(sizes) - min(sizes) <= 1  # floor/ceil equal block counts
    assert sizes == sorted(sizes, reverse=True)  # the longer runs first
    # fewer blocks than readers: the first positions own one each (every rank first)
    if num_blocks < world_size * num_workers:
        assert sizes == [1] * num_blocks + [0] * (len(sizes) - num_blocks)


@given(num_blocks=st.integers(0, 200), world_size=st.integers(1, 4),
       num_workers=st.integers(1, 4), shuffle=st.booleans(), epoch=st.integers(0, 3))
def test_without_runs_each_reader_owns_every_readers_th_block_from_its_turn(
        num_blocks, world_size, num_workers, shuffle, epoch):
    order = epoch_order(num_blocks, seed=7, epoch=epoch, shuffle=shuffle)
    readers = world_size * num_workers
    for world in worlds(world_size, num_workers):
        assert assign(order, world) == order[deal_position(world)::readers]


def test_a_parquet_corpus_is_dealt_in_runs_and_lines_in_turn(tmp_path):
    write_parquet_files(tmp_path / "pq", [[100, 100]])
    (tmp_path / "lines.jsonl").write_text("".join(f'{{"id": {i}}}\n' for i in range(10)))
    parquet_plan = StreamingJsonl(tmp_path / "pq")._plan
    assert parquet_plan.runs
    # one unit per row group, each cut into several ranges
    assert sum(unit_lengths(parquet_plan.units)) == parquet_plan.num_blocks
    assert len(unit_lengths(parquet_plan.units)) == 2 < parquet_plan.num_blocks
    assert not StreamingJsonl(tmp_path / "lines.jsonl")._plan.runs


@given(lengths=st.lists(st.integers(1, 6), max_size=12), epoch=st.integers(0, 3))
def test_a_shuffle_keeps_each_decode_unit_together_in_file_order(lengths, epoch):
    units = tuple((length, 1) for length in lengths)
    num_blocks = sum(lengths)
    order = epoch_order(num_blocks, seed=5, epoch=epoch, shuffle=True, units=units)
    assert sorted(order) == list(range(num_blocks))  # every block once
    unit_of = [k for k, length in enumerate(lengths) for _ in range(length)]
    runs = [unit_of[order[0]]] if order else []
    for block in order[1:]:
        if unit_of[block] != runs[-1]:
            runs.append(unit_of[block])
    assert sorted(runs) == list(range(len(lengths)))  # each unit one contiguous span
    for block, after in itertools.pairwise(order):  # ... in file order (a row group decodes
        if unit_of[block] == unit_of[after]:  # forward: `parquet.GroupRows`)
            assert after == block + 1


def test_decode_units_are_run_length_pairs(tmp_path):
    write_parquet_files(tmp_path / "pq", [[100, 100, 100], [100]])
    ds = StreamingJsonl(tmp_path / "pq")
    units = decode_units(ds._shards, ds._block_list)
    assert len(units) == 1 and units[0][1] == 4  # four equal row groups: one pair
    assert Plan.of(ds._plan.described()) == ds._plan  # a state's plan is the plan


@given(num_blocks=st.integers(0, 120), world_size=st.integers(1, 4),
       num_workers=st.integers(1, 4), shuffle=st.booleans(), runs=st.booleans())
def test_reader_records_and_work_tell_one_ownership(num_blocks, world_size, num_workers,
                                                      shuffle, runs):
    """`Plan.reader_records` (len, even_ranks quotas) counts what `Plan.work` reads."""
    units = ((1, num_blocks),) if runs else None
    plan = Plan(num_blocks, seed=3, shuffle=shuffle, units=units)
    counts = [(block * 7919) % 13 + 1 for block in range(num_blocks)]
    world = World(0, world_size, 0, num_workers)
    totals = plan.reader_records(1, world, counts)
    for reader in worlds(world_size, num_workers):
        own = sum(counts[block] for block, _ in plan.work(1, reader))
        assert totals[reader.reader] == own
        assert reader_at(deal_position(reader), reader) == reader.reader


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_workers_decode_their_row_groups_once_forward_up_to_their_last_row(
        shuffle, monkeypatch):
    """One file of 3 row groups, each cut into row ranges, 2 workers (the run boundary inside
    the middle row group), in order and shuffled: each worker decodes each row group it owns
    ranges of once, from its first row (Parquet has no row seek) up to the batch holding its
    last row, and no further; its next range continues the decoding. Fails if a range decodes
    its row group again, if the deal interleaves or a shuffle scatters a row group's ranges,
    or if decoding runs on past a worker's last range."""
    monkeypatch.setattr(parquet, "BATCH_ROWS", 10)
    opened: Counter = Counter()  # (worker, row group) -> decodings begun
    decoded: Counter = Counter()  # worker -> rows decoded
    iter_batches = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        opened[worker_now, kwargs["row_groups"][0]] += 1
        for batch in iter_batches(self, *args, **kwargs):
            decoded[worker_now] += batch.num_rows
            yield batch

    with tempfile.TemporaryDirectory() as tmp:
        ids = write_parquet_files(Path(tmp) / "data", [[100, 100, 100]])
        ds = StreamingJsonl(Path(tmp) / "data", shuffle=shuffle, seed=3)
        assert ds._plan.num_blocks >= 12  # each row group is cut into ranges
        parts = []
        for worker_now in range(2):
            parquet.close_open_row_groups()  # each DataLoader worker is its own process
            with fake_worker(worker_now, 2), \
                    mock.patch.object(pq.ParquetFile, "iter_batches", counted):
                parts.append([record["id"] for record in ds])
    assert_exactly_once(parts, ids)
    for worker, part in enumerate(parts):
        groups = sorted({row // 100 for row in part})
        assert {group: opened[worker, group] for group in groups} == dict.fromkeys(groups, 1)
        assert sum(n for (who, _), n in opened.items() if who == worker) == len(groups)
        # from each row group's first row to the batch of 10 rows holding its last row owned
        last = {group: max(row for row in part if row // 100 == group) for group in groups}
        assert decoded[worker] == sum(-(-(last[g] + 1 - 100 * g) // 10) * 10 for g in groups)
    assert {len({row // 100 for row in part}) for part in parts} == {2}  # a shared row group


@given(items=st.integers(0, 40), world_size=st.integers(1, 3), num_workers=st.integers(1, 3))
def test_an_elastic_resume_deals_the_remaining_work_as_runs_too(items, world_size,
                                                                 num_workers):
    """`merge_states`' remaining work goes to the new world as a plan's blocks do: the rest
    of one row group stays with one reader."""
    remaining = [[block, None] for block in range(items)]
    merged = {"remaining": remaining, "pending": [], "counts": {}}
    runs = {deal_position(world): share_of(merged, world)[0]
            for world in worlds(world_size, num_workers)}
    assert [block for position in sorted(runs) for block, _ in runs[position]] == \
        list(range(items))
    sizes = [len(runs[position]) for position in sorted(runs)]
    assert max(sizes) - min(sizes) <= 1
