"""EvalLoader and the gather cut in one process: two ranks simulated by two threads that
exchange their values through a barrier (the collectives' contract: every rank calls, every
rank gets every rank's value). Each rank reads its own share of an eval set whose ranks own
unequal numbers of batches; the steps must match and the cut rows must hold every record once.
The real 2-process run under Trainer is in tests/test_frameworks.py (slow)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import corpus
import pytest
import torch

from streamds import StreamingJsonl
from streamds.integrations.eval_loader import ENDED, EvalLoader, keep_rows, rows_of

WORLD = 2
BATCH = 4
SIZES = (13, 7, 9)  # one block a file; shuffle=False deals files 0 and 2 to rank 0, 1 to rank 1


class Board:
    """What the ranks' collectives share: an exchange every rank enters."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=60)
        self.values: list[Any] = [None] * ranks

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.barrier.wait()
        self.values[rank] = value
        self.barrier.wait()
        seen = list(self.values)
        self.barrier.wait()
        return seen


class ThreadRanks:
    def __init__(self, board: Board, rank: int) -> None:
        self.board, self.rank = board, rank

    def sizes(self, size: int) -> list[int]:
        return self.board.exchange(self.rank, size)

    def batch_from(self, batch: Any, source: int) -> Any:
        return self.board.exchange(self.rank, batch)[source]


def collate(records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"rid": torch.tensor([record["id"] for record in records])}


def write_eval_set(root: Path, sizes: tuple[int, ...]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    start = 0
    for part, size in enumerate(sizes):
        corpus.write(root / f"part-{part}.jsonl", corpus.make_records(size, start=start))
        start += size
    return str(root)


def run_ranks(source: str, *, workers: int = 0,
              collate_fn: Callable[[list[dict[str, Any]]], Any] = collate,
              ) -> list[dict[str, Any]]:
    """Each rank's steps: (its rid batch, every rank's real rows, end_of_dataloader), the
    rows its loader kept over the ranks in all, or the error it raised."""
    board = Board(WORLD)
    results: list[dict[str, Any]] = [{"steps": [], "error": None, "kept": None, "made": None}
                                     for _ in range(WORLD)]

    def rank_main(rank: int) -> None:
        dataset = StreamingJsonl(source, rank=rank, world_size=WORLD)
        loader = EvalLoader(dataset, ranks=ThreadRanks(board, rank), batch_size=BATCH,
                            collate_fn=collate_fn, num_workers=workers)
        try:
            for batch in loader:
                results[rank]["steps"].append(
                    (batch["rid"], list(loader.rows), loader.end_of_dataloader))
            results[rank]["kept"] = loader.rows_kept
            results[rank]["made"] = loader.steps
        except Exception as err:
            results[rank]["error"] = err

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def gathered_ids(results: list[dict[str, Any]]) -> list[int]:
    """What Trainer's gathers would keep: each step's batches padded to equal rows,
    concatenated rank-major (accelerate's pad_across_processes and gather), then cut."""
    kept = []
    for steps in zip(*(result["steps"] for result in results), strict=True):
        rows = steps[0][1]
        assert all(step[1] == rows for step in steps)  # every rank agrees on the cut
        most = max(len(step[0]) for step in steps)
        padded = torch.cat([torch.nn.functional.pad(step[0], (0, most - len(step[0])), value=-1)
                            for step in steps])
        kept.extend(keep_rows(padded, rows).tolist())
    return kept


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_with_unequal_batches_make_equal_steps_and_count_each_record_once(
        tmp_path: Path, workers: int) -> None:
    results = run_ranks(write_eval_set(tmp_path, SIZES), workers=workers)
    assert [result["error"] for result in results] == [None, None]
    steps = [len(result["steps"]) for result in results]
    assert steps[0] == steps[1]
    assert [result["made"] for result in results] == steps  # what the loader says it made
    # rank 0 owns 22 records and rank 1 owns 7: rank 1 repeats its last batch, counted 0
    real = [[step[1][rank] for step in results[rank]["steps"]] for rank in range(WORLD)]
    assert sum(real[0]) == 22 and sum(real[1]) == 7
    assert 0 in real[1]
    kept = gathered_ids(results)
    assert sorted(kept) == list(range(sum(SIZES)))
    # every rank knows the rows kept over all ranks: the evaluation's samples
    assert [result["kept"] for result in results] == [sum(SIZES)] * WORLD
    # the last step is flagged on every rank, and only the last
    for result in results:
        assert [step[2] for step in result["steps"]] == [False] * (steps[0] - 1) + [True]


def test_a_rank_without_records_repeats_another_ranks_first_batch(tmp_path: Path) -> None:
    results = run_ranks(write_eval_set(tmp_path, (10,)))  # one block: rank 1 owns none
    assert [result["error"] for result in results] == [None, None]
    assert len(results[0]["steps"]) == len(results[1]["steps"]) == 3
    assert all(step[1][1] == 0 for step in results[1]["steps"])
    assert torch.equal(results[1]["steps"][0][0], results[0]["steps"][0][0])
    assert sorted(gathered_ids(results)) == list(range(10))


def test_an_error_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    def failing(records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if any(record["id"] == 17 for record in records):  # rank 1's second batch
            raise KeyError("broken record")
        return collate(records)

    results = run_ranks(write_eval_set(tmp_path, SIZES), collate_fn=failing)
    assert isinstance(results[1]["error"], KeyError)
    assert isinstance(results[0]["error"], RuntimeError)
    assert "rank(s) [1] failed" in str(results[0]["error"])
    # the loader reads one batch ahead (to flag the last step): both stop before step 0
    assert len(results[0]["steps"]) == len(results[1]["steps"]) == 0


def test_rows_are_counted_in_the_shapes_collates_return() -> None:
    from collections import UserDict

    tokens = torch.zeros(3, 5)
    for batch in ({"input_ids": tokens}, UserDict({"input_ids": tokens}), (tokens, tokens),
                  [{"id": 1}, {"id": 2}, {"id": 3}], {"meta": "x", "nested": {"ids": tokens}}):
        assert rows_of(batch) == 3
    with pytest.raises(ValueError, match="the collate must return tensors"):
        rows_of({"text": "no tensor"})


def test_keep_rows_keeps_each_ranks_real_rows() -> None:
    gathered = torch.tensor([0, 1, 2, 3, 10, 11, -1, -1, 20, 20, 20, 20])
    assert keep_rows(gathered, [4, 2, 0]).tolist() == [0, 1, 2, 3, 10, 11]
    with pytest.raises(ValueError, match="does not split"):
        keep_rows(gathered[:-1], [4, 2, 0])
    assert ENDED < 0


def eval_trainer(tmp_path: Path, eval_dataset: Any, seen: list[list[int]],
                 metric: Callable[..., dict[str, float]] | None = None, **options: Any) -> Any:
    """A StreamdsTrainer whose metric (by default) records the ids of the eval records it is
    given."""
    pytest.importorskip("transformers")
    import framework_worker as worker
    from transformers import TrainingArguments

    from streamds.integrations.transformers import StreamdsTrainer

    def record(prediction: Any) -> dict[str, float]:
        seen.append([int(i) for i in prediction.label_ids[1]])
        return {"records": float(len(prediction.label_ids[1]))}

    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True,
                             per_device_eval_batch_size=BATCH, remove_unused_columns=False,
                             label_names=["labels", "rid"], disable_tqdm=True, **options)
    trainer = worker.trainer_class(StreamdsTrainer)(
        model=worker.tiny_model(), args=args, eval_dataset=eval_dataset,
        data_collator=worker.collate, compute_metrics=metric or record)
    trainer.seen = []
    return trainer


def test_streamds_trainer_evaluates_and_predicts_through_the_eval_loader(tmp_path: Path) -> None:
    # one process: the same route as under torchrun (tests/test_frameworks.py), whose gathers
    # keep the real rows; accelerate's own gather is back afterwards
    source = write_eval_set(tmp_path / "eval", SIZES)
    seen: list[list[int]] = []
    trainer = eval_trainer(tmp_path, StreamingJsonl(source), seen)
    assert isinstance(trainer.get_eval_dataloader(), EvalLoader)
    metrics = trainer.evaluate()
    assert metrics["eval_records"] == sum(SIZES)
    assert sorted(seen[0]) == list(range(sum(SIZES)))
    assert trainer.gather_function == trainer.accelerator.gather_for_metrics
    predicted = trainer.predict(StreamingJsonl(source))
    assert sorted(predicted.label_ids[1].tolist()) == list(range(sum(SIZES)))


class MirrorRanks:
    """Two ranks in one process: the other rank reads the same share (sizes and gathers
    twice this rank's)."""

    rank = 0

    def __init__(self, accelerator: Any) -> None:
        pass

    def sizes(self, size: int) -> list[int]:
        return [size, size]

    def batch_from(self, batch: Any, source: int) -> Any:
        return batch


def two_rank_trainer(tmp_path: Path, monkeypatch: Any, ranks: type) -> tuple[Any, list]:
    """An evaluating Trainer of two ranks in one process (`ranks`: this rank's view of the
    other), its gathers doubled as the other rank's, and the ids each evaluation saw."""
    from accelerate.utils import recursively_apply

    import streamds.integrations.transformers as integration

    source = write_eval_set(tmp_path / "eval", SIZES)
    seen: list[list[int]] = []
    trainer = eval_trainer(tmp_path, StreamingJsonl(source), seen)
    monkeypatch.setattr(integration, "AccelerateRanks", ranks)
    monkeypatch.setattr(trainer.accelerator, "gather", lambda data: recursively_apply(
        lambda tensor: torch.cat([tensor, tensor]), data))
    return trainer, seen


def test_eval_speed_metrics_count_the_rows_of_every_rank(tmp_path: Path, monkeypatch) -> None:
    """eval_samples_per_second divides every rank's real rows (what the gathers keep), not
    this rank's: here two ranks of 29 rows each evaluate 58."""
    import transformers.trainer

    trainer, seen = two_rank_trainer(tmp_path, monkeypatch, MirrorRanks)
    speeds: list[dict[str, Any]] = []
    measure = transformers.trainer.speed_metrics

    def speed_metrics(split: str, start_time: float, **counts: Any) -> dict[str, float]:
        speeds.append(counts)
        return measure(split, start_time, **counts)

    monkeypatch.setattr(transformers.trainer, "speed_metrics", speed_metrics)
    metrics = trainer.evaluate()
    assert metrics["eval_records"] == 2 * sum(SIZES) and len(seen[0]) == 2 * sum(SIZES)
    assert [speed["num_samples"] for speed in speeds] == [2 * sum(SIZES)]  # both ranks' rows


class LongerOtherRank:
    """Two ranks in one process: the other rank's share is 12 batches of 1 row, more batches
    than this rank's (its rows of a step come from a copy of this rank's batch)."""

    rank = 0
    OTHER = [1] * 12

    def __init__(self, accelerator: Any) -> None:
        self.other = iter(self.OTHER)

    def sizes(self, size: int) -> list[int]:
        return [size, next(self.other, ENDED)]

    def batch_from(self, batch: Any, source: int) -> Any:
        return batch


def test_eval_steps_per_second_counts_the_steps_of_the_rank_with_the_most_batches(
        tmp_path: Path, monkeypatch) -> None:
    """This rank reads 29 rows (8 batches of 4), the other 12 rows in 12 batches of 1: the
    loop makes 12 steps, where Trainer's formula (41 rows over batches of 4) would say 11."""
    trainer, _ = two_rank_trainer(tmp_path, monkeypatch, LongerOtherRank)
    steps = len(LongerOtherRank.OTHER)
    assert steps != -(-(sum(SIZES) + steps) // (BATCH * trainer.args.world_size))
    metrics = trainer.evaluate()
    assert metrics["eval_records"] == sum(SIZES) + steps
    assert metrics["eval_steps_per_second"] == round(steps / metrics["eval_runtime"], 3)
    # rows per step, as the two speeds say (each over a runtime rounded to 0.1 ms)
    assert metrics["eval_samples_per_second"] / metrics["eval_steps_per_second"] == (
        pytest.approx((sum(SIZES) + steps) / steps, rel=0.03))
    predicted = trainer.predict(StreamingJsonl(str(tmp_path / "eval"))).metrics
    assert predicted["test_steps_per_second"] == round(steps / predicted["test_runtime"], 3)


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_an_eval_dataset_with_even_ranks_is_refused_naming_the_fix(
        tmp_path: Path, mode: str) -> None:
    source = write_eval_set(tmp_path / "eval", SIZES)
    trainer = eval_trainer(tmp_path, StreamingJsonl(source, even_ranks=mode), [])
    with pytest.raises(ValueError, match=rf"even_ranks='{mode}'.*even_ranks=None"):
        trainer.evaluate()


def test_an_eval_dataset_of_batches_is_refused_naming_the_eval_batch_size(
        tmp_path: Path) -> None:
    source = write_eval_set(tmp_path / "eval", SIZES)
    trainer = eval_trainer(tmp_path, StreamingJsonl(source).batch(8), [])
    with pytest.raises(ValueError, match=r"eval_dataset=ds, .*per_device_eval_batch_size=8"):
        trainer.evaluate()


@pytest.mark.parametrize("world", [(0, 2), (1, 2)])
def test_an_eval_dataset_of_another_world_is_refused(tmp_path: Path,
                                                     world: tuple[int, int]) -> None:
    # the old advice (rank=0, world_size=1 under N processes) would count every record N
    # times through the eval loader; here: one process, a dataset that reads half the set
    source = write_eval_set(tmp_path / "eval", SIZES)
    rank, world_size = world
    trainer = eval_trainer(tmp_path, StreamingJsonl(source, rank=rank, world_size=world_size),
                           [])
    with pytest.raises(ValueError, match=r"rank 0 of 1 process.*Leave rank and world_size unset"):
        trainer.evaluate()


def test_batch_eval_metrics_computes_the_result_at_the_last_step_only(tmp_path: Path) -> None:
    # accelerate's GradientState sees the eval loader's last step, as it sees its own loaders'
    source = write_eval_set(tmp_path / "eval", SIZES)
    flags: list[bool] = []
    rows: list[int] = []

    def per_batch(prediction: Any, compute_result: bool) -> dict[str, float]:
        flags.append(compute_result)
        rows.append(len(prediction.label_ids[1]))
        return {"records": float(sum(rows))}

    trainer = eval_trainer(tmp_path, StreamingJsonl(source), [], per_batch,
                           batch_eval_metrics=True)
    assert trainer.evaluate()["eval_records"] == sum(SIZES)
    assert flags == [False] * (len(flags) - 1) + [True]


def test_a_rank_owning_no_block_of_the_eval_set_reads_nothing(tmp_path: Path) -> None:
    # the dataset would refuse such a rank (a DDP job would wait for it); the eval loader
    # gives it another rank's batch instead, so StreamdsTrainer does not iterate it there
    pytest.importorskip("transformers")
    from streamds import PackTokens
    from streamds.integrations.transformers import _owns_no_block

    source = write_eval_set(tmp_path / "eval", (10,))  # one block
    packer = PackTokens(seq_len=4, eos_id=0, key="tokens")
    for rank, owns_none in ((0, False), (1, True)):
        dataset = StreamingJsonl(source, rank=rank, world_size=2)
        assert _owns_no_block(dataset) is owns_none
        assert _owns_no_block(dataset.pack(packer)) is owns_none
    assert not _owns_no_block(StreamingJsonl(write_eval_set(tmp_path / "big", SIZES), rank=1,
                                             world_size=2))
