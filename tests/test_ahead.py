"""`streamds.stages.ahead`: a worker's batches made in a thread ahead of the loader's requests
come out all, in order, each with the state after it (never after the batches made ahead); errors
arrive in order; closing stops the thread and the pipeline; a StatefulDataLoader whose
workers make batches ahead resumes exactly after any batch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import corpus
import pytest
from resume_contract import run_test_save_load_state
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import streamds.stages.pipeline
from streamds import StreamingJsonl, counts_of
from streamds.stages.ahead import MadeAhead

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

WAIT = 30.0  # seconds an event may take to come (a bound for a hung test, not a pacing sleep)


class Source:
    """Items 0..count-1; `made[k]` is set once item k has been made; `made_so_far` is the
    state, and -1 once the items ran out; raises at `fail_at`; `closed` is set when the
    generator is closed."""

    def __init__(self, count: int, fail_at: int | None = None) -> None:
        self.count = count
        self.fail_at = fail_at
        self.made = [threading.Event() for _ in range(count)]
        self.made_so_far = 0
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[int]:
        try:
            for k in range(self.count):
                if k == self.fail_at:
                    raise ValueError(f"broken at {k}")
                self.made_so_far = k + 1
                self.made[k].set()
                yield k
            self.made_so_far = -1  # the end: a state of its own, as a finished reader's
        finally:
            self.closed.set()


def test_items_come_out_in_order_each_with_the_state_after_it() -> None:
    source = Source(20)
    ahead = MadeAhead(source, 3, lambda: source.made_so_far, state_at_start=0)
    assert ahead.state == 0
    items = iter(ahead)
    assert next(items) == 0
    # the thread goes on: item 0 out, 3 waiting in the queue, the 5th made
    assert source.made[4].wait(WAIT)
    assert ahead.state == 1  # the state after item 0, not after the ones made ahead
    rest = []
    for item in items:
        rest.append(item)
        assert ahead.state == item + 1
    assert rest == list(range(1, 20))
    assert ahead.state == -1  # once the end is met: the state at the end


def test_an_error_arrives_after_the_items_made_before_it() -> None:
    source = Source(10, fail_at=6)
    ahead = MadeAhead(source, 2, lambda: source.made_so_far, state_at_start=0)
    got = []
    with pytest.raises(ValueError, match="broken at 6"):
        for item in ahead:
            got.append(item)
    assert got == [0, 1, 2, 3, 4, 5]
    assert ahead.state == 6


def test_closing_stops_the_thread_and_closes_the_pipeline() -> None:
    source = Source(1000)
    ahead = MadeAhead(source, 2, lambda: source.made_so_far, state_at_start=0)
    items = iter(ahead)
    assert next(items) == 0
    assert source.made[3].wait(WAIT)  # the thread waits with a full queue
    items.close()
    assert source.closed.wait(WAIT)
    assert source.made_so_far < 1000
    for thread in threading.enumerate():
        if thread.name == "streamds-batches-ahead":
            thread.join(WAIT)
            assert not thread.is_alive()


@pytest.fixture(scope="module")
def lines_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ahead")
    corpus.write_plain(directory / "a.jsonl", corpus.jsonl(corpus.make_records(300)))
    corpus.write_seekable_zst(directory / "b.jsonl.zst",
                              corpus.jsonl(corpus.make_records(200, start=1000)))
    return directory


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_a_loader_whose_workers_make_batches_ahead_resumes_exactly(
    lines_dir: Path, shuffle: bool
) -> None:
    def make() -> StatefulDataLoader:
        ds = StreamingJsonl(str(lines_dir), shuffle=shuffle, seed=3, buffer_size=40)
        return StatefulDataLoader(ds.batch(7, ahead=3), batch_size=None, num_workers=2)

    reference = run_test_save_load_state(make, [0, 1, 5, 20, 40])
    ids = sorted(record["id"] for batch in reference for record in batch)
    assert ids == sorted([*range(300), *range(1000, 1200)])


def test_persistent_workers_start_each_epoch_afresh(lines_dir: Path) -> None:
    """A new epoch in the same workers: the old epoch's thread stops, the new one reads
    every record once."""
    ds = StreamingJsonl(str(lines_dir), shuffle=True, seed=5, buffer_size=30).batch(9, ahead=3)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    every = sorted([*range(300), *range(1000, 1200)])
    for _ in range(3):
        assert sorted(r["id"] for batch in loader for r in batch) == every
    first = iter(loader)  # an epoch left after one batch, then a whole one
    next(first)
    assert sorted(r["id"] for batch in loader for r in batch) == every


@pytest.mark.parametrize("tail", [0, 3], ids=["last-batch-full", "short-batch-dropped"])
def test_the_state_at_the_end_is_the_end_not_the_last_batch(
    tmp_path: Path, tail: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the last batch handed out come blank lines or a short batch dropped: the state a
    worker's dataset gives once its iterator ended says finished and counts them, as it does
    without batches made ahead."""
    path = tmp_path / "ends-blank.jsonl"
    path.write_bytes(corpus.jsonl(corpus.make_records(70 + tail)) + b"\n\n  \n")
    worker = SimpleNamespace(id=0, num_workers=1, seed=0, dataset=None)
    monkeypatch.setattr(streamds.stages.pipeline, "get_worker_info", lambda: worker)

    def epoch(ahead: int) -> tuple[list[int], dict[str, Any]]:
        ds = StreamingJsonl(str(path)).batch(7, ahead=ahead, drop_last=True, worker_cpus="all")
        got = [r["id"] for batch in ds for r in batch]
        return got, ds.state_dict()

    got, state = epoch(2)
    assert (got, state) == epoch(0)
    assert got == list(range(70))
    assert state["finished"] and counts_of(state)["blank"] == 3


def test_ahead_is_checked(lines_dir: Path) -> None:
    with pytest.raises(ValueError, match="ahead"):
        StreamingJsonl(str(lines_dir)).batch(4, ahead=-1)
    with pytest.raises(ValueError, match="ahead"):
        StreamingJsonl(str(lines_dir)).batch(4, ahead="more")


def thread_of_batch(records: list[Any]) -> str:
    return threading.current_thread().name


@pytest.mark.parametrize(("quota", "thread"), [(None, "streamds-batches-ahead"),
                                               (1.5, "MainThread")])
def test_auto_makes_batches_ahead_on_crowded_cpus_but_not_under_a_cpu_quota(
    lines_dir: Path, monkeypatch: pytest.MonkeyPatch, quota: float | None, thread: str
) -> None:
    """2 workers and the main process on 2 CPUs take turns (TUNE): "auto" makes batches in the
    thread. Under a container's quota of 1.5 CPUs the plan is KEEP, and it makes none."""
    import os

    import streamds.stages.cpus as cpus

    worker = SimpleNamespace(id=0, num_workers=2, seed=0, dataset=None)
    monkeypatch.setattr(streamds.stages.pipeline, "get_worker_info", lambda: worker)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cpus, "_STARTED_ON", None)
    monkeypatch.setattr(cpus, "cpu_quota", lambda: quota)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    ds = StreamingJsonl(str(lines_dir)).batch(4, collate=thread_of_batch)
    assert set(ds) == {thread}
