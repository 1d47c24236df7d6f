"""DevicePrefetcher on CPU: pass-through, nesting, exhaustion, state; move_to; CUDA if present."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds.train.prefetch import DevicePrefetcher, move_to

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

Pair = namedtuple("Pair", "x y")


def nested(i: int):
    return {
        "ids": torch.full((2, 3), i),
        "meta": ["a", i],
        "pair": Pair(torch.tensor([i]), (torch.tensor(i * 1.0), "s")),
        "ordered": OrderedDict(t=torch.arange(i + 1)),
    }


def test_cpu_passes_batches_through_unchanged():
    batches = [nested(i) for i in range(3)]
    out = list(DevicePrefetcher(batches, "cpu"))
    assert len(out) == 3
    for got, expected in zip(out, batches, strict=True):
        assert got is expected  # nothing copied, nothing rebuilt


def test_exhaustion_and_reiteration():
    prefetcher = DevicePrefetcher([1, 2], "cpu")
    iterator = iter(prefetcher)
    assert [next(iterator), next(iterator)] == [1, 2]
    with pytest.raises(StopIteration):
        next(iterator)
    assert list(prefetcher) == [1, 2]  # each iter() is a new pass
    assert list(DevicePrefetcher([], "cpu")) == []


def test_move_to_rebuilds_nested_containers():
    batch = nested(2)
    moved = move_to(batch, "meta")
    assert moved["ids"].device.type == "meta" and moved["ids"].shape == (2, 3)
    assert moved["meta"] == ["a", 2]
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].x.device.type == "meta"
    assert moved["pair"].y[0].device.type == "meta" and moved["pair"].y[1] == "s"
    assert isinstance(moved["ordered"], OrderedDict)
    assert moved["ordered"]["t"].device.type == "meta"
    assert batch["ids"].device.type == "cpu"  # the original is untouched


def test_other_devices_move_every_tensor():
    out = list(DevicePrefetcher([nested(0), nested(1)], "meta"))
    assert [b["ids"].device.type for b in out] == ["meta", "meta"]
    assert out[1]["meta"] == ["a", 1]


def test_with_a_dataloader_and_state_passthrough():
    loader = StatefulDataLoader(list(range(10)), batch_size=3)
    prefetcher = DevicePrefetcher(loader, "cpu")
    iterator = iter(prefetcher)
    first = next(iterator)
    assert first.tolist() == [0, 1, 2]
    state = prefetcher.state_dict()
    resumed = DevicePrefetcher(StatefulDataLoader(list(range(10)), batch_size=3), "cpu")
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[3, 4, 5], [6, 7, 8], [9]]
    assert len(DevicePrefetcher(DataLoader(list(range(10)), batch_size=3), "cpu")) == 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="loader must be iterable"):
        DevicePrefetcher(3, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            DevicePrefetcher([], "cuda")
    with pytest.raises(TypeError, match="no load_state_dict"):
        DevicePrefetcher([], "cpu").load_state_dict({})
    assert DevicePrefetcher([]).device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_ahead_and_keeps_state_of_the_handed_batch():
    loader = StatefulDataLoader([torch.full((4,), i) for i in range(6)], batch_size=None,
                                pin_memory=True)
    prefetcher = DevicePrefetcher(loader, "cuda")
    iterator = iter(prefetcher)
    first = next(iterator)
    assert first.is_cuda and first.tolist() == [0] * 4
    state = prefetcher.state_dict()  # the loader itself is already one batch further
    rest = [b.cpu().tolist() for b in iterator]
    assert rest == [[i] * 4 for i in range(1, 6)]
    fresh = StatefulDataLoader([torch.full((4,), i) for i in range(6)], batch_size=None)
    fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh] == rest
