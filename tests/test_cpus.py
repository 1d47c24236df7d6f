"""Which CPUs DataLoader workers run on (`streamds.stages.cpus`): the plan, the tuning stage with a
fake clock, and real workers keeping a CPU free for the main process."""

from __future__ import annotations

import os

import orjson
import pytest
from torch.utils.data import DataLoader

from streamds import Storage, StreamingJsonl
from streamds.stages.cpus import (
    FIT,
    KEEP,
    MARGIN,
    MIN_ITEMS,
    PHASE,
    RETUNE,
    TUNE,
    WARM_UP,
    CpuPlan,
    TuneCpus,
    cpu_quota,
    plan_cpus,
    threads,
)


@pytest.fixture(autouse=True)
def no_cpu_quota(monkeypatch):
    """Plans as on a machine without a CPU quota (a CI container may have one); forked
    workers inherit it. Tests of the quota set their own."""
    import streamds.stages.cpus as cpus

    monkeypatch.setattr(cpus, "cpu_quota", lambda: None)
    monkeypatch.setattr(cpus, "_STARTED_ON", None)


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


def _cgroups(tmp_path, membership: str, mounts: list[tuple[str, str, str, str]],
             files: dict[str, str]) -> tuple[str, str]:
    """A fake /proc/self/cgroup and /proc/self/mountinfo, and the cgroup files of the mounts:
    `mounts` are (root in the hierarchy, mount point under tmp_path, type, super options),
    `files` map paths under tmp_path to their text."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "cgroup").write_text(membership)
    lines = ["22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw"]
    for number, (root, point, kind, options) in enumerate(mounts, 30):
        (tmp_path / point).mkdir(parents=True, exist_ok=True)
        lines.append(f"{number} 22 0:{number} {root} {tmp_path / point} rw,nosuid shared:{number}"
                     f" - {kind} cgroup rw,{options}")
    (tmp_path / "mountinfo").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


V2 = ("/", "fs", "cgroup2", "nsdelegate")


def test_the_cpu_quota_of_a_cgroup_v2_is_the_smallest_on_the_way_to_the_root(tmp_path):
    paths = _cgroups(tmp_path, "0::/kubepods/pod1/box\n", [V2], {
        "fs/cpu.max": "max 100000\n",
        "fs/kubepods/cpu.max": "800000 100000\n",  # 8 CPUs for all pods
        "fs/kubepods/pod1/cpu.max": "150000 100000\n",  # 1.5 for this one
        "fs/kubepods/pod1/box/cpu.max": "max 100000\n",
    })
    assert cpu_quota(*paths) == 1.5


def test_the_cpu_quota_of_a_cgroup_v1_cpu_tree(tmp_path):
    paths = _cgroups(
        tmp_path, "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n",
        [("/", "cpu,cpuacct", "cgroup", "cpu,cpuacct"), ("/", "memory", "cgroup", "memory")], {
            "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            # not the cpu controller's tree: never read
            "memory/docker/abc/cpu.cfs_quota_us": "50000\n",
            "memory/docker/abc/cpu.cfs_period_us": "100000\n",
        })
    assert cpu_quota(*paths) == 2.0


def test_a_container_reads_its_cgroups_below_the_root_its_tree_is_mounted_from(tmp_path):
    """Without a cgroup namespace, /proc/self/cgroup names the host's path, and the container's
    own cgroup (/docker/abc) is the top of its mount: a job's cgroup below it is found
    relative to that root, and both quotas count."""
    mounts = [("/docker/abc", "fs", "cgroup2", "")]
    paths = _cgroups(tmp_path, "0::/docker/abc/job\n", mounts,
                     {"fs/cpu.max": "400000 100000\n", "fs/job/cpu.max": "50000 100000\n"})
    assert cpu_quota(*paths) == 0.5
    paths = _cgroups(tmp_path, "0::/docker/abc\n", mounts, {})
    assert cpu_quota(*paths) == 4.0
    paths = _cgroups(tmp_path, "0::/other\n", mounts, {})  # not in the mounted part
    assert cpu_quota(*paths) is None


def test_a_hybrid_system_reads_the_v1_cpu_tree(tmp_path):
    """cgroup v1 controllers with an empty v2 tree beside them (systemd's hybrid layout)."""
    paths = _cgroups(tmp_path, "1:cpu:/box\n0::/box\n",
                     [("/", "cpu", "cgroup", "cpu"), ("/", "unified", "cgroup2", "")],
                     {"cpu/box/cpu.cfs_quota_us": "300000\n",
                      "cpu/box/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(*paths) == 3.0


@pytest.mark.parametrize("text", ["max 100000\n", "lots\n", "150000 0\n", "-1 100000\n", ""])
def test_no_quota_or_a_file_that_does_not_say_one_is_none(tmp_path, text):
    assert cpu_quota(*_cgroups(tmp_path, "0::/\n", [V2], {"fs/cpu.max": text})) is None


def test_what_cannot_be_read_is_no_quota(tmp_path):
    assert cpu_quota(str(tmp_path / "none"), str(tmp_path / "none")) is None
    paths = _cgroups(tmp_path, "0::/b\xe4d\n", [V2], {})  # any byte may name a cgroup
    (tmp_path / "cgroup").write_bytes(b"0::/b\xe4d\n")
    assert cpu_quota(*paths) is None


def test_workers_under_a_cpu_quota_are_left_where_they_are(monkeypatch):
    """A container limited to 1.5 CPUs on a machine of 8: moving a worker keeps no CPU time
    for the main process (and makes no batches ahead: `ahead="auto"` follows TUNE)."""
    import streamds.stages.cpus as cpus

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)

    def plan(quota: float | None, workers: int = 2) -> str:
        monkeypatch.setattr(cpus, "_STARTED_ON", None)
        monkeypatch.setattr(cpus, "cpu_quota", lambda: quota)
        return cpus.worker_plan(workers).how

    assert plan(1.5) == KEEP
    assert plan(8.0) == FIT  # not below the CPUs: as without
    assert plan(None) == FIT
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert plan(1.5) == KEEP  # 1.5 of 2 CPUs: KEEP, not TUNE
    assert plan(None) == TUNE
    # 8 ranks, each bound to 4 of 32 CPUs, share a quota of 16: 2 each, below 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert plan(16.0, workers=1) == KEEP
    assert plan(64.0, workers=1) == FIT


CPU_TREE = "/sys/fs/cgroup/cpu"  # cgroup v1's cpu controller, where a root process may add one


@pytest.mark.skipif(not os.access(CPU_TREE, os.W_OK), reason="no writable cgroup v1 cpu tree")
def test_a_process_in_a_real_cgroup_with_a_quota_sees_it():
    import subprocess
    import sys

    group = os.path.join(CPU_TREE, f"streamds-test-{os.getpid()}")
    try:
        os.mkdir(group)
    except OSError as err:
        pytest.skip(f"cannot make a cgroup under {CPU_TREE}: {err}")
    try:
        try:
            for name, value in (("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "150000")):
                with open(os.path.join(group, name), "w") as file:
                    file.write(value)
        except OSError as err:  # e.g. a parent's quota below 1.5 CPUs
            pytest.skip(f"cannot set a quota of 1.5 CPUs in {group}: {err}")
        child = subprocess.run(
            [sys.executable, "-c", "import os\n"
             f"with open({os.path.join(group, 'cgroup.procs')!r}, 'w') as procs:\n"
             "    procs.write(str(os.getpid()))\n"
             "print(open('/proc/self/cgroup').read().count(" f"{os.path.basename(group)!r}))\n"
             "from streamds.stages.cpus import cpu_quota\nprint(cpu_quota())"],
            capture_output=True, text=True, check=True)
        assert child.stdout.split() == ["1", "1.5"], child.stdout + child.stderr
    finally:
        os.rmdir(group)  # empty again once the child has exited


class FakeCpus:
    """A clock that moves `seconds[cpus]` per item taken, and the CPUs applied last."""

    def __init__(self, seconds: dict[frozenset[int], float], start: frozenset[int]) -> None:
        self.seconds = seconds
        self.now = 0.0
        self.cpus = start
        self.applied: list[frozenset[int]] = []
        self.applied_at: list[float] = []

    def clock(self) -> float:
        return self.now

    def apply(self, cpus: frozenset[int]) -> None:
        self.cpus = cpus
        self.applied.append(cpus)
        self.applied_at.append(self.now)

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
    # the second measurement began RETUNE seconds after the first one's choice
    assert fake.applied[5] == EVERY and fake.applied_at[5] - fake.applied_at[4] >= RETUNE
    assert fake.applied_at[5] - fake.applied_at[4] < RETUNE + 0.1


def test_a_slow_pipeline_is_measured_over_enough_items():
    """At 1 s an item, a phase of PHASE seconds would hold one item: each holds MIN_ITEMS."""
    fake = FakeCpus({EVERY: 1.0, SPARE: 1.0}, EVERY)
    list(TuneCpus(fake.items(200), PLAN, clock=fake.clock, apply=fake.apply))
    phases = [b - a for a, b in zip(fake.applied_at[:4], fake.applied_at[1:5], strict=True)]
    assert phases == [pytest.approx(MIN_ITEMS * 1.0)] * 4


def test_only_one_reader_of_a_process_measures():
    """Two tuned readers in one process (a Mix) would move each other's CPUs mid-phase."""
    first = FakeCpus({EVERY: 0.01, SPARE: 0.008}, EVERY)
    second = FakeCpus({EVERY: 0.01, SPARE: 0.008}, EVERY)
    outer = iter(TuneCpus(first.items(10), PLAN, clock=first.clock, apply=first.apply))
    assert next(outer) == 0  # the first one is measuring
    assert list(TuneCpus(second.items(500), PLAN, clock=second.clock,
                         apply=second.apply)) == list(range(500))
    assert second.applied == []
    assert list(outer) == list(range(1, 10))


def test_tuning_an_input_that_ends_in_any_phase_hands_out_all_of_it():
    for count in range(0, 800, 7):  # 0.01 s an item: ends in the warm-up or in any phase
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
    ds = StreamingJsonl(str(path)).map(cpus_of_this_process).batch(1, worker_cpus=worker_cpus)
    records = [r for batch in DataLoader(ds, batch_size=None, num_workers=1) for r in batch]
    assert [r["i"] for r in records] == list(range(50))
    seen = {tuple(r["cpus"]) for r in records}
    assert seen == ({tuple(every[1:])} if worker_cpus == "auto" else {tuple(every)})
    assert sorted(os.sched_getaffinity(0)) == every  # the main process is left as it was


def test_worker_cpus_is_checked(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"i": 0}\n')
    with pytest.raises(ValueError, match="worker_cpus"):
        StreamingJsonl(str(path)).batch(2, worker_cpus="some")


@pytest.fixture
def two_cpus():
    """This process on two of its CPUs (so that 2 workers are more than fit), restored after."""
    every = os.sched_getaffinity(0)
    two = sorted(every)[:2]
    os.sched_setaffinity(0, two)
    yield two
    os.sched_setaffinity(0, every)


@needs_two_cpus
def test_workers_that_tune_at_every_item_hand_out_the_same_batches(tmp_path, monkeypatch,
                                                                   two_cpus):
    """More workers than CPUs: they tune. With no warm-up and phases of one item each (no
    timing involved), the workers move between CPU sets all the time; the batches are exactly
    those of worker_cpus="all", in the same order, and some were built on the spare CPU."""
    import streamds.stages.cpus as cpus

    for name, value in (("WARM_UP", 0.0), ("PHASE", 0.0), ("RETUNE", 0.0), ("MIN_ITEMS", 1)):
        monkeypatch.setattr(cpus, name, value)  # forked workers inherit it
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    path = tmp_path / "a.jsonl"
    text = "x" * 1000  # 64 records a 64 KiB block: the map runs on many chunks
    path.write_bytes(b"".join(orjson.dumps({"i": i, "text": text}) + b"\n" for i in range(3000)))

    def batches(worker_cpus: str) -> list[list[dict]]:
        ds = StreamingJsonl(str(path), storage=Storage(block_size=64 << 10))
        ds = ds.map(cpus_of_this_process).batch(4, worker_cpus=worker_cpus)
        loader = DataLoader(ds, batch_size=None, num_workers=2,
                            multiprocessing_context="fork")
        return [list(b) for b in loader]

    tuned, plain = batches("auto"), batches("all")
    assert [[r["i"] for r in b] for b in tuned] == [[r["i"] for r in b] for b in plain]
    assert sorted(r["i"] for b in tuned for r in b) == list(range(3000))
    seen = {tuple(r["cpus"]) for b in tuned for r in b}
    assert tuple(two_cpus[1:]) in seen and seen <= {tuple(two_cpus), tuple(two_cpus[1:])}


@needs_two_cpus
def test_a_state_taken_while_workers_tune_resumes_exactly(tmp_path, monkeypatch, two_cpus):
    from torchdata.stateful_dataloader import StatefulDataLoader

    import streamds.stages.cpus as cpus

    for name, value in (("WARM_UP", 0.0), ("PHASE", 0.0), ("RETUNE", 0.0), ("MIN_ITEMS", 1)):
        monkeypatch.setattr(cpus, name, value)
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"i": i, "t": "x" * 300}) + b"\n"
                             for i in range(4000)))

    def loader() -> StatefulDataLoader:
        ds = StreamingJsonl(str(path), shuffle=True, seed=3, buffer_size=300,
                            storage=Storage(block_size=64 << 10)).batch(16)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2,
                                  multiprocessing_context="fork")

    whole = [[r["i"] for r in b] for b in loader()]
    first = loader()
    batches = iter(first)
    head = [[r["i"] for r in next(batches)] for _ in range(37)]
    state = first.state_dict()
    del batches
    again = loader()
    again.load_state_dict(state)
    rest = [[r["i"] for r in b] for b in again]
    assert head + rest == whole
    assert sorted(i for b in whole for i in b) == list(range(4000))


def test_a_worker_someone_placed_is_left_as_it_is(monkeypatch):
    import streamds.stages.cpus as cpus

    monkeypatch.setattr(cpus, "_STARTED_ON", None)
    monkeypatch.setattr(os, "sched_getaffinity",
                        lambda pid: {0, 1, 2, 3} if pid else {2, 3})  # pinned by a launcher
    assert cpus.worker_plan(workers=1).how == KEEP


def test_a_rank_bound_to_part_of_the_machine_plans_for_itself(monkeypatch):
    """A launcher that gives each of 8 ranks 4 of 32 CPUs: the set is this rank's alone."""
    import streamds.stages.cpus as cpus

    monkeypatch.setattr(cpus, "_STARTED_ON", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    plan = cpus.worker_plan(workers=2)
    assert (plan.how, plan.main) == (FIT, {4})
    monkeypatch.setattr(cpus, "_STARTED_ON", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    plan = cpus.worker_plan(workers=2)  # the whole machine: 8 x (2 + 1) <= 32
    assert (plan.how, plan.main) == (FIT, set(range(8)))
    monkeypatch.setattr(cpus, "_STARTED_ON", None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")  # a speed hint: never an error
    assert cpus.worker_plan(workers=2).main == {0}


def test_the_main_process_keeps_the_cpu_its_workers_keep_off(monkeypatch):
    import streamds.stages.cpus as cpus

    def machine(every: set[int], local: int | None = None, rank: int | None = None) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: every)
        monkeypatch.setattr(os, "cpu_count", lambda: len(every))
        for name, value in (("LOCAL_WORLD_SIZE", local), ("LOCAL_RANK", rank)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, str(value))

    machine({0, 1})
    assert cpus.main_cpus(2) == {0} and cpus.main_cpus(1) == {0}  # TUNE, FIT
    assert cpus.main_cpus(0) is None
    machine({3})
    assert cpus.main_cpus(2) is None  # one CPU: nothing to keep
    machine(set(range(4)), local=2, rank=1)
    assert cpus.main_cpus(1) == {1}  # each local rank its own
    machine(set(range(4)), local=2)
    assert cpus.main_cpus(1) is None  # which rank this is, unknown
    machine({0, 1})
    monkeypatch.setattr(cpus, "cpu_quota", lambda: 1.5)
    assert cpus.main_cpus(2) is None  # under a quota the workers are left as they are


def test_workers_that_leave_the_parsing_to_the_main_process_start_off_its_cpu(monkeypatch):
    import streamds.stages.cpus as cpus

    moved: list[frozenset[int]] = []
    monkeypatch.setattr(cpus, "set_cpus", lambda cpus_: moved.append(frozenset(cpus_)))
    plan = CpuPlan(TUNE, frozenset({0, 1}), frozenset({0}))
    cpus.on_planned_cpus([], plan)
    assert moved == []  # tuned from every CPU, as before
    cpus.on_planned_cpus([], plan, main_heavy=True)
    assert moved == [frozenset({1})]


class _Recorded:
    """A loader whose batches say which CPUs the thread that took them was on."""

    def __init__(self) -> None:
        self.num_workers = 2

    def __iter__(self):
        return (sorted(os.sched_getaffinity(0)) for _ in range(3))

    def state_dict(self) -> dict:
        return {"at": 1}


@needs_two_cpus
def test_a_loader_on_the_main_cpu_takes_each_batch_there_and_leaves_the_step_where_it_was(
        two_cpus):
    from streamds.train.loader import OnMainCpu

    loader = OnMainCpu(_Recorded(), frozenset(two_cpus[:1]))
    for taken_on in loader:
        assert taken_on == two_cpus[:1]
        assert sorted(os.sched_getaffinity(0)) == two_cpus  # the step: where it was
    assert loader.state_dict() == {"at": 1} and loader.num_workers == 2


@needs_two_cpus
def test_ds_loader_over_plain_lines_keeps_the_main_cpu_to_itself(tmp_path, monkeypatch, two_cpus):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"i": i, "t": "x" * 2000}) + b"\n"
                             for i in range(600)))
    loader = StreamingJsonl(str(path)).loader(16, num_workers=2)
    got = []
    workers_on = set()
    main_threads_on = set()
    for batch in loader:
        got += [r["i"] for r in batch]
        for worker in loader.loader._iterator._workers:
            workers_on.add(tuple(sorted(os.sched_getaffinity(worker.pid))))
        main_threads_on |= {tuple(sorted(os.sched_getaffinity(t))) for t in threads()}
        assert sorted(os.sched_getaffinity(0)) == two_cpus  # the step: where it was
    assert sorted(got) == list(range(600))
    assert workers_on == {tuple(two_cpus[1:])}  # from their first batch on
    assert tuple(two_cpus[:1]) in main_threads_on  # the loader's own threads here: moved


def test_only_workers_that_copy_lines_in_order_want_the_main_cpu(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"i": 0}\n')
    ds = StreamingJsonl(str(path))
    assert ds.batch(16).wants_main_cpu()
    assert not StreamingJsonl(str(path), shuffle=True).batch(16).wants_main_cpu()  # draws
    assert not ds.map(dict).batch(16).wants_main_cpu()  # the map's work is the workers'
    assert not ds.batch(16, collate=list).wants_main_cpu()
    assert not ds.batch(16, worker_cpus="all").wants_main_cpu()
