"""The summarisation example: ROUGE, text cleanup, data discovery, and exact resume end to end.

The resume tests run the example's `main()` with a tiny corpus and model: once straight
through, once interrupted (stopped after K steps, or killed with SIGKILL) and resumed with
``--resume``. The per-step log of article ids (and losses) must match the uninterrupted run.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.summarization import corpus, rouge
from examples.summarization.train import main

# the examples build their loaders without torchdata's set_vital warning
pytestmark = pytest.mark.filterwarnings("error:'set_vital' is deprecated")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "summarization" / "train.py"

# --- ROUGE ----------------------------------------------------------------------------------


def words(text: str) -> list[str]:
    return text.split()


def test_rouge_n_counts_clipped_overlaps():
    cand, ref = words("the cat the cat"), words("the cat sat on the mat")
    # unigrams: the x2 (ref has 2), cat x1 (ref has 1) -> 3 of 4 candidate, 3 of 6 reference
    assert rouge.rouge_n(cand, ref, 1) == pytest.approx((3 / 4, 3 / 6, 2 * 0.75 * 0.5 / 1.25))
    # bigrams: "the cat" x2 in cand, x1 in ref -> overlap 1 of 3 and 1 of 5
    p, r, _ = rouge.rouge_n(cand, ref, 2)
    assert (p, r) == pytest.approx((1 / 3, 1 / 5))
    assert rouge.rouge_n([], ref, 1) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        rouge.rouge_n(cand, ref, 0)


def test_lcs_and_rouge_l():
    assert rouge.lcs_length(words("a b c d e"), words("a c e")) == 3
    assert rouge.lcs_length(words("x y"), words("a b")) == 0
    assert rouge.lcs_length(words("police killed the gunman"),
                            words("the gunman police killed")) == 2
    p, r, f = rouge.rouge_l(words("the cat was found under the bed"),
                            words("the cat was under the bed"))
    assert (p, r) == pytest.approx((6 / 7, 6 / 6))
    assert f == pytest.approx(2 * p * r / (p + r))


def test_score_tokenizes_like_rouge_score():
    assert rouge.tokenize("The cat, sat-on (the) MAT.") == ["the", "cat", "sat", "on", "the",
                                                            "mat"]
    scores = rouge.score("The cat sat.", "the cat sat")
    assert scores == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    mean = rouge.corpus_rouge([("a b", "a b"), ("c", "d")])
    assert mean == {"rouge1": 50.0, "rouge2": 50.0, "rougeL": 50.0}
    assert rouge.corpus_rouge([]) == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}


# --- corpus helpers -------------------------------------------------------------------------


def test_clean_strips_pubmed_markup():
    record = {
        "article_text": ["we used @xmath0 patients [ 12 , 13 ] .", "second ."],
        "abstract_text": ["<S> first sentence . </S>", "<S> second @xcite . </S>"],
    }
    assert corpus.article_text(record) == "we used patients . second ."
    assert corpus.abstract_text(record) == "first sentence . second ."
    assert corpus.lead(record, 1) == "we used patients ."


def test_find_splits_accepts_release_files_and_shard_folders(tmp_path):
    release = tmp_path / "pubmed"
    release.mkdir()
    for name in ("train.txt", "val.txt", "test.txt"):
        (release / name).write_text("")
    assert corpus.find_splits(release) == {s: str(release / f"{s}.txt")
                                           for s in ("train", "val", "test")}
    shards = tmp_path / "shards"
    (shards / "train").mkdir(parents=True)
    (shards / "validation").mkdir()
    assert corpus.find_splits(shards) == {"train": str(shards / "train"),
                                          "val": str(shards / "validation")}
    with pytest.raises(FileNotFoundError, match="no train"):
        corpus.find_splits(tmp_path)


# --- end to end -----------------------------------------------------------------------------


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted tiny run; later runs share its corpus and tokenizer."""
    out = tmp_path_factory.mktemp("straight")
    summary = main(["--tiny", "--quiet", "--out", str(out), "--steps", "30",
                    "--log-ids", str(out / "ids.jsonl")])
    return out, summary, read_log(out / "ids.jsonl")


def shared(reference_out: Path) -> list[str]:
    return ["--data", str(reference_out / "corpus"),
            "--tokenizer", str(reference_out / "tokenizer.json")]


def test_tiny_run_trains_and_evaluates(reference):
    out, summary, log = reference
    assert gc.get_freeze_count() == 0  # the example froze the heap while training, not after
    assert [entry["step"] for entry in log] == list(range(1, 31))
    assert all(len(entry["ids"]) == 4 for entry in log)  # --tiny batch size
    history = summary["history"]
    assert history[-1][1] < history[0][1]  # the loss goes down
    assert summary["epoch"] >= 1  # 30 steps of 4 over 96 records cross an epoch boundary
    for name in ("model", "lead3"):
        assert set(summary["eval"][name]) == {"rouge1", "rouge2", "rougeL"}
    assert summary["eval"]["lead3"]["rouge1"] > 0
    assert 0 <= summary["stall"]["wait_fraction"] <= 1
    assert json.loads((out / "results.json").read_text())["steps"] == 30


@pytest.mark.parametrize(("workers", "batching"), [(0, "bucket"), (2, "tokens")])
def test_stop_and_resume_sees_the_same_data(reference, tmp_path, workers, batching):
    ref_out, _, _ = reference

    def args(name: str) -> list[str]:
        return ["--tiny", "--quiet", "--steps", "30", "--out", str(tmp_path / name),
                "--log-ids", str(tmp_path / f"{name}.jsonl"), "--num-workers", str(workers),
                "--batching", batching, "--eval-records", "2", *shared(ref_out)]

    straight = main(args("straight"))
    stopped = main([*args("interrupted"), "--stop-after", "11"])
    assert stopped["stopped_early"] and stopped["steps"] == 11
    assert len(read_log(tmp_path / "interrupted.jsonl")) == 11
    resumed = main([*args("interrupted"), "--resume"])
    assert resumed["steps"] == 30
    expected = read_log(tmp_path / "straight.jsonl")
    got = read_log(tmp_path / "interrupted.jsonl")
    assert [e["step"] for e in got] == list(range(1, 31))
    assert [e["ids"] for e in got] == [e["ids"] for e in expected]
    # model, optimizer, schedule and RNG states came back too: the losses agree
    assert [e["loss"] for e in got] == pytest.approx([e["loss"] for e in expected], rel=1e-5)
    assert [s for s, _ in resumed["history"]] == [s for s, _ in straight["history"]]
    assert [v for _, v in resumed["history"]] == pytest.approx(
        [v for _, v in straight["history"]], rel=1e-5)


def test_resume_refuses_changed_arguments(reference, tmp_path):
    ref_out, _, _ = reference
    args = ["--tiny", "--quiet", "--out", str(tmp_path), *shared(ref_out)]
    main([*args, "--stop-after", "2"])
    with pytest.raises(SystemExit, match="batch_size"):
        main([*args, "--resume", "--batch-size", "3"])


def kill_after_steps(args: list[str], ids: Path, steps: int, *, script: Path = SCRIPT) -> None:
    """Run the example in a subprocess and SIGKILL it once `ids` logs `steps` steps."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), *args, "--throttle", "0.1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if ids.exists() and len(ids.read_text().splitlines()) >= steps:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()


def test_killed_run_resumes_from_its_last_checkpoint(reference, tmp_path):
    ref_out, _, expected = reference
    out, ids = tmp_path / "killed", tmp_path / "ids.jsonl"
    args = ["--tiny", "--quiet", "--steps", "30", "--out", str(out), "--log-ids", str(ids),
            *shared(ref_out)]
    kill_after_steps(args, ids, 10)
    logged = len(ids.read_text().splitlines())
    assert 10 <= logged < 30
    main([*args, "--resume"])  # trims the log to the checkpoint and redoes the rest
    got = read_log(ids)
    assert [e["step"] for e in got] == list(range(1, 31))
    assert [e["ids"] for e in got] == [e["ids"] for e in expected]
    assert [e["loss"] for e in got] == pytest.approx([e["loss"] for e in expected], rel=1e-5)


# --- two corpora mixed (--mix) ----------------------------------------------------------------

MIX = ["--mix", "pubmed:0.7,arxiv:0.3"]


@pytest.fixture(scope="module")
def mixed_reference(reference, tmp_path_factory):
    """An uninterrupted tiny run over synthetic PubMed and arXiv corpora, mixed 0.7 / 0.3."""
    ref_out, _, _ = reference
    out = tmp_path_factory.mktemp("mixed")
    summary = main(["--tiny", "--quiet", "--out", str(out), "--steps", "30", *MIX,
                    "--tokenizer", str(ref_out / "tokenizer.json"), "--eval-records", "2",
                    "--log-ids", str(out / "ids.jsonl")])
    return out, summary, read_log(out / "ids.jsonl")


def mixed_args(mixed_out: Path, out: Path, log: Path) -> list[str]:
    return ["--tiny", "--quiet", "--steps", "30", "--out", str(out), "--log-ids", str(log),
            *MIX, "--data", str(mixed_out / "corpus"), "--eval-records", "2",
            "--tokenizer", str(mixed_out / "tokenizer.json")]


def test_mixed_run_draws_both_corpora_in_proportion(mixed_reference):
    _, summary, log = mixed_reference
    ids = [i for entry in log for i in entry["ids"]]
    arxiv = sum(1 for i in ids if not i.startswith("PMC"))  # arXiv ids look like 1001.0042
    assert summary["mix"]["records"] == {"pubmed": len(ids) - arxiv, "arxiv": arxiv}
    bound = 4.5 * (len(ids) * 0.3 * 0.7) ** 0.5
    assert abs(arxiv - 0.3 * len(ids)) <= bound


@pytest.mark.parametrize("workers", [0, 2])
def test_mixed_run_stops_and_resumes_with_the_same_data(mixed_reference, tmp_path, workers):
    mixed_out, _, _ = mixed_reference
    workers_arg = ["--num-workers", str(workers)]
    args = [*mixed_args(mixed_out, tmp_path / "run", tmp_path / "ids.jsonl"), *workers_arg]
    straight = main([*mixed_args(mixed_out, tmp_path / "straight", tmp_path / "straight.jsonl"),
                     *workers_arg])
    main([*args, "--stop-after", "13"])
    resumed = main([*args, "--resume"])
    expected, got = read_log(tmp_path / "straight.jsonl"), read_log(tmp_path / "ids.jsonl")
    assert [e["step"] for e in got] == list(range(1, 31))
    assert [e["ids"] for e in got] == [e["ids"] for e in expected]
    assert [e["loss"] for e in got] == pytest.approx([e["loss"] for e in expected], rel=1e-5)
    assert resumed["mix"] == straight["mix"]


def test_killed_mixed_run_resumes_from_its_last_checkpoint(mixed_reference, tmp_path):
    mixed_out, _, expected = mixed_reference
    ids = tmp_path / "ids.jsonl"
    args = mixed_args(mixed_out, tmp_path / "killed", ids)
    kill_after_steps(args, ids, 10)
    assert 10 <= len(ids.read_text().splitlines()) < 30
    main([*args, "--resume"])
    got = read_log(ids)
    assert [e["step"] for e in got] == list(range(1, 31))
    assert [e["ids"] for e in got] == [e["ids"] for e in expected]


def test_mix_arguments_are_checked():
    with pytest.raises(SystemExit, match="NAME:WEIGHT"):
        main(["--tiny", "--quiet", "--mix", "pubmed=0.7"])
    with pytest.raises(SystemExit, match="no synthetic corpus named"):
        main(["--tiny", "--quiet", "--mix", "pubmed:0.5,wiki:0.5"])
