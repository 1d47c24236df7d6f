"""Tokenized records -> padded tensors made in the DataLoader workers (issue 11, part 2).

`StreamingJsonl(path).map(tokenize).batch(16, collate=PadCollate(...))` with
``DataLoader(batch_size=None, collate_fn=as_list)``: the main process receives only tensors
(through shared memory), each record once per epoch, and a StatefulDataLoader state taken after
a few batches resumes with exactly the batches the uninterrupted run had.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch
from resume_contract import checkpoint
from torch.utils.data import DataLoader, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import LengthBuckets, PadCollate, StreamingJsonl, as_list
from streamds.handover import shm_ring

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

FILES, PER_FILE, BATCH = 4, 50, 16
RECORDS = FILES * PER_FILE
PAD = 0


def words_of(record_id: int) -> list[int]:
    """The token ids record `record_id` holds: 1 to 40 of them, none equal to PAD."""
    return [1 + (record_id * 31 + j * 17) % 97 for j in range(1 + record_id * 7919 % 40)]


def tokenize(record: dict[str, Any]) -> dict[str, Any]:
    """Whitespace tokenizer: "w12 w5" -> [12, 5] (module level, so workers can pickle it)."""
    input_ids = [int(word[1:]) for word in record["text"].split()]
    return {"id": record["id"], "input_ids": input_ids, "length": len(input_ids)}


class WorkerPad(PadCollate):
    """PadCollate that also says which worker made the batch (-1: the main process)."""

    def __call__(self, records: Any) -> dict[str, Any]:
        batch = super().__call__(records)
        info = get_worker_info()
        batch["made_by"] = -1 if info is None else info.id
        return batch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tensors")
    for part in range(FILES):
        lines = []
        for record_id in range(part * PER_FILE, (part + 1) * PER_FILE):
            text = " ".join(f"w{token}" for token in words_of(record_id))
            lines.append(json.dumps({"id": record_id, "text": text}) + "\n")
        (directory / f"part-{part}.jsonl").write_text("".join(lines))
    return directory


def dataset(
    corpus: Path, *, shuffle: bool = False, dtype: torch.dtype = torch.int64
) -> StreamingJsonl:
    ds = StreamingJsonl(str(corpus), shuffle=shuffle, seed=5, buffer_size=32)
    collate = WorkerPad(PAD, keys=("input_ids",), dtype=dtype, lengths=True)
    return ds.map(tokenize).batch(BATCH, collate=collate)


def summary(batches: Iterable[dict[str, Any]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(ids, lengths) of each batch: what the resume check compares."""
    return [(tuple(b["id"].tolist()), tuple(b["length"].tolist())) for b in batches]


@pytest.mark.parametrize(("num_workers", "dtype", "ring"),
                         [(0, torch.int64, True), (2, torch.int64, True), (2, torch.int32, True),
                          (2, torch.int64, False)])
def test_workers_send_padded_tensors_each_record_once(
    corpus: Path, num_workers: int, dtype: torch.dtype, ring: bool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    if not ring or not os.path.isdir(shm_ring.SHM_DIR):
        monkeypatch.setattr(shm_ring, "SHM_DIR", str(tmp_path / "no-shm"))  # workers fork with it
        ring = False
    loader = DataLoader(dataset(corpus, dtype=dtype), batch_size=None,
                        num_workers=num_workers, collate_fn=as_list,
                        multiprocessing_context="fork" if num_workers else None)
    seen: list[int] = []
    makers = set()
    before = shm_ring.batches_taken()
    batches = 0
    for batch in loader:
        batches += 1
        assert type(batch) is dict, f"got {type(batch).__name__}, not a collated batch"
        ids, mask, lengths = batch["input_ids"], batch["attention_mask"], batch["lengths"]
        assert ids.dtype == mask.dtype == lengths.dtype == dtype
        assert lengths.tolist() == batch["length"].tolist()  # the tokenizer's own count
        assert ids.shape == mask.shape and ids.shape[0] == len(lengths) <= BATCH
        assert ids.shape[1] == int(lengths.max())  # padded to the longest, no wider
        assert mask.sum(dim=1).tolist() == lengths.tolist()
        # tensors made in a worker come over in shared memory, not pickled through the pipe:
        # copied out of the worker's ring, else in shared storage of their own (torch's way)
        assert all(t.is_shared() == (num_workers > 0 and not ring) for t in (ids, mask, lengths))
        for row, record_id in enumerate(batch["id"].tolist()):
            want = words_of(record_id)
            assert lengths[row] == len(want)
            assert ids[row, : len(want)].tolist() == want
            assert ids[row, len(want):].eq(PAD).all() and mask[row, len(want):].eq(0).all()
        seen += batch["id"].tolist()
        makers.add(batch["made_by"])
    assert sorted(seen) == list(range(RECORDS))
    assert makers == ({-1} if num_workers == 0 else set(range(num_workers)))
    assert shm_ring.batches_taken() - before == (batches if num_workers and ring else 0)


@pytest.mark.parametrize("cut", [1, 3, 6])
def test_a_state_after_some_batches_resumes_exactly(corpus: Path, cut: int) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(dataset(corpus, shuffle=True), batch_size=None,
                                  num_workers=2, collate_fn=as_list)

    reference = summary(make())
    assert sorted(i for ids, _ in reference for i in ids) == list(range(RECORDS))
    first = make()
    iterator = iter(first)
    prefix = summary(islice(iterator, cut))
    state = checkpoint(first.state_dict())
    del iterator, first
    fresh = make()
    fresh.load_state_dict(state)
    rest = summary(fresh)
    assert rest, "nothing left after the cut: the test would pass without resuming"
    assert prefix + rest == reference


def test_length_buckets_of_tensors_cross_in_shared_memory_every_epoch(corpus: Path) -> None:
    """The pool stage's batches, torch's default conversion (no collate_fn), workers kept
    between epochs: every record once per epoch, every batch through a worker's ring."""
    ds = StreamingJsonl(str(corpus), shuffle=True, seed=5, buffer_size=32).map(tokenize)
    ds = ds.batch(LengthBuckets(BATCH, buffer_size=64),
                  collate=PadCollate(PAD, keys=("input_ids",)))
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    for _ in range(2):  # the same workers, the same rings (set_epoch would not reach them)
        before = shm_ring.batches_taken()
        batches = list(loader)
        assert all(type(b) is dict for b in batches)
        assert sorted(i for b in batches for i in b["id"].tolist()) == list(range(RECORDS))
        for b in batches:
            for row, record_id in enumerate(b["id"].tolist()):
                want = words_of(record_id)
                assert b["input_ids"][row, : len(want)].tolist() == want
        if os.path.isdir(shm_ring.SHM_DIR):
            assert shm_ring.batches_taken() - before == len(batches)
