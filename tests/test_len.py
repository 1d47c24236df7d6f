"""len() where the record count is known and the same in every epoch: a converted corpus (its
manifest lists records per frame) or a count taken for even_ranks; a TypeError otherwise,
never a guess.

Seen from a DataLoader, len(loader) is the number of batches the loader really yields, for any
num_workers, batch size, drop_last, rank and even_ranks, and after `.batch(n)`.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import corpus
import orjson
import pytest
from torch.utils.data import DataLoader

from streamds import StreamingJsonl
from streamds.preprocess.convert import convert

RECORDS = 200


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("len")
    (root / "in.jsonl").write_bytes(corpus.jsonl(corpus.make_records(RECORDS)))
    convert([str(root / "in.jsonl")], root / "out", shard_size=1500, frame_size=600)
    return str(root / "out")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("plain") / "in.jsonl"
    path.write_bytes(corpus.jsonl(corpus.make_records(RECORDS)))
    return str(path)


def test_len_of_a_converted_corpus_is_its_record_count(converted: str) -> None:
    dataset = StreamingJsonl(converted)
    assert len(dataset) == RECORDS
    shares = [len(StreamingJsonl(converted, rank=rank, world_size=3)) for rank in range(3)]
    assert sum(shares) == RECORDS
    assert all(0 < share < RECORDS for share in shares)


@pytest.mark.parametrize(("world_size", "num_workers", "batch_size", "drop_last", "even",
                          "shuffle"),
                         [(1, 0, 4, False, None, True), (1, 2, 7, False, None, False),
                          (2, 3, 7, True, None, False), (2, 2, 5, False, "drop", False),
                          (2, 1, 3, False, "pad", False)])
def test_len_of_the_loader_is_the_batches_it_yields(
    converted: str, world_size: int, num_workers: int, batch_size: int, drop_last: bool,
    even: str | None, shuffle: bool,
) -> None:
    for rank, epoch in itertools.product(range(world_size), (0, 1)):
        dataset = StreamingJsonl(converted, shuffle=shuffle, seed=3, buffer_size=8, rank=rank,
                                 world_size=world_size, even_ranks=even)
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                            drop_last=drop_last, collate_fn=list)
        assert len(loader) == sum(1 for _ in loader)
        batched = DataLoader(dataset.batch(batch_size, drop_last=drop_last), batch_size=None,
                             num_workers=num_workers)
        assert len(batched) == sum(1 for _ in batched)


def test_len_with_workers_counts_each_workers_short_batch(converted: str) -> None:
    # torch divides len(dataset) by batch_size; with 3 workers each has a short last batch
    dataset = StreamingJsonl(converted)
    loader = DataLoader(dataset, batch_size=10, num_workers=3, collate_fn=list)
    batches = sum(1 for _ in loader)
    assert batches > RECORDS // 10  # more than the record count alone would say
    assert len(loader) == batches
    assert len(dataset) == RECORDS  # outside a DataLoader: the records


@pytest.fixture(scope="module")
def equal_blocks(tmp_path_factory: pytest.TempPathFactory) -> str:
    """8 converted shards of 25 records each, one block each."""
    root = tmp_path_factory.mktemp("equal")
    lines = [orjson.dumps({"id": i, "pad": "x" * (8 - len(str(i)))}) + b"\n"
             for i in range(RECORDS)]
    (root / "in.jsonl").write_bytes(b"".join(lines))
    convert([str(root / "in.jsonl")], root / "out", shard_size=25 * len(lines[0]),
            frame_size=1 << 20)
    return str(root / "out")


def test_shuffled_len_is_known_where_every_epoch_has_it(converted: str,
                                                        equal_blocks: str) -> None:
    # unequal blocks dealt anew each epoch to 2 ranks: the length varies, so none is given
    with pytest.raises(TypeError, match="differs from epoch to epoch"):
        len(StreamingJsonl(converted, shuffle=True, rank=0, world_size=2))
    loader = DataLoader(StreamingJsonl(converted, shuffle=True), batch_size=7, num_workers=2)
    with pytest.raises(TypeError, match="max_steps"):
        len(loader)
    # equal blocks: every epoch deals each reader as many records
    for epoch in range(3):
        dataset = StreamingJsonl(equal_blocks, shuffle=True, seed=1, buffer_size=8, rank=1,
                                 world_size=2)
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=7, num_workers=2, collate_fn=list)
        assert len(dataset) == RECORDS // 2
        assert len(loader) == sum(1 for _ in loader) == 2 * 8


def test_len_is_known_from_the_count_even_ranks_takes(plain: str) -> None:
    assert len(StreamingJsonl(plain, even_ranks="pad", rank=0, world_size=1)) == RECORDS


@pytest.mark.parametrize("make", [
    lambda source, plain: StreamingJsonl(plain),  # no manifest, no count taken
    lambda source, plain: StreamingJsonl(source).filter(bool),
    lambda source, plain: StreamingJsonl(source).batch(
        __import__("streamds").TokenBudget(64)),
])
def test_no_len_without_a_known_count(converted: str, plain: str, make) -> None:
    with pytest.raises(TypeError):
        len(make(converted, plain))


def test_trainer_style_has_length_sees_no_length(plain: str) -> None:
    # transformers' has_length() catches TypeError only
    with pytest.raises(TypeError, match="streamds convert"):
        len(StreamingJsonl(plain))


def test_converted_fixture_has_several_blocks(converted: str) -> None:
    assert len(list(Path(converted).glob("*.zst"))) > 3


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_even_ranks_give_every_rank_the_same_len_with_workers(
    tmp_path: Path, mode: str
) -> None:
    # what StreamdsTrainer (one epoch length for all ranks) and DDP need; the repro
    path = tmp_path / "uneven.jsonl"
    path.write_bytes(corpus.jsonl(corpus.make_records(2010)))
    for epoch in range(2):
        lengths = []
        for rank in range(2):
            dataset = StreamingJsonl(str(path), shuffle=True, seed=0, buffer_size=256,
                                     even_ranks=mode, rank=rank, world_size=2)
            dataset.set_epoch(epoch)
            loader = DataLoader(dataset, batch_size=16, num_workers=2, collate_fn=list)
            lengths.append(sum(1 for _ in loader))
        assert lengths[0] == lengths[1], f"epoch {epoch}: {lengths}"


@pytest.mark.parametrize(("workers", "drop_last"), [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("small", [False, True])
def test_len_of_ds_loader_is_the_batches_it_yields(converted: str, workers: int,
                                                   drop_last: bool, small: bool) -> None:
    loader = StreamingJsonl(converted).loader(
        16, num_workers=workers, drop_last=drop_last, small_records=small)
    assert len(loader) == sum(1 for _ in loader)
