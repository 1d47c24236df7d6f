"""accelerate's own split around a StreamingJsonl that splits by rank: refused, never a silent
second split (in-process, with accelerate's real IterableDatasetShard; the dispatcher under
torchrun is in test_frameworks.py)."""

from __future__ import annotations

import collections

import corpus
import pytest
from torch.utils.data import DataLoader

from streamds import StreamingJsonl
from streamds.datasets.callers import DoubleSplitError

accelerate_data = pytest.importorskip("accelerate.data_loader")

RECORDS = 120


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    return corpus.write_parts(tmp_path_factory.mktemp("split"), RECORDS, 6)


def ids(batch: list[dict]) -> list[int]:
    return [record["id"] for record in batch]


def shard_loader(dataset: StreamingJsonl, process: int, workers: int) -> DataLoader:
    shard = accelerate_data.IterableDatasetShard(dataset, batch_size=4, num_processes=2,
                                                 process_index=process)
    return DataLoader(shard, batch_size=4, num_workers=workers, collate_fn=ids)


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_around_a_rank_split_is_refused(source: str, workers: int) -> None:
    dataset = StreamingJsonl(source, rank=0, world_size=2)
    with pytest.raises(DoubleSplitError, match="world_size=1"):
        list(shard_loader(dataset, 0, workers))


def test_shard_set_epoch_is_refused_before_any_batch(source: str) -> None:
    # what DataLoaderShard.__iter__ does on every process before the first batch
    shard = accelerate_data.IterableDatasetShard(StreamingJsonl(source, rank=1, world_size=2),
                                                 batch_size=4, num_processes=2,
                                                 process_index=1)
    with pytest.raises(DoubleSplitError, match="IterableDatasetShard"):
        shard.set_epoch(0)


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_alone_splits_a_dataset_of_one_rank(source: str, workers: int) -> None:
    # rank=0, world_size=1: accelerate alone splits; every record once, plus its end padding
    seen = collections.Counter()
    for process in range(2):
        dataset = StreamingJsonl(source, shuffle=True, seed=1, buffer_size=8, rank=0,
                                 world_size=1)
        for batch in shard_loader(dataset, process, workers):
            seen.update(batch)
    assert set(seen) == set(range(RECORDS))
    assert sum(seen.values()) - RECORDS < 2 * 4 * max(1, workers)  # padding of last batches


def test_no_accelerate_no_refusal(source: str) -> None:
    every = [i for batch in DataLoader(StreamingJsonl(source, rank=1, world_size=2),
                                       batch_size=4, collate_fn=ids) for i in batch]
    assert 0 < len(every) < RECORDS
