"""Resuming a plain DataLoader from the number of batches it yielded (`resume_after_batches`)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from streamds import Storage, StreamingJsonl
from streamds.resume.plain_loader import batches_per_reader

BATCH = 16


def keep(batch: list) -> list:
    return batch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("skip")
    for shard, count in enumerate([3000, 500, 2000]):
        lines = (orjson.dumps({"id": shard * 10_000 + i, "pad": "y" * (i % 300)}) for i in
                 range(count))
        (root / f"part-{shard}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return root


def ids(ds: StreamingJsonl, workers: int, drop_last: bool, limit: int | None = None) -> list:
    loader = DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=keep,
                        drop_last=drop_last)
    out = []
    for step, batch in enumerate(loader):
        if limit is not None and step == limit:
            break
        out.extend(record["id"] for record in batch)
    return out


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
def test_resumed_plain_loader_continues_exactly(corpus, shuffle, workers, drop_last):
    ds = StreamingJsonl(corpus, shuffle=shuffle, seed=5, buffer_size=100,
                        storage=Storage(block_size=64 << 10))
    full = ids(ds, workers, drop_last)
    assert len(set(full)) == len(full)
    for consumed in (0, 1, 37, 200, len(full) // BATCH):  # past the end raises (test_edges)
        seen = ids(ds, workers, drop_last, limit=consumed)
        resumed = ds.resume_after_batches(consumed, batch_size=BATCH, num_workers=workers,
                                          drop_last=drop_last)
        assert seen + ids(resumed, workers, drop_last) == full, consumed


def test_resume_point_applies_to_its_epoch_only(corpus):
    ds = StreamingJsonl(corpus, shuffle=True, seed=1, storage=Storage(block_size=64 << 10))
    resumed = ds.resume_after_batches(50, batch_size=BATCH, num_workers=0)
    resumed.set_epoch(1)
    ds.set_epoch(1)
    assert ids(resumed, 0, False) == ids(ds, 0, False)  # a full, fresh epoch 1


def test_refuses_combinations_it_cannot_compute(corpus):
    with pytest.raises(ValueError, match="even_ranks"):
        StreamingJsonl(corpus, even_ranks="drop").resume_after_batches(
            3, batch_size=BATCH, num_workers=0
        )
    with pytest.raises(ValueError, match="batch_size"):
        StreamingJsonl(corpus).resume_after_batches(3, batch_size=0, num_workers=0)


@settings(max_examples=200, deadline=None)
@given(
    records=st.lists(st.integers(0, 50), min_size=1, max_size=6),
    batch=st.integers(1, 8),
    drop_last=st.booleans(),
    consumed=st.integers(0, 60),
)
def test_batches_per_reader_matches_round_robin_over_live_workers(
    records, batch, drop_last, consumed
):
    """Replays the DataLoader's order: workers in turn, skipping those that ran out."""
    left = [(n // batch) if drop_last else -(-n // batch) for n in records]
    taken = [0] * len(records)
    order = [w for rnd in range(max(left, default=0)) for w in range(len(records))
             if left[w] > rnd]
    for worker in order[:consumed]:
        taken[worker] += 1
    got, _ = batches_per_reader(records, consumed, batch_size=batch, drop_last=drop_last)
    assert got == taken
