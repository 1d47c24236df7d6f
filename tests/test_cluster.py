"""Conversion in parts on a real Dask cluster on loopback (`distributed.LocalCluster`).

One cluster per module: 2 worker processes, one thread each, no dashboard, 127.0.0.1 only.
The output must be the bytes of the in-process run and of a process pool's, and a worker
process killed in the middle of a part must cost nothing but a rerun.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_convert import read_output
from test_parts import output_files

from streamds.preprocess.command import main as cli_main
from streamds.preprocess.convert import ConversionError, convert
from streamds.preprocess.parts_plan import read_plan
from streamds.tools.synthetic import write_pubmed, write_small_files

distributed = pytest.importorskip("distributed", reason="the 'cluster' extra (make setup)")

SHARD_SIZE = 60_000


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with distributed.LocalCluster(
        n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
        host="127.0.0.1", worker_dashboard_address=None,
    ) as local, distributed.Client(local) as client:
        yield client


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cluster")
    write_pubmed(root / "train.txt", target_bytes=400_000, record_chars=1500)
    write_small_files(root / "small", records=300, per_folder=40, record_chars=300)
    inputs = [root / "train.txt", root / "small"]
    here = root / "here"
    convert(inputs, here, shard_size=SHARD_SIZE, parts=5)
    return {"root": root, "inputs": inputs, "here": here}


@contextlib.contextmanager
def parts_run_on(cluster: Any) -> Iterator[list[str]]:
    """The cluster workers that ran each `run_part` task inside the block (the scheduler's
    task log, which sees the tasks of every client, the CLI's own included)."""
    ran: list[str] = []
    with distributed.get_task_stream(client=cluster) as stream:
        yield ran
    ran += [t["worker"] for t in stream.data if distributed.utils.key_split(t["key"]) ==
            "run_part"]


def worker_addresses(cluster: Any) -> set[str]:
    return set(cluster.scheduler_info()["workers"])


def test_dask_writes_the_bytes_of_in_process_and_of_a_process_pool(cluster, corpus, tmp_path):
    on_dask, on_pool = tmp_path / "dask", tmp_path / "pool"
    with parts_run_on(cluster) as ran:
        convert(corpus["inputs"], on_dask, shard_size=SHARD_SIZE, parts=5,
                executor=cluster.get_executor())
    assert len(ran) == 5 and set(ran) <= worker_addresses(cluster), ran  # not run here
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        convert(corpus["inputs"], on_pool, shard_size=SHARD_SIZE, parts=5, executor=pool)
    expected = output_files(corpus["here"])
    assert output_files(on_dask) == expected
    assert output_files(on_pool) == expected
    assert read_output(on_dask) == read_output(corpus["here"])


def test_both_dask_workers_take_parts(cluster, corpus, tmp_path):
    out = tmp_path / "out"
    convert(corpus["inputs"], out, shard_size=SHARD_SIZE, parts=6,
            transform=f"test_cluster:note_pid(folder={str(tmp_path)!r})")
    seen_here = {p.name for p in tmp_path.glob("pid-*")}
    for p in tmp_path.glob("pid-*"):
        p.unlink()
    out = tmp_path / "on-dask"
    convert(corpus["inputs"], out, shard_size=SHARD_SIZE, parts=6,
            transform=f"test_cluster:note_pid(folder={str(tmp_path)!r})",
            executor=cluster.get_executor())
    pids = {p.name for p in tmp_path.glob("pid-*")}
    workers = {f"pid-{pid}" for pid in cluster.run(os.getpid).values()}
    assert seen_here == {f"pid-{os.getpid()}"}
    assert pids == workers and len(workers) == 2


def note_pid(folder: str):
    """A transform that leaves a file named after the process it runs in."""
    def apply(record: dict[str, Any]) -> dict[str, Any]:
        Path(folder, f"pid-{os.getpid()}").touch()
        return record

    return apply


def test_a_killed_dask_worker_costs_only_a_rerun(cluster, corpus, tmp_path):
    marker = tmp_path / "killed-once"
    transform = f"test_parts:exit_once(marker={str(marker)!r}, article='PMC0000150')"
    here = tmp_path / "here"
    marker.touch()
    convert(corpus["inputs"], here, shard_size=SHARD_SIZE, parts=4, transform=transform)
    marker.unlink()
    out = tmp_path / "out"
    try:  # Dask retries a task whose worker died; if it gives up, the rerun finishes
        convert(corpus["inputs"], out, shard_size=SHARD_SIZE, parts=4, transform=transform,
                executor=cluster.get_executor())
    except ConversionError as err:
        assert "part-0000" in str(err)
        convert(corpus["inputs"], out, shard_size=SHARD_SIZE, parts=4, transform=transform,
                executor=cluster.get_executor())
    assert marker.exists()  # a worker process did die
    assert output_files(out) == output_files(here)
    cluster.wait_for_workers(2, timeout=30)  # the nanny restarted it, for the next test


def test_progress_moves_while_parts_run_on_dask_workers(cluster, tmp_path):
    """Parts on the cluster report as they read (through the scheduler's queue), not only
    when each part ends: a single big file split over the workers moves the bar."""
    source = tmp_path / "big.jsonl"
    source.write_bytes(b"".join(b'{"i": %d, "text": "%s"}\n' % (i, b"p" * 20_000)
                                for i in range(400)))  # 8 MB in 2 parts, read by the MiB
    size = source.stat().st_size
    out = tmp_path / "out"
    seen: list[Any] = []
    with parts_run_on(cluster) as ran:
        convert([source], out, shard_size=1 << 20, parts=2, progress=seen.append,
                executor=cluster.get_executor())
    assert len(ran) == 2 and set(ran) <= worker_addresses(cluster), ran  # not run here
    ends = {0, size, *(part.bytes for part in read_plan(out).parts)}  # parts done, or none
    done = [p.resumed_bytes + p.stored_bytes for p in seen]
    assert done == sorted(done) and done[-1] == size
    assert len({n for n in done if n not in ends}) >= 3, done  # within the running parts


def test_cli_dask_executor_by_address(cluster, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    address = cluster.scheduler_info()["address"].removeprefix("tcp://")
    inputs = [*map(str, corpus["inputs"])]
    with parts_run_on(cluster) as ran:
        assert cli_main([*inputs, "-o", str(out), "--shard-size", str(SHARD_SIZE),
                         "--parts", "5", "--executor", f"dask://{address}", "-q"]) == 0
    assert len(ran) == 5 and set(ran) <= worker_addresses(cluster), ran  # not run here
    assert "wrote" in capsys.readouterr().out
    assert output_files(out) == output_files(corpus["here"])


def test_a_second_run_on_the_same_client_runs_the_parts_again(cluster, corpus, tmp_path):
    # Dask keys a task by its arguments by default: the first run's results (or failures)
    # must not stand in for a second run's work
    out = tmp_path / "out"
    executor = cluster.get_executor()
    convert(corpus["inputs"], out, shard_size=SHARD_SIZE, parts=5, executor=executor)
    shutil.rmtree(out)
    with parts_run_on(cluster) as ran:
        convert(corpus["inputs"], out, shard_size=SHARD_SIZE, parts=5, executor=executor)
    assert len(ran) == 5 and set(ran) <= worker_addresses(cluster), ran  # ran again, there
    assert output_files(out) == output_files(corpus["here"])
