"""Parquet folders under real torchrun worlds (gloo on 127.0.0.1, CPU; issue 35: "2 workers x
3 ranks; torchrun where the frameworks are involved").

3 ranks x 2 DataLoader workers read a shuffled multi-file Parquet corpus, checkpoint mid-epoch
on every rank, and resume in the same world (`StatefulDataLoader` and `ds.loader`: the rest
is the uninterrupted rest, batch for batch) and in a world of 2 ranks (`merge_states`: every
row once across the ranks and the cut). Lightning DDP trains over Parquet as over JSON lines:
every row once per epoch, exact resume, and an elastic finish by one process. Marked slow
(each launch starts torch on every rank); the in-process twins are in test_parquet.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_parquet import write_parquet_files

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("parquet_ddp_worker.py")
TIMEOUT = 240


def torchrun(nproc: int, *args: str) -> None:
    """Run tests/parquet_ddp_worker.py on `nproc` ranks; fail on a hang or an error."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(WORKER), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(WORKER.parent.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun with {nproc} ranks hung:\n{output.decode()[-4000:]}")
    assert process.returncode == 0, output.decode()[-4000:]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def assert_exactly_once(parts: list[list[int]], expected: list[int]) -> None:
    seen = Counter(i for part in parts for i in part)
    repeated = sorted(i for i, n in seen.items() if n > 1)
    missing = sorted(set(expected) - set(seen))
    assert not repeated and not missing and set(seen) <= set(expected), (
        f"repeated {repeated[:10]} ({len(repeated)}), missing {missing[:10]} ({len(missing)})")


@pytest.mark.parametrize("kind", ["stateful", "streamds"])
def test_three_ranks_of_two_workers_checkpoint_and_resume_in_this_world_and_in_two_ranks(
    tmp_path: Path, kind: str
) -> None:
    source = tmp_path / "pubmed"
    expected = write_parquet_files(source, [[70, 50], [130], [20, 20, 20], [90]])
    out = tmp_path / "run"
    out.mkdir()
    torchrun(3, str(source), str(out), "--stop", "2", "--loader", kind)
    reports = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(3)]

    # one epoch over the 3 ranks: every row once; each rank stopped part-way
    assert_exactly_once([flat(r["consumed"]) + flat(r["rest"]) for r in reports], expected)
    assert all(r["consumed"] and r["rest"] for r in reports)
    # the same world resumed from the states on disk: the uninterrupted rest, batch for batch
    for report in reports:
        assert report["resumed"] == report["rest"]

    if kind == "streamds":
        return  # the elastic resume below merges StatefulDataLoader states
    # an elastic resume: 2 ranks finish what the 3 left, from the merged states
    torchrun(2, str(source), str(out), "--elastic")
    finished = [json.loads((out / f"elastic-{rank}.json").read_text()) for rank in range(2)]
    assert all(f["rest"] for f in finished)  # both new ranks got work
    consumed = [i for r in reports for i in flat(r["consumed"])]
    assert_exactly_once([consumed] + [flat(f["rest"]) for f in finished], expected)


# -- a framework over Parquet: Lightning DDP (tests/framework_worker.py) ---------------------

FILES, ROWS = 8, 32  # equal row ranges (columnar.MAX_GROUP_PARTS): 64 rows per reader
BATCH = 4


@pytest.fixture
def lightning_corpus(tmp_path: Path) -> str:
    """8 Parquet files of one row group of 32 rows, cut into equal row ranges, so every
    worker of 2 ranks x 2 workers owns 64 rows whatever the shuffle of blocks (equal steps)."""
    root = tmp_path / "corpus"
    root.mkdir()
    for part in range(FILES):
        first = part * ROWS
        pq.write_table(pa.table({"id": list(range(first, first + ROWS))}),
                       root / f"train-{part:05d}-of-{FILES:05d}.parquet")
    return str(root)


def test_lightning_ddp_over_parquet_exact_and_resumes_exactly(
    lightning_corpus: str, tmp_path: Path
) -> None:
    """Over Parquet, unlike plain JSON lines, len() is known (the footers) and a file is
    many blocks; Lightning DDP still trains every row once per epoch and resumes exactly."""
    pytest.importorskip("lightning")
    from test_frameworks import torchrun as framework_run

    base = ["lightning", lightning_corpus, "--workers", "2"]
    status, output, reports = framework_run(tmp_path, *base)
    assert status == 0, output
    steps = 2 * (FILES * ROWS // 4 // BATCH)  # per rank and epoch: 2 workers' batches
    for report in reports:
        assert report["error"] is None
        assert len(report["steps"]) == 2 * steps
    for epoch in range(2):
        part = slice(epoch * steps, (epoch + 1) * steps)
        trained = sorted(flat(reports[0]["steps"][part]) + flat(reports[1]["steps"][part]))
        assert trained == list(range(FILES * ROWS)), f"epoch {epoch}"

    checkpoint = str(tmp_path / "ckpt" / "step=35.ckpt")  # in the second epoch
    status, output, resumed = framework_run(tmp_path, *base, "--resume-from", checkpoint)
    assert status == 0, output
    for before, after in zip(reports, resumed, strict=True):
        assert after["error"] is None
        assert after["steps"] == before["steps"][35:]

    status, output, alone = framework_run(tmp_path, *base, "--resume-from", checkpoint, nproc=1)
    assert status == 0, output
    trained = [i for report in reports for i in flat(report["steps"][steps:35])]
    assert sorted(trained + flat(alone[0]["steps"])) == list(range(FILES * ROWS))
