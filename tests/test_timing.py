"""The timing seam: a reader built with a StageTimer says which stage its time goes to."""

from __future__ import annotations

import time
from pathlib import Path

import corpus

from streamds import StreamingJsonl
from streamds.stages.pipeline import Reader
from streamds.stages.timing import StageTimer


def slow(record: dict) -> dict:
    time.sleep(0.002)  # a transform that costs, for the timer to find (not synchronisation)
    return record


def test_timer_finds_the_stage_that_costs(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(corpus.jsonl({"id": i, "text": "x" * 50} for i in range(100)))
    dataset = StreamingJsonl(str(path), shuffle=True, buffer_size=10).map(slow)
    dataset.timer = StageTimer()
    taken = 0
    for taken, _ in enumerate(dataset, 1):
        if taken % 8 == 0:
            dataset.state_dict()
    assert taken == 100
    own = dataset.timer.exclusive(Reader.STAGES)
    assert own["transform"] >= 100 * 0.002
    assert own["transform"] > 5 * max(own["lines"], own["parse"], own["emit"])
    assert dataset.timer.seconds["state"] > 0


def test_no_timer_no_wrappers(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(corpus.jsonl({"id": i} for i in range(10)))
    dataset = StreamingJsonl(str(path))
    assert [r["id"] for r in dataset] == list(range(10))
    assert type(dataset._active.parse.source).__name__ == "Lines"
