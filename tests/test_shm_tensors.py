"""`streamds.handover.shm_tensors`: a collate's dict of tensors leaves a DataLoader worker through
the worker's shared-memory ring and arrives as a plain dict equal to what torch's own pickling
would have delivered; what the ring cannot carry exactly takes torch's way."""

from __future__ import annotations

import copy
import io
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from streamds.handover import shm_ring, shm_tensors
from streamds.handover.shm_tensors import TensorBatch, leave_as_tensor_batches
from streamds.stages.batch import RecordBatch

pytestmark = [
    pytest.mark.skipif(not os.path.isdir(shm_ring.SHM_DIR), reason="no /dev/shm here"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
]


@pytest.fixture
def in_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pickling as a DataLoader worker does (the entry is then read back in this process)."""
    monkeypatch.setattr(shm_tensors, "get_worker_info", lambda: SimpleNamespace(id=0))


def entries_written() -> int:
    writer = shm_ring._writer if shm_ring._writer_pid == os.getpid() else None
    return 0 if writer is None else writer.seq


def crossed(batch: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The batch pickled as a worker's result queue does (multiprocessing's ForkingPickler)
    and unpickled, and how many ring entries that wrote."""
    before = entries_written()
    data = ForkingPickler.dumps(TensorBatch(batch))
    written = entries_written() - before
    return pickle.loads(data), written


def torchs_way(batch: dict[str, Any]) -> dict[str, Any]:
    return pickle.loads(ForkingPickler.dumps(batch))


def assert_same(got: Any, want: Any, where: str = "batch") -> None:
    """Equal values, types, dtypes, shapes and strides (torch's pickling keeps strides)."""
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.is_nested == want.is_nested, where
        assert got.layout == want.layout and got.device == want.device, where
        assert got.requires_grad == want.requires_grad, where
        if want.is_nested:
            for a, b in zip(got.unbind(), want.unbind(), strict=True):
                assert_same(a, b, where)
            return
        assert got.shape == want.shape, where
        if want.layout == torch.strided:
            assert got.stride() == want.stride(), where
        assert torch.equal(got.detach().to_dense(), want.detach().to_dense()), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where  # keys in order
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def test_tensors_of_every_kind_cross_in_the_ring(in_a_worker: None) -> None:
    ids = torch.randint(0, 30_000, (16, 512), dtype=torch.int64)
    batch = {
        "input_ids": ids,
        "attention_mask": (ids > 100).to(torch.int32),
        "flags": ids > 15_000,  # bool
        "scores": torch.randn(16, dtype=torch.float16),
        "logits": torch.randn(4, 3, dtype=torch.bfloat16),
        "phase": torch.randn(5, dtype=torch.complex64),
        "tiny": torch.randn(6).to(torch.float8_e4m3fn),
        "column": torch.arange(4).reshape(4, 1).t(),  # contiguous, strides (1, 1)
        "step": torch.tensor(7),  # 0-d
        "nothing": torch.empty(0, 5, dtype=torch.int64),
        "id": list(range(16)),  # not tensors: pickled alongside
        "meta": {"source": "pubmed", "split": ("train", 3)},
    }
    got, written = crossed(batch)
    assert written == 1  # one entry for all the tensors
    assert_same(got, batch)
    assert got["tiny"].view(torch.uint8).tolist() == batch["tiny"].view(torch.uint8).tolist()
    ids[0, 0] = -1  # the main process holds copies, not the worker's memory
    assert got["input_ids"][0, 0] != -1


@pytest.mark.parametrize("case", ["view", "grad", "aliased", "nested list", "nested dict",
                                  "sparse", "csr", "nested tensor", "ring inside"])
def test_what_the_ring_cannot_carry_exactly_goes_torchs_way(in_a_worker: None, case: str) -> None:
    ids = torch.arange(64, dtype=torch.int64).reshape(8, 8)
    other: Any = {
        "view": torch.arange(10)[2:],  # does not own its storage
        "grad": torch.ones(3, requires_grad=True),
        "aliased": ids.view(64),  # the same memory as ids under another key
        "nested list": [ids],  # ... or inside a container
        "nested dict": {"row": ids[2]},
        "sparse": torch.eye(3).to_sparse(),
        "csr": torch.eye(3).to_sparse_csr(),
        "nested tensor": torch.nested.nested_tensor([torch.arange(2), torch.arange(3)]),
        "ring inside": TensorBatch({"x": torch.arange(3)}),  # sent after the outer batch
    }[case]
    batch = {"ids": ids, "other": other}
    got, written = crossed(batch)
    assert written == (1 if case == "ring inside" else 0)  # the outer batch: not in the ring
    want = torchs_way(batch)
    assert_same(got, want)
    if case == "aliased":
        assert got["other"].data_ptr() == got["ids"].data_ptr()  # the sharing is kept
    if case == "nested list":
        assert got["other"][0] is got["ids"]


def test_no_default_device_moves_the_copies(in_a_worker: None) -> None:
    data = ForkingPickler.dumps(TensorBatch({"ids": torch.arange(6).reshape(2, 3)}))
    with torch.device("meta"):  # a main process that set a default device
        got = pickle.loads(data)
    assert got["ids"].device.type == "cpu" and got["ids"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_batch_too_big_for_the_ring_goes_torchs_way(
    in_a_worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm_ring, "_writer", None)  # a fresh worker, with a ring of 64 KiB
    monkeypatch.setattr(shm_ring, "_writer_pid", 0)
    monkeypatch.setattr(shm_ring, "MIN_SIZE", 1 << 16)
    monkeypatch.setattr(shm_ring, "MAX_SIZE", 1 << 16)
    small, written = crossed({"ids": torch.arange(100)})
    assert written == 1 and small["ids"].tolist() == list(range(100))
    big, written = crossed({"ids": torch.arange(10_000)})  # 80 KB
    assert written == 0 and big["ids"].tolist() == list(range(10_000))
    shm_ring._writer.close()


def test_other_pickling_in_a_worker_sees_a_plain_dict(in_a_worker: None) -> None:
    batch = TensorBatch({"ids": torch.arange(4), "n": 4})
    before = entries_written()
    saved = io.BytesIO()
    torch.save(batch, saved)
    for back in (pickle.loads(pickle.dumps(batch)), copy.deepcopy(batch),
                 torch.load(io.BytesIO(saved.getvalue()), weights_only=False)):
        assert type(back) is dict and back["ids"].tolist() == [0, 1, 2, 3] and back["n"] == 4
    assert entries_written() == before  # nothing in the ring: the bytes stand alone
    assert type(copy.copy(batch)) is TensorBatch  # torch's default_convert copies mappings


def test_outside_a_worker_a_tensor_batch_pickles_as_a_dict() -> None:
    batch = TensorBatch({"ids": torch.arange(4), "n": 4})
    before = entries_written()
    for back in (pickle.loads(pickle.dumps(batch)), torchs_way(batch)):
        assert type(back) is dict and back["ids"].tolist() == [0, 1, 2, 3] and back["n"] == 4
    assert entries_written() == before


def test_only_dicts_become_tensor_batches() -> None:
    def first(records: list[Any]) -> Any:
        return records[0]

    wrapped = leave_as_tensor_batches(first)
    assert type(wrapped([{"a": 1}])) is TensorBatch
    assert type(wrapped([[1, 2]])) is list
    assert type(wrapped([OrderedDict(a=1)])) is OrderedDict  # a subclass stays what it is


class Holders(IterableDataset):
    """Batches that hold other batches, as code wrapping the dataset in a worker may make."""

    def __iter__(self) -> Iterator[Any]:
        for i in range(6):
            inner = TensorBatch({"x": torch.full((3,), i)})
            records = RecordBatch([{"id": i}])
            yield TensorBatch({"ids": torch.arange(i, i + 4), "inner": inner,
                               "records": records})


def test_batches_inside_batches_reach_the_main_process() -> None:
    got = list(DataLoader(Holders(), batch_size=None, num_workers=1))
    assert [b["ids"].tolist() for b in got] == [list(range(i, i + 4)) for i in range(6)]
    assert [b["inner"]["x"].tolist() for b in got] == [[i] * 3 for i in range(6)]
    assert [list(b["records"]) for b in got] == [[{"id": i}] for i in range(6)]
