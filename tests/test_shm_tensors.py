"""`streamds.train.shm_tensors`: a collate's dict of tensors leaves a DataLoader worker through
the worker's shared-memory ring and arrives as a plain dict equal to what torch's own pickling
would have delivered; what the ring cannot carry exactly takes torch's way."""

from __future__ import annotations

import copy
import os
import pickle
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from streamds.train import shm_ring, shm_tensors
from streamds.train.shm_tensors import TensorBatch, leave_as_tensor_batches

pytestmark = pytest.mark.skipif(not os.path.isdir(shm_ring.SHM_DIR), reason="no /dev/shm here")


@pytest.fixture
def in_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pickling as a DataLoader worker does (the entry is then read back in this process)."""
    monkeypatch.setattr(shm_tensors, "get_worker_info", lambda: SimpleNamespace(id=0))


def crossed(batch: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The batch pickled as a worker's result queue does and unpickled, and how many ring
    entries that wrote."""
    writer = shm_ring._writer if shm_ring._writer_pid == os.getpid() else None
    before = writer.seq if writer is not None else 0
    data = ForkingPickler.dumps(TensorBatch(batch))
    writer = shm_ring._writer if shm_ring._writer_pid == os.getpid() else None
    written = (writer.seq if writer is not None else 0) - before
    return pickle.loads(data), written


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert type(got) is dict and list(got) == list(want)  # a plain dict, keys in order
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert type(got[key]) is torch.Tensor, key
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert got[key].requires_grad == value.requires_grad, key
            assert torch.equal(got[key].detach(), value.detach()), key
        else:
            assert got[key] == value, key


def test_tensors_of_every_kind_cross_in_the_ring(in_a_worker: None) -> None:
    ids = torch.randint(0, 30_000, (16, 512), dtype=torch.int64)
    batch = {
        "input_ids": ids,
        "attention_mask": (ids > 100).to(torch.int32),
        "flags": ids > 15_000,  # bool
        "scores": torch.randn(16, dtype=torch.float16),
        "step": torch.tensor(7),  # 0-d
        "nothing": torch.empty(0, 5, dtype=torch.int64),
        "id": list(range(16)),  # not a tensor: pickled alongside
        "source": "pubmed",
    }
    got, written = crossed(batch)
    assert written == 1  # one entry for all the tensors
    assert_same(got, batch)
    ids[0, 0] = -1  # the main process holds copies, not the worker's memory
    assert got["input_ids"][0, 0] != -1


def test_what_the_ring_cannot_carry_exactly_goes_torchs_way(in_a_worker: None) -> None:
    ids = torch.arange(64, dtype=torch.int64).reshape(8, 8)
    leaf = torch.ones(3, requires_grad=True)
    batch = {"ids": ids, "transposed": ids[:4].t(), "grad": leaf, "row": ids[1].clone()}
    got, written = crossed(batch)
    assert written == 0  # the transposed view shares ids' memory: all of it goes torch's way
    assert_same(got, batch)
    assert got["transposed"].data_ptr() == got["ids"].data_ptr()  # sharing kept

    batch = {"ids": ids, "grad": leaf, "tail": torch.arange(10)[2:]}
    got, written = crossed(batch)
    assert written == 1  # ids in the ring; the autograd leaf and the offset view torch's way
    assert_same(got, batch)


def test_outside_a_worker_a_tensor_batch_pickles_as_a_dict() -> None:
    batch = TensorBatch({"ids": torch.arange(4), "n": 4})
    back = pickle.loads(pickle.dumps(batch))
    assert type(back) is dict and torch.equal(back["ids"], batch["ids"]) and back["n"] == 4
    assert type(copy.copy(batch)) is TensorBatch  # torch's default_convert copies mappings
    assert copy.copy(batch) == batch


def test_only_dicts_become_tensor_batches() -> None:
    def collate(records: list[Any]) -> Any:
        return records[0]

    wrapped = leave_as_tensor_batches(collate)
    assert type(wrapped([{"a": 1}])) is TensorBatch
    assert type(wrapped([[1, 2]])) is list
    assert type(wrapped([OrderedDict(a=1)])) is OrderedDict  # a subclass stays what it is
