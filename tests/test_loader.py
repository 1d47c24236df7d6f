"""`ds.loader(...)`: one call; exactly once, exact resume, len, collate in the workers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import corpus
import pytest
from resume_contract import ids, records, run_test_save_load_state

from streamds import StreamingJsonl
from streamds.train.loader import MESSAGE_RECORDS, Loader, auto_workers, usable_cpus

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]

COUNT = 300


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loader") / "part.jsonl"
    corpus.write_plain(path, corpus.jsonl(records(COUNT, 0)))
    return path


def pid_and_ids(batch: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """A collate that says which process ran it."""
    return os.getpid(), ids(batch)


def make(source: Path, workers: int, **options: Any) -> Loader:
    ds = StreamingJsonl(str(source), shuffle=True, seed=3, buffer_size=32)
    return ds.loader(7, num_workers=workers, batches_per_message=3, **options)


@pytest.mark.parametrize("workers", [0, 2])
def test_every_record_once_in_batches_made_by_the_workers(source: Path, workers: int) -> None:
    loader = make(source, workers, collate=pid_and_ids)
    batches = list(loader)
    flat = [i for _, batch in batches for i in batch]
    assert sorted(flat) == list(range(COUNT))
    assert all(len(batch) == 7 for _, batch in batches[:-workers or None][: COUNT // 7 - 2])
    made_in = {pid for pid, _ in batches}
    assert (os.getpid() in made_in) == (workers == 0)  # the collate ran in the workers


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_after_any_batch_resumes_exactly(source: Path, workers: int) -> None:
    # cuts inside a message of 3 batches, at its seams, and at the end
    run_test_save_load_state(lambda: make(source, workers, collate=ids), [0, 1, 3, 4, 8, 20])


def test_default_collate_hands_over_records_of_unequal_lists(tmp_path: Path) -> None:
    path = tmp_path / "ragged.jsonl"
    rows = [{"id": i, "text": "x" * i, "sections": ["a"] * (i % 4)} for i in range(20)]
    corpus.write_plain(path, corpus.jsonl(rows))
    batches = list(StreamingJsonl(str(path)).loader(8, num_workers=0))
    assert [len(batch) for batch in batches] == [8, 8, 4]
    assert batches[0][3] == rows[3]  # torch's default collate would fail on these


def test_set_epoch_chooses_the_order(source: Path) -> None:
    loader = make(source, 0, collate=ids)
    first = [i for batch in loader for i in batch]
    loader.set_epoch(1)
    second = [i for batch in loader for i in batch]
    assert sorted(first) == sorted(second) and first != second


def test_messages_hold_enough_records_by_default(source: Path) -> None:
    loader = StreamingJsonl(str(source)).loader(32, num_workers=2)
    assert loader.per_message * 32 >= MESSAGE_RECORDS
    assert StreamingJsonl(str(source)).loader(32, num_workers=0).per_message == 1


def test_auto_workers_follow_the_usable_cpus() -> None:
    cpus = usable_cpus()
    assert auto_workers() == (0 if cpus < 2 else min(cpus, 8))


@pytest.mark.parametrize(("options", "says"), [
    ({"collate_fn": ids}, "collate_fn= is set by Loader"),
    ({"num_workers": -1}, "num_workers"),
    ({"batches_per_message": 0}, "batches_per_message"),
])
def test_bad_options_are_refused_naming_them(source: Path, options: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        StreamingJsonl(str(source)).loader(8, **options)
