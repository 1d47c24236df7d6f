"""Which CPUs DataLoader workers run on (`streamds.cpus`): the plan, the tuning stage with a
fake clock, and real workers keeping a CPU free for the main process."""

from __future__ import annotations

import os

import orjson
import pytest
from torch.utils.data import DataLoader

from streamds import StreamingJsonl
from streamds.cpus import (
    FIT,
    KEEP,
    MARGIN,
    PHASE,
    RETUNE,
    TUNE,
    WARM_UP,
    CpuPlan,
    TuneCpus,
    plan_cpus,
)


def test_workers_that_fit_beside_the_main_process_keep_its_cpu_free():
    plan = plan_cpus(workers=1, local_processes=1, every={4, 5})
    assert (plan.how, plan.main, plan.spare) == (FIT, {4}, {5})
    plan = plan_cpus(workers=1, local_processes=2, every=range(4))  # 2 x (1 + 1) <= 4
    assert (plan.how, plan.main, plan.spare) == (FIT, {0, 1}, {2, 3})


def test_more_processes_than_cpus_are_tuned_and_one_cpu_is_kept_as_it_is():
    assert plan_cpus(workers=2, local_processes=1, every={0, 1}).how == TUNE
    assert plan_cpus(workers=1, local_processes=2, every={0, 1, 2}).how == TUNE
    assert plan_cpus(workers=4, local_processes=1, every={0}).how == KEEP
    assert plan_cpus(workers=1, local_processes=2, every={0, 1}).how == KEEP  # no CPU to spare


class FakeCpus:
    """A clock that moves `seconds[cpus]` per item taken, and the CPUs applied last."""

    def __init__(self, seconds: dict[frozenset[int], float], start: frozenset[int]) -> None:
        self.seconds = seconds
        self.now = 0.0
        self.cpus = start
        self.applied: list[frozenset[int]] = []

    def clock(self) -> float:
        return self.now

    def apply(self, cpus: frozenset[int]) -> None:
        self.cpus = cpus
        self.applied.append(cpus)

    def items(self, count: int):
        for item in range(count):
            self.now += self.seconds[self.cpus]
            yield item


EVERY, SPARE = frozenset({0, 1}), frozenset({1})
PLAN = CpuPlan(TUNE, EVERY, frozenset({0}))


def tuned(seconds: dict[frozenset[int], float], count: int) -> tuple[list, TuneCpus, FakeCpus]:
    fake = FakeCpus(seconds, EVERY)
    stage = TuneCpus(fake.items(count), PLAN, clock=fake.clock, apply=fake.apply)
    return list(stage), stage, fake


@pytest.mark.parametrize(("every", "spare", "chosen"), [
    (0.010, 0.008, SPARE),  # keeping a CPU free is faster: kept
    (0.008, 0.010, EVERY),  # slower: every CPU
    (0.010, 0.010 / (MARGIN - 0.01), EVERY),  # faster by less than the margin: every CPU
])
def test_tuning_keeps_the_faster_set_and_hands_out_every_item_once_in_order(every, spare,
                                                                            chosen):
    count = 2_000
    items, stage, fake = tuned({EVERY: every, SPARE: spare}, count)
    assert items == list(range(count))
    assert stage.chosen[0] == chosen
    # warm-up on what the process had, then phases every / spare / spare / every
    assert fake.applied[:5] == [EVERY, SPARE, SPARE, EVERY, chosen]


def test_tuning_measures_again_and_follows_a_change():
    fake = FakeCpus({EVERY: 0.010, SPARE: 0.008}, EVERY)
    stage = TuneCpus(fake.items(30_000), PLAN, clock=fake.clock, apply=fake.apply)
    items = iter(stage)
    first_round = WARM_UP + 4 * PHASE + 0.1
    taken = []
    while fake.now < first_round:
        taken.append(next(items))
    assert stage.chosen == [SPARE]
    fake.seconds = {EVERY: 0.008, SPARE: 0.010}  # the pipeline changed: now the other way
    taken += items
    assert taken == list(range(30_000))
    assert stage.chosen[:2] == [SPARE, EVERY]
    assert fake.now > first_round + RETUNE  # the second measurement waited RETUNE seconds


def test_tuning_an_input_that_ends_in_any_phase_hands_out_all_of_it():
    for count in range(0, 400, 7):  # 0.01 s an item: ends in the warm-up or in any phase
        items, _, _ = tuned({EVERY: 0.01, SPARE: 0.01}, count)
        assert items == list(range(count))


# -- real DataLoader workers -------------------------------------------------------------------


def cpus_of_this_process(record: dict) -> dict:
    return {**record, "cpus": sorted(os.sched_getaffinity(0))}


needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least 2 CPUs")


@needs_two_cpus
@pytest.mark.parametrize("worker_cpus", ["auto", "all"])
def test_a_worker_that_fits_keeps_off_the_main_process_cpu(tmp_path, monkeypatch, worker_cpus):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"i": i}) + b"\n" for i in range(50)))
    every = sorted(os.sched_getaffinity(0))
    ds = StreamingJsonl(str(path), worker_cpus=worker_cpus).map(cpus_of_this_process)
    records = list(DataLoader(ds, batch_size=None, num_workers=1))
    assert [r["i"] for r in records] == list(range(50))
    seen = {tuple(r["cpus"]) for r in records}
    assert seen == ({tuple(every[1:])} if worker_cpus == "auto" else {tuple(every)})
    assert sorted(os.sched_getaffinity(0)) == every  # the main process is left as it was


def test_worker_cpus_is_checked():
    with pytest.raises(ValueError, match="worker_cpus"):
        StreamingJsonl("x.jsonl", worker_cpus="some")


@needs_two_cpus
def test_workers_that_tune_at_every_item_hand_out_the_same_batches(tmp_path, monkeypatch):
    """More workers than CPUs: they tune. With no warm-up and phases of one item each (no
    timing involved), the workers move between CPU sets all the time; the batches are exactly
    those of worker_cpus="all", in the same order, and some were built on the spare CPUs."""
    import streamds.cpus as cpus

    for name in ("WARM_UP", "PHASE", "RETUNE"):
        monkeypatch.setattr(cpus, name, 0.0)  # the forked workers inherit it
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    path = tmp_path / "a.jsonl"
    text = "x" * 1000  # 64 records a 64 KiB block: the map runs on many chunks
    path.write_bytes(b"".join(orjson.dumps({"i": i, "text": text}) + b"\n" for i in range(3000)))
    every = sorted(os.sched_getaffinity(0))
    workers = len(every)  # workers + 1 > CPUs

    def batches(worker_cpus: str) -> list[list[dict]]:
        ds = StreamingJsonl(str(path), worker_cpus=worker_cpus, block_size=64 << 10)
        ds = ds.map(cpus_of_this_process).batch(4)
        return [list(b) for b in DataLoader(ds, batch_size=None, num_workers=workers)]

    tuned, plain = batches("auto"), batches("all")
    assert [[r["i"] for r in b] for b in tuned] == [[r["i"] for r in b] for b in plain]
    assert sorted(r["i"] for b in tuned for r in b) == list(range(3000))
    seen = {tuple(r["cpus"]) for b in tuned for r in b}
    assert tuple(every[1:]) in seen and seen <= {tuple(every), tuple(every[1:])}
