"""The real frameworks under torchrun (2 processes, gloo on 127.0.0.1, CPU): accelerate's and
Trainer's defaults stop at the first batch with DoubleSplitError on every rank (never a silent
short epoch); `StreamdsTrainer` trains every record exactly once per epoch over the ranks, and
a run resumed from a mid-epoch checkpoint trains exactly the steps the uninterrupted run
trained, with 0 and 2 DataLoader workers. Every launch is under a timeout. The model is a
one-layer GPT-2 built from a config (tests/framework_worker.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from streamds import StreamingJsonl
from streamds.preprocess.convert import convert

WORKER = Path(__file__).with_name("framework_worker.py")
RECORDS = 200
PER_SHARD = 25  # 8 shards of one block each: 2 ranks x 2 workers own 50 records each epoch


def steps_per_epoch(workers: int) -> int:
    """Per rank: 100 records in batches of 4; each of 2 workers has a short last batch."""
    return 25 if workers == 0 else 2 * 13
TIMEOUT = 240


@pytest.fixture(scope="module")
def even_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Converted shards of exactly PER_SHARD equal-length records each, so that every rank and
    worker owns as many records in every epoch (equal steps per rank without even_ranks)."""
    root = tmp_path_factory.mktemp("frameworks")
    lines = [orjson.dumps({"id": i, "text": "x" * (8 - len(str(i)))}) + b"\n"
             for i in range(RECORDS)]
    assert len({len(line) for line in lines}) == 1
    (root / "in.jsonl").write_bytes(b"".join(lines))
    convert([str(root / "in.jsonl")], root / "shards", shard_size=PER_SHARD * len(lines[0]),
            frame_size=1 << 20)
    assert len(StreamingJsonl(str(root / "shards"))) == RECORDS
    return str(root / "shards")


@pytest.fixture(scope="module")
def unsized_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same records as plain .jsonl files of PER_SHARD records (one block each): no
    manifest, so no len(), and Lightning's fetcher fetches one batch ahead."""
    root = tmp_path_factory.mktemp("unsized")
    for part in range(RECORDS // PER_SHARD):
        lines = [orjson.dumps({"id": i, "text": "x" * (8 - len(str(i)))}) + b"\n"
                 for i in range(part * PER_SHARD, (part + 1) * PER_SHARD)]
        (root / f"part-{part}.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(TypeError):
        len(StreamingJsonl(str(root)))
    return str(root)


def torchrun(out: Path, *args: str, nproc: int = 2) -> tuple[int, str, list[dict[str, Any]]]:
    """Run tests/framework_worker.py on `nproc` ranks; (exit status, output, their reports)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(WORKER), *args[:2], str(out), *args[2:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
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
        pytest.fail(f"torchrun hung:\n{output.decode()[-4000:]}")
    resumed = "--resume-from" in args
    reports = [json.loads((out / f"rank-{rank}{'-resumed' if resumed else ''}.json").read_text())
               for rank in range(nproc)]
    return process.returncode, output.decode(), reports


def ids(steps: list[list[int]]) -> list[int]:
    return [i for step in steps for i in step]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["accelerate", "trainer"])
def test_defaults_stop_at_the_first_batch_on_every_rank(
    even_corpus: str, tmp_path: Path, scenario: str
) -> None:
    status, output, reports = torchrun(tmp_path, scenario, even_corpus)
    assert status != 0, output
    for report in reports:
        assert report["steps"] == []  # nothing trained before the error
        assert report["error"].startswith("DoubleSplitError: accelerate splits")
        assert "StreamdsTrainer" in report["error"]


def check_epochs(reports: list[dict[str, Any]], epochs: int, steps: int) -> None:
    """Each rank made `steps` steps per epoch; each epoch every record once over the ranks."""
    for report in reports:
        assert report["error"] is None
        assert len(report["steps"]) == epochs * steps
    for epoch in range(epochs):
        part = slice(epoch * steps, (epoch + 1) * steps)
        trained = sorted(ids(reports[0]["steps"][part]) + ids(reports[1]["steps"][part]))
        assert trained == list(range(RECORDS)), f"epoch {epoch}"


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "workers"), [("epochs", 2), ("max_steps", 0)])
def test_streamds_trainer_exact_and_resumes_exactly(
    even_corpus: str, tmp_path: Path, workers: int, mode: str
) -> None:
    steps = steps_per_epoch(workers)
    extra = ["--max-steps", str(2 * steps)] if mode == "max_steps" else []
    base = ["streamds-trainer", even_corpus, "--workers", str(workers), *extra]
    status, output, reports = torchrun(tmp_path, *base)
    assert status == 0, output
    # max_steps: one stream, epoch after epoch (100 records a rank, whole batches of 4)
    check_epochs(reports, 2, steps)

    # resume from a checkpoint in the middle of the second epoch (step 35 of 50 or 52)
    checkpoint = tmp_path / "run" / "checkpoint-35"
    assert checkpoint.is_dir()
    status, output, resumed = torchrun(tmp_path, *base, "--resume-from", str(checkpoint))
    assert status == 0, output
    for before, after in zip(reports, resumed, strict=True):
        assert after["steps"] == before["steps"][35:]


EVAL_SIZES = (13, 7, 9)  # one block a file: rank 0 owns 22 records (7 batches), rank 1 owns 7


@pytest.fixture(scope="module")
def eval_sets(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """An eval set of 29 records (not a multiple of 2 ranks x 4) whose ranks own unequal
    numbers of batches, and one of 10 records in one file (rank 1 owns no block)."""
    uneven, tiny = tmp_path_factory.mktemp("eval-uneven"), tmp_path_factory.mktemp("eval-tiny")
    start = 0
    for part, size in enumerate(EVAL_SIZES):
        lines = [orjson.dumps({"id": i, "text": "x"}) + b"\n" for i in range(start, start + size)]
        (uneven / f"part-{part}.jsonl").write_bytes(b"".join(lines))
        start += size
    lines = [orjson.dumps({"id": i, "text": "x"}) + b"\n" for i in range(10)]
    (tiny / "eval.jsonl").write_bytes(b"".join(lines))
    return [str(uneven), str(tiny)]


@pytest.mark.slow
def test_streamds_trainer_evaluates_every_eval_record_once_over_the_ranks(
    even_corpus: str, eval_sets: list[str], tmp_path: Path
) -> None:
    # eval_strategy="steps" every 5 steps, 2 DataLoader workers, on both eval sets; before,
    # the eval loader went through accelerator.prepare and was refused (DoubleSplitError)
    status, output, reports = torchrun(tmp_path, "streamds-trainer", even_corpus,
                                       "--workers", "2", "--max-steps", "10",
                                       "--eval", *eval_sets)
    assert status == 0, output
    expected = [list(range(sum(EVAL_SIZES))), list(range(10))] * 3  # at steps 0, 5 and 10
    for report in reports:
        assert report["error"] is None
        assert len(report["steps"]) == 10
        assert [sorted(ids) for ids in report["evals"]] == expected
    # the eval loss weighs each rank's batch by its real rows: before training (the same
    # weights everywhere) one process gets the same losses over the same records
    status, output, alone = torchrun(tmp_path / "alone", "streamds-trainer", even_corpus,
                                     "--workers", "2", "--max-steps", "10",
                                     "--eval", *eval_sets, nproc=1)
    assert status == 0, output
    assert reports[0]["eval_losses"][:2] == pytest.approx(alone[0]["eval_losses"][:2], rel=1e-5)


@pytest.mark.slow
def test_lightning_ddp_exact_and_resumes_exactly(unsized_corpus: str, tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    base = ["lightning", unsized_corpus, "--workers", "2"]
    status, output, reports = torchrun(tmp_path, *base)
    assert status == 0, output
    steps = steps_per_epoch(2)
    check_epochs(reports, 2, steps)
    first = [report["steps"][0] for report in reports]
    second = [report["steps"][steps] for report in reports]
    assert first != second  # set_epoch reached the dataset: epoch 1 has its own order

    # every rank's state, one batch behind the fetcher: the rest is the uninterrupted rest
    checkpoint = str(tmp_path / "ckpt" / "step=35.ckpt")
    status, output, resumed = torchrun(tmp_path, *base, "--resume-from", checkpoint)
    assert status == 0, output
    for before, after in zip(reports, resumed, strict=True):
        assert after["error"] is None
        assert after["steps"] == before["steps"][35:]

    # one process finishes the epoch of both ranks: their states merged (elastic resume)
    status, output, alone = torchrun(tmp_path, *base, "--resume-from", checkpoint, nproc=1)
    assert status == 0, output
    trained = [i for report in reports for i in ids(report["steps"][steps:35])]
    assert sorted(trained + ids(alone[0]["steps"])) == list(range(RECORDS))


@pytest.fixture(scope="module")
def uneven_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Plain .jsonl files of unequal record counts (one block each), so that the ranks'
    workers own different numbers of records: what even_ranks must even out."""
    root = tmp_path_factory.mktemp("uneven")
    start = 0
    for part, size in enumerate([31, 17, 26, 9, 40, 23, 12, 35]):
        lines = [orjson.dumps({"id": i, "text": "x"}) + b"\n" for i in range(start, start + size)]
        (root / f"part-{part}.jsonl").write_bytes(b"".join(lines))
        start += size
    return str(root)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_lightning_ddp_with_even_ranks_and_workers_finishes(
    uneven_corpus: str, tmp_path: Path, mode: str
) -> None:
    # the issue's case: Lightning DDP, 2 workers, even_ranks on a corpus whose ranks' workers
    # own unequal counts; before, rank 1 died at the end and the launcher still exited 0
    pytest.importorskip("lightning")
    status, output, reports = torchrun(tmp_path, "lightning", uneven_corpus, "--workers", "2",
                                       "--even-ranks", mode)
    assert status == 0, output
    assert all(report["error"] is None for report in reports)
    sizes = [[len(step) for step in report["steps"]] for report in reports]
    assert sizes[0] == sizes[1]  # the same batch sizes, step by step, on both ranks
    total = 31 + 17 + 26 + 9 + 40 + 23 + 12 + 35
    for epoch in (0, 1):
        trained = [i for report in reports
                   for step, at in zip(report["steps"], report["epochs"], strict=True)
                   if at == epoch for i in step]
        if mode == "drop":  # never a record twice, and few left out
            assert len(trained) == len(set(trained)) > total // 2
        else:  # every record at least once
            assert sorted(set(trained)) == list(range(total))


@pytest.mark.slow
def test_accelerate_prepare_loader_exact_and_resumes_exactly(
    unsized_corpus: str, tmp_path: Path
) -> None:
    base = ["streamds-accelerate", unsized_corpus, "--workers", "2"]
    status, output, reports = torchrun(tmp_path, *base)
    assert status == 0, output
    check_epochs(reports, 2, steps_per_epoch(2))
    # accelerator.save_state after step 35 holds every rank's own loader state
    status, output, resumed = torchrun(tmp_path, *base, "--resume-from", str(tmp_path / "state"))
    assert status == 0, output
    for before, after in zip(reports, resumed, strict=True):
        assert after["error"] is None
        assert after["steps"] == before["steps"][35:]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_dispatcher_alone(even_corpus: str, tmp_path: Path, workers: int) -> None:
    # rank=0, world_size=1: accelerate's dispatcher alone splits; with workers it would drop
    # the rest of each worker's short batch, so that is refused
    status, output, reports = torchrun(tmp_path, "accelerate", even_corpus, "--workers",
                                       str(workers), "--one-rank")
    if workers:
        assert status != 0, output
        assert all("num_workers=2" in report["error"] for report in reports)
        return
    assert status == 0, output
    trained = ids(reports[0]["steps"]) + ids(reports[1]["steps"])
    assert sorted(set(trained)) == list(range(RECORDS))
    assert len(trained) - RECORDS < 2  # accelerate's padding of the last batch (N-1 at most)
