"""DevicePrefetcher: CPU pass-through, nesting, exhaustion, state; move_to; the look-ahead.

The look-ahead (CUDA) path runs on CPU too, with torch.cuda's streams replaced by logging
fakes: order, one batch ahead and no more, the stream wait, the state of the handed batch,
errors and early close. The copies and pinning themselves need CUDA (skipped without it).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict, namedtuple
from collections.abc import Iterator

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinning needs it too)")
def test_cuda_pins_unpinned_batches_and_copies_every_tensor():
    batches = [{"x": torch.arange(1 << 16) + i, "y": [torch.full((3,), i)]} for i in range(4)]
    assert not batches[0]["x"].is_pinned()  # the prefetcher pins it on the training thread
    out = list(DevicePrefetcher(batches, "cuda"))
    assert all(b["x"].is_cuda and b["y"][0].is_cuda for b in out)
    for got, expected in zip(out, batches, strict=True):
        assert torch.equal(got["x"].cpu(), expected["x"])
        assert torch.equal(got["y"][0].cpu(), expected["y"][0])


# -- the look-ahead, on CPU: the CUDA calls replaced by fakes that log -------------------------
#
# On CPU the prefetcher passes batches through (nothing to copy, so nothing to overlap). Its
# work is the CUDA path: read batch k+1 before handing over batch k, make the caller's stream
# wait for the copy, report the state of the handed batch. That logic runs on CPU when
# torch.cuda's streams are fakes and the batches hold no tensors (tensors stay as they are
# without a CUDA copy, see `_apply`); the copies themselves are the CUDA test's above.


class FakeStream:
    """A stream that logs `wait_stream` calls into the test's event log."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.cuda with logging fake streams; yields the event log the fakes write to."""
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream("copy", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: FakeStream("compute", log))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return log


class Source:
    """An iterable of batches 0..count-1 that logs each request; raises at `fail_at`."""

    def __init__(self, count: int, log: list[str], fail_at: int | None = None) -> None:
        self.count = count
        self.log = log
        self.fail_at = fail_at
        self.closed = 0

    def __iter__(self) -> Iterator[int]:
        try:
            for i in range(self.count):
                if i == self.fail_at:
                    raise OSError(f"batch {i} is unreadable")
                self.log.append(f"read {i}")
                yield i
        finally:
            self.closed += 1


def test_cuda_path_reads_exactly_one_batch_ahead_in_order(fake_cuda):
    log = fake_cuda
    source = Source(4, log)
    for batch in DevicePrefetcher(source, "cuda"):
        log.append(f"hand {batch}")
    # batch k+1 is requested (and its copy issued) before batch k is handed over, never
    # further: one batch in flight; the caller's stream waits for the copy each time
    wait = "compute waits for copy"
    assert log == [
        "read 0",
        wait, "read 1", "hand 0",
        wait, "read 2", "hand 1",
        wait, "read 3", "hand 2",
        wait, "hand 3",
    ]
    assert source.closed == 1


def test_cuda_path_state_is_the_handed_batchs_not_the_loaders(fake_cuda):
    loader = StatefulDataLoader(list(range(6)), batch_size=None)
    prefetcher = DevicePrefetcher(loader, "cuda")
    iterator = iter(prefetcher)
    assert [next(iterator), next(iterator)] == [0, 1]
    state = prefetcher.state_dict()
    assert prefetcher.state_dict() != loader.state_dict()  # the loader is one batch further
    fresh = StatefulDataLoader(list(range(6)), batch_size=None)
    fresh.load_state_dict(state)
    assert list(fresh) == [2, 3, 4, 5]  # nothing lost, nothing twice
    assert list(iterator) == [2, 3, 4, 5]


def test_cuda_path_closing_early_closes_the_loaders_iterator(fake_cuda):
    log = fake_cuda
    source = Source(10, log)
    iterator = iter(DevicePrefetcher(source, "cuda"))
    assert next(iterator) == 0
    iterator.close()
    assert source.closed == 1
    assert [e for e in log if e.startswith("read")] == ["read 0", "read 1"]  # no more


def test_cuda_path_passes_the_loaders_error_on(fake_cuda):
    source = Source(5, fake_cuda, fail_at=3)
    got = []
    with pytest.raises(OSError, match="batch 3 is unreadable"):
        for batch in DevicePrefetcher(source, "cuda"):
            got.append(batch)
    assert got[:2] == [0, 1]


def test_cuda_path_hands_over_the_batches_read_before_a_loader_error(fake_cuda):
    loader = StatefulDataLoader(Failing(5, fail_at=3), batch_size=None)
    prefetcher = DevicePrefetcher(loader, "cuda")
    got = []
    with pytest.raises(OSError, match="batch 3 is unreadable"):
        for batch in prefetcher:
            got.append(int(batch))
    assert got == [0, 1, 2]  # every batch the loader gave came out before its error
    fresh = StatefulDataLoader(Failing(5, fail_at=None), batch_size=None)
    fresh.load_state_dict(prefetcher.state_dict())
    assert [int(b) for b in fresh] == [3, 4]  # a resume after the error loses nothing


def test_cuda_path_an_interrupt_leaves_at_once_and_counts_no_batch_not_handed(fake_cuda):
    loader = StatefulDataLoader(Failing(5, fail_at=3, error=KeyboardInterrupt),
                                batch_size=None)
    prefetcher = DevicePrefetcher(loader, "cuda")
    got = []
    with pytest.raises(KeyboardInterrupt):
        for batch in prefetcher:
            got.append(int(batch))
    assert got == [0, 1]  # batch 2 was in flight when the interrupt came: not handed over
    fresh = StatefulDataLoader(Failing(5, fail_at=None), batch_size=None)
    fresh.load_state_dict(prefetcher.state_dict())
    assert [int(b) for b in fresh] == [2, 3, 4]  # ... so not counted either


class Failing(torch.utils.data.IterableDataset):
    """Batches 0..count-1 with the one at `fail_at` unreadable (raising `error`)."""

    def __init__(self, count: int, fail_at: int | None,
                 error: type[BaseException] = OSError) -> None:
        self.count = count
        self.fail_at = fail_at
        self.error = error

    def __iter__(self) -> Iterator[int]:
        for i in range(self.count):
            if i == self.fail_at:
                raise self.error(f"batch {i} is unreadable")
            yield i


def test_cpu_path_is_a_pass_through_that_reads_nothing_ahead():
    # documented: on CPU nothing is copied, so nothing is read ahead either (a read ahead would
    # only hold a batch longer)
    log: list[str] = []
    source = Source(3, log)
    for batch in DevicePrefetcher(source, "cpu"):
        log.append(f"hand {batch}")
    assert log == ["read 0", "hand 0", "read 1", "hand 1", "read 2", "hand 2"]
