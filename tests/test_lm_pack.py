"""examples/lm_pack.py: a language model on packed sequences resumes with exactly the same
sequences after --stop-after and after SIGKILL, across an epoch boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_example import kill_after_steps

from examples.lm_pack import main

# the examples build their loaders without torchdata's set_vital warning
pytestmark = pytest.mark.filterwarnings("error:'set_vital' is deprecated")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "lm_pack.py"
TINY = ["--quiet", "--records", "12", "--steps", "30", "--seq-len", "64", "--batch-size", "4",
        "--d-model", "32", "--layers", "1", "--vocab-size", "400", "--ckpt-every", "4"]


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    summary = main([*TINY, "--out", str(out), "--log-ids", str(out / "ids.jsonl")])
    return out, summary, read_log(out / "ids.jsonl")


def args_for(reference_out: Path, out: Path, log: Path, workers: int = 0) -> list[str]:
    return [*TINY, "--out", str(out), "--log-ids", str(log), "--num-workers", str(workers),
            "--data", str(reference_out / "corpus" / "train.txt"),
            "--tokenizer", str(reference_out / "tokenizer.json")]


@pytest.fixture(scope="module")
def straight(reference, tmp_path_factory):
    """The uninterrupted run's log under `workers` workers (run once per module each)."""
    logs: dict[int, list[dict]] = {}

    def log_of(workers: int) -> list[dict]:
        if workers not in logs:
            out = tmp_path_factory.mktemp("straight")
            main(args_for(reference[0], out / "run", out / "ids.jsonl", workers))
            logs[workers] = read_log(out / "ids.jsonl")
        return logs[workers]

    return log_of


def test_the_run_packs_and_learns(reference):
    _, summary, log = reference
    assert summary["epoch"] >= 1  # 30 steps of 4 x 64 tokens cross an epoch of 12 records
    assert [e["step"] for e in log] == list(range(1, 31))
    assert summary["last_loss"] < summary["first_loss"]
    packing = summary["packing"]
    assert packing["padded"] < 64 and packing["dropped"] == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_stop_and_resume_sees_the_same_sequences(reference, straight, tmp_path, workers):
    ref_out, _, _ = reference
    log = tmp_path / "ids.jsonl"
    args = args_for(ref_out, tmp_path / "run", log, workers)
    assert main([*args, "--stop-after", "9"])["stopped_early"]
    main([*args, "--resume"])
    expected, got = straight(workers), read_log(log)
    assert [e["step"] for e in got] == list(range(1, 31))
    assert [e["digest"] for e in got] == [e["digest"] for e in expected]
    assert [e["loss"] for e in got] == pytest.approx([e["loss"] for e in expected], rel=1e-5)


def test_killed_run_resumes_mid_document(reference, straight, tmp_path):
    ref_out, _, _ = reference
    log = tmp_path / "ids.jsonl"
    args = args_for(ref_out, tmp_path / "killed", log)
    kill_after_steps(args, log, 10, script=SCRIPT)
    assert 10 <= len(log.read_text().splitlines()) < 30
    main([*args, "--resume"])
    got = read_log(log)
    assert [e["step"] for e in got] == list(range(1, 31))
    assert [e["digest"] for e in got] == [e["digest"] for e in straight(0)]
