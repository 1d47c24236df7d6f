"""Guarantees 1 (exactly once) and 2 (order) of DESIGN.md, plus picklability.

Splitting is a pure function of the world, so most worlds are simulated: the planning
functions are called directly for any (rank, world_size, worker, num_workers), and whole
datasets run as one rank (the `rank=`/`world_size=` arguments) and one worker (a fake
`torch.utils.data.get_worker_info`) at a time. A few real DataLoader worlds check that the
simulation matches what workers do.
"""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

import corpus
import pytest
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

from streamds import StreamingJsonl, World
from streamds.formats.seekable import Frame
from streamds.storage.plan import MIN_BLOCK_SIZE, SPLITS_PER_FILE, assign, epoch_order, make_blocks
from streamds.storage.shards import Shard

REPO = Path(__file__).resolve().parents[1]


def ids(records: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in records]


def tag_worker(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "worker": torch.utils.data.get_worker_info().id}


def shout(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "text": record["text"].upper()}


def add_length(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "length": len(record["text"])}


# -- corpora ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """Sources by name, each with its record count (ids run 0..count-1 in corpus order).

    one_file: one plain file of several blocks; one_seekable: one seekable .zst of several
    frame runs; few_files: three files that cannot be split (fewer than most worlds' readers);
    mixed: every format in one directory.
    """
    root = tmp_path_factory.mktemp("corpora")
    one_file = corpus.write(root / "one.jsonl", corpus.make_records(6000))
    one_seekable = corpus.write(root / "one.jsonl.zst", corpus.make_records(6000))
    few = root / "few"
    few.mkdir()
    corpus.write(few / "a-1.jsonl.gz", corpus.make_records(100))
    corpus.write(few / "a-2.tar", corpus.make_records(100, start=100))
    corpus.write(few / "a-10.jsonl.xz", corpus.make_records(100, start=200))
    mixed = root / "mixed"
    mixed.mkdir()
    corpus.write(mixed / "p-0.jsonl", corpus.make_records(3000))
    corpus.write(mixed / "p-1.jsonl.zst", corpus.make_records(3000, start=3000))
    small = [corpus.jsonl(corpus.make_records(50, start=start)) for start in (6000, 6050, 6100)]
    corpus.write_foreign_zst(mixed / "p-2.jsonl.zst", small[0])
    corpus.write_bz2(mixed / "p-3.jsonl.bz2", small[1])
    corpus.write_tar_jsonl(mixed / "p-4.tar", small[2])
    return {
        "one_file": (one_file, 6000),
        "one_seekable": (one_seekable, 6000),
        "few_files": (few, 300),
        "mixed": (mixed, 6150),
    }


def fake_worker(worker: int, num_workers: int):
    """Make this process look like DataLoader worker `worker` of `num_workers`."""
    info = types.SimpleNamespace(id=worker, num_workers=num_workers, seed=0, dataset=None)
    return mock.patch.object(torch.utils.data, "get_worker_info", return_value=info)


def read_world(source: Path, world_size: int, num_workers: int, **options: Any) -> list[list]:
    """Each simulated reader's records, readers in (rank, worker) order."""
    readers = []
    for rank in range(world_size):
        ds = StreamingJsonl(source, rank=rank, world_size=world_size, **options)
        if num_workers == 0:
            readers.append(list(ds))
            continue
        for worker in range(num_workers):
            with fake_worker(worker, num_workers):
                readers.append(list(ds))
    return readers


# -- guarantee 1: exactly once ---------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(0, 200),
    world_size=st.integers(1, 8),
    num_workers=st.integers(1, 8),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 50),
)
def test_assign_gives_every_block_to_exactly_one_reader(
    num_blocks, world_size, num_workers, shuffle, seed, epoch
):
    order = epoch_order(num_blocks, seed=seed, epoch=epoch, shuffle=shuffle)
    assert sorted(order) == list(range(num_blocks))
    shares = [
        assign(order, World(rank, world_size, worker, num_workers))
        for rank in range(world_size)
        for worker in range(num_workers)
    ]
    assert sorted(block for share in shares for block in share) == list(range(num_blocks))
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1  # readers share the blocks evenly


def plain_shard(size: int) -> Shard:
    return Shard(url="p.jsonl", path="p.jsonl", size=size, format="jsonl", codec=None)


def seekable_shard(frame_sizes: list[int]) -> Shard:
    frames, offset = [], 0
    for size in frame_sizes:
        frames.append(Frame(0, 0, offset, size))  # compressed layout is irrelevant to planning
        offset += size
    return Shard(url="s.jsonl.zst", path="s", size=1, format="jsonl.zst", codec="zst",
                 frames=tuple(frames))


def assert_tiles(blocks, index: int, boundaries: set[int] | None = None) -> None:
    """`blocks` of shard `index` cover it: from 0, each starting where the last ended."""
    assert blocks and all(block.shard == index for block in blocks)
    assert blocks[0].start == 0 and blocks[-1].end is None
    for before, after in itertools.pairwise(blocks):
        assert before.start < before.end == after.start
        assert boundaries is None or after.start in boundaries


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40 * MIN_BLOCK_SIZE), min_size=1, max_size=4),
    frames=st.lists(st.integers(0, 3 * MIN_BLOCK_SIZE), max_size=60),
    block_size=st.integers(MIN_BLOCK_SIZE, 16 * MIN_BLOCK_SIZE),
)
def test_blocks_tile_every_shard(sizes, frames, block_size):
    shards = [plain_shard(size) for size in sizes] + [seekable_shard(frames)]
    blocks = make_blocks(shards, block_size)
    assert [block.shard for block in blocks] == sorted(block.shard for block in blocks)
    for index, size in enumerate(sizes):
        mine = [block for block in blocks if block.shard == index]
        assert_tiles(mine, index)
        assert all(block.start < size for block in mine[1:])
    frame_starts = {sum(frames[:i]) for i in range(len(frames) + 1)}
    assert_tiles([block for block in blocks if block.shard == len(sizes)], len(sizes),
                 frame_starts)


def test_a_big_file_is_split_for_every_reader():
    size = SPLITS_PER_FILE * MIN_BLOCK_SIZE * 3
    assert len(make_blocks([plain_shard(size)])) >= SPLITS_PER_FILE
    frames = [MIN_BLOCK_SIZE // 4] * (SPLITS_PER_FILE * 8)
    assert len(make_blocks([seekable_shard(frames)])) >= SPLITS_PER_FILE


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["one_file", "one_seekable", "few_files", "mixed"]),
    world_size=st.integers(1, 8),
    num_workers=st.integers(0, 8),
    shuffle=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_every_simulated_world_reads_every_record_exactly_once(
    corpora, name, world_size, num_workers, shuffle, seed
):
    source, count = corpora[name]
    readers = read_world(source, world_size, num_workers, shuffle=shuffle, seed=seed,
                         buffer_size=50)
    assert sorted(ids([record for reader in readers for record in reader])) == list(range(count))
    if name == "one_file" and world_size * max(num_workers, 1) <= 4:
        assert all(readers)  # one file feeds every reader


@pytest.mark.parametrize(
    ("name", "world_size", "num_workers", "shuffle"),
    [
        ("one_file", 1, 4, True),
        ("one_seekable", 2, 0, True),
        ("one_file", 2, 3, False),
        ("one_seekable", 3, 2, True),
        ("few_files", 2, 4, True),
        ("mixed", 4, 1, False),
    ],
)
def test_real_dataloader_worlds_read_every_record_exactly_once(
    corpora, name, world_size, num_workers, shuffle
):
    source, count = corpora[name]
    out = []
    for rank in range(world_size):
        ds = StreamingJsonl(source, shuffle=shuffle, seed=5, rank=rank, world_size=world_size)
        out += corpus.read_all(ds, num_workers)
    assert sorted(ids(out)) == list(range(count))


def test_simulated_workers_match_real_workers(corpora):
    source, _ = corpora["mixed"]
    simulated = read_world(source, 1, 3, shuffle=True, seed=9)
    # one batch per worker, and the DataLoader returns workers' batches in worker order
    real = corpus.read_all(StreamingJsonl(source, shuffle=True, seed=9), 3, batch_size=10**6)
    assert real == [record for reader in simulated for record in reader]


# -- guarantee 2: order ----------------------------------------------------------------------


def test_one_reader_reads_shards_in_natural_order_then_file_order(tmp_path):
    for part in range(12):  # part-2 sorts before part-10
        corpus.write(tmp_path / f"part-{part}.jsonl", corpus.make_records(5, start=5 * part))
    expected = list(range(60))
    assert ids(list(StreamingJsonl(tmp_path))) == expected
    assert ids(list(StreamingJsonl(str(tmp_path / "part-*.jsonl")))) == expected
    listed = sorted(tmp_path.iterdir(), reverse=True)
    assert ids(list(StreamingJsonl(listed))) == expected
    assert ids(corpus.read_all(StreamingJsonl(tmp_path), num_workers=0)) == expected


def test_same_seed_epoch_and_world_give_the_same_sequence(corpora):
    source, _ = corpora["mixed"]

    def run(**world: int) -> list[Any]:
        return list(StreamingJsonl(source, shuffle=True, seed=11, buffer_size=64, **world))

    assert run() == run()
    assert run(rank=1, world_size=3) == run(rank=1, world_size=3)
    with fake_worker(2, 4):
        in_worker = run(rank=1, world_size=2)
    with fake_worker(2, 4):
        assert run(rank=1, world_size=2) == in_worker


def test_real_workers_give_the_same_sequence_run_after_run(corpora):
    source, _ = corpora["mixed"]

    def run() -> list[Any]:
        return corpus.read_all(StreamingJsonl(source, shuffle=True, seed=2), num_workers=3)

    first = run()
    assert run() == first
    assert ids(first) != sorted(ids(first))


def test_another_process_gives_the_same_sequence(corpora):
    source, _ = corpora["mixed"]
    code = (
        "import sys\n"
        "from streamds import StreamingJsonl\n"
        "ds = StreamingJsonl(sys.argv[1], shuffle=True, seed=4, rank=1, world_size=2)\n"
        "ds.set_epoch(3)\n"
        "print(','.join(str(r['id']) for r in ds))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code, str(source)], env=env, check=True,
                            capture_output=True, text=True, cwd=REPO)
    ds = StreamingJsonl(source, shuffle=True, seed=4, rank=1, world_size=2)
    ds.set_epoch(3)
    assert result.stdout.strip() == ",".join(str(record["id"]) for record in ds)


def test_set_epoch_chooses_the_order(corpora):
    source, count = corpora["mixed"]
    ds = StreamingJsonl(source, shuffle=True, seed=0, buffer_size=64)
    epoch0 = ids(list(ds))
    ds.set_epoch(1)
    epoch1 = ids(list(ds))
    assert epoch1 != epoch0
    assert sorted(epoch1) == sorted(epoch0) == list(range(count))
    fresh = StreamingJsonl(source, shuffle=True, seed=0, buffer_size=64)
    fresh.set_epoch(1)
    assert ids(list(fresh)) == epoch1
    ds.set_epoch(0)
    assert ids(list(ds)) == epoch0


def test_block_order_depends_on_seed_and_epoch_only():
    first = epoch_order(500, seed=3, epoch=0, shuffle=True)
    assert epoch_order(500, seed=3, epoch=0, shuffle=True) == first
    assert epoch_order(500, seed=3, epoch=1, shuffle=True) != first
    assert epoch_order(500, seed=4, epoch=0, shuffle=True) != first
    assert epoch_order(500, seed=3, epoch=5, shuffle=False) == list(range(500))


def test_each_epoch_reorders_blocks(corpora):
    source, _ = corpora["one_file"]
    ds = StreamingJsonl(source, shuffle=True, buffer_size=1)  # a buffer of one keeps order
    epoch0 = ids(list(ds))
    ds.set_epoch(1)
    epoch1 = ids(list(ds))
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)


def test_each_epoch_reseeds_the_buffer(corpora):
    source, _ = corpora["few_files"]
    gz = next(path for path in source.iterdir() if path.name.endswith(".gz"))  # one block
    ds = StreamingJsonl(gz, shuffle=True, buffer_size=50)
    epoch0 = ids(list(ds))
    ds.set_epoch(1)
    epoch1 = ids(list(ds))
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)


def test_without_shuffle_every_epoch_is_in_file_order(corpora):
    source, count = corpora["mixed"]
    ds = StreamingJsonl(source)
    ds.set_epoch(7)
    assert ids(list(ds)) == list(range(count))


def test_shuffle_moves_records_across_blocks(corpora):
    source, count = corpora["one_file"]
    out = ids(list(StreamingJsonl(source, shuffle=True, seed=1, buffer_size=10)))
    # a buffer of 10 alone moves records a few places; block order moves them by thousands
    assert max(abs(position - record) for position, record in enumerate(out)) > count // 4


def test_three_workers_share_one_uncompressed_file_evenly(tmp_path):
    count = 45_000  # ~2.8 MB: dozens of blocks
    path = corpus.write(tmp_path / "big.jsonl", corpus.make_records(count))
    out = corpus.read_all(StreamingJsonl(path).map(tag_worker), num_workers=3, batch_size=500)
    assert sorted(ids(out)) == list(range(count))
    per_worker = collections.Counter(record["worker"] for record in out)
    assert sorted(per_worker) == [0, 1, 2]
    for worker, share in per_worker.items():
        assert abs(share - count / 3) <= 0.1 * count / 3, (worker, per_worker)


@pytest.mark.parametrize("name", ["seekable.jsonl.zst", "foreign.jsonl.zst", "foreign.jsonl.zstd"])
def test_zst_is_always_decoded(tmp_path, name):
    records = corpus.make_records(2000)
    data = corpus.jsonl(records)
    writer = corpus.write_seekable_zst if name.startswith("seekable") else corpus.write_foreign_zst
    path = writer(tmp_path / name, data)
    assert path.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # zstd magic: not JSON on disk
    assert list(StreamingJsonl(path)) == records
    assert corpus.read_all(StreamingJsonl(path), num_workers=2) != []


# -- a picklable description -----------------------------------------------------------------


def test_dataset_pickles_before_during_and_after_iteration(corpora):
    source, _ = corpora["mixed"]
    ds = StreamingJsonl(source, shuffle=True, seed=3)
    description = pickle.dumps(ds)
    expected = list(pickle.loads(description))
    iterator = iter(ds)
    next(iterator)  # the shuffle buffer now holds 1000 records
    assert len(pickle.dumps(ds)) < 2 * len(description)  # they do not travel with it
    assert list(pickle.loads(pickle.dumps(ds))) == expected
    list(iterator)
    assert list(pickle.loads(pickle.dumps(ds))) == expected
    assert list(ds) == expected


def test_mapped_dataset_round_trips_through_pickle(corpora):
    source, _ = corpora["few_files"]
    ds = StreamingJsonl(source).map(shout).map(add_length)
    copy = pickle.loads(pickle.dumps(ds))
    expected = [add_length(shout(record)) for record in StreamingJsonl(source)]
    assert list(copy) == expected
    assert corpus.read_all(copy, num_workers=2) != []
