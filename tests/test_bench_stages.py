"""streamds bench times the real pipeline through the timing seam, stage by stage.

Each test puts a deliberate cost into one stage of the real pipeline (a slow transform, slow
storage, a shuffle buffer, a slow state) and checks that the bench charges it to that stage and
names it. Each would fail if the seam stopped timing that stage: the cost would land in
another row or in "collate/other".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import corpus
import pytest

import streamds.stages.lines
from streamds import StreamingJsonl
from streamds.stages.pipeline import Reader
from streamds.tools import bench

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SHORT = 20_000  # short records: the pipeline's own stages cost about a microsecond each


@pytest.fixture(scope="module")
def short_corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stages") / "short.jsonl"
    path.write_bytes(corpus.jsonl({"id": i, "t": "x" * (i % 7)} for i in range(SHORT)))
    return str(path)


def spin(seconds: float) -> None:
    """Busy CPU work for `seconds`: a deliberate cost, not synchronisation."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def slow_transform(record: dict[str, Any]) -> dict[str, Any]:
    spin(0.0005)  # a transform that costs, for the bench to find
    return record


def measure(dataset: StreamingJsonl, *, records: int = SHORT,
            state_every_batch: bool = True) -> dict[str, Any]:
    return bench.measure_pipeline(dataset, batch_size=32, records=records, seconds=30.0,
                                  state_every_batch=state_every_batch, progress=False)


def test_a_slow_transform_is_the_costliest_stage(tmp_path: Path) -> None:
    path = tmp_path / "small.jsonl"  # one read's worth: the transform runs on 300 records
    path.write_bytes(corpus.jsonl({"id": i, "text": "x" * 50} for i in range(300)))
    report = bench.run_bench(str(path), num_workers=[0], records=200,
                             transform=slow_transform)
    assert report["costliest"] == report["bottleneck"] == "transform"
    stages = report["stages"]
    assert stages["transform"]["seconds"] >= 200 * 0.0005  # at least the records emitted
    assert stages["transform"]["share"] > 0.5
    assert stages["transform"]["seconds"] > 10 * stages["parse"]["seconds"]
    assert report["recommendations"][0].startswith("your transform is the bottleneck")


def test_slow_storage_is_charged_to_read(short_corpus: str, monkeypatch) -> None:
    real = streamds.stages.lines.read_lines

    def slow_storage(*args: Any, **kwargs: Any):
        for chunk in real(*args, **kwargs):
            time.sleep(0.05)  # storage latency per read: a deliberate cost, not synchronisation
            yield chunk

    monkeypatch.setattr(streamds.stages.lines, "read_lines", slow_storage)
    report = bench.run_bench(short_corpus, num_workers=[0], records=SHORT)
    assert report["costliest"] == report["bottleneck"] == "read"
    assert report["stages"]["read"]["share"] > 0.5
    assert report["cpu_share"] < bench.IO_BOUND  # the process slept: it waited on "storage"
    assert report["recommendations"][0].startswith("reading (storage) is the bottleneck")


def test_shuffle_buffer_time_lands_in_the_shuffle_row(short_corpus: str) -> None:
    plain = StreamingJsonl(short_corpus)
    shuffled = StreamingJsonl(short_corpus, shuffle=True, buffer_size=SHORT // 2)
    # least of three passes each: a pause of the machine must not decide the comparison
    plain_emit = min(measure(plain)["stages"]["emit"]["seconds"] for _ in range(3))
    runs = [measure(shuffled) for _ in range(3)]
    shuffle_emit = min(run["stages"]["emit"]["seconds"] for run in runs)
    assert all(run["records"] == SHORT for run in runs)
    assert shuffle_emit > 0
    # a draw from the buffer per record costs more than handing out a chunk's records
    assert shuffle_emit > plain_emit
    report = bench.run_bench(short_corpus, num_workers=[0], records=SHORT, shuffle=True,
                             buffer_size=SHORT // 2)
    assert report["stages"]["emit"]["seconds"] > 0
    assert "\nshuffle " in bench.format_report(report)


def test_state_time_is_reported_when_taken_and_zero_when_not(short_corpus: str) -> None:
    dataset = StreamingJsonl(short_corpus, shuffle=True, buffer_size=100)
    on = measure(dataset)
    assert on["state_every_batch"] is True
    assert on["stages"]["state"]["seconds"] > 0
    # the seam's own share: Reader.reader_state, timed inside each ds.state_dict() call
    assert 0 < on["timer_seconds"]["state"] <= on["stages"]["state"]["seconds"]
    off = measure(dataset, state_every_batch=False)
    assert off["stages"]["state"]["seconds"] == 0.0
    assert "state" not in off["timer_seconds"] and "state_dict" not in off["timer_seconds"]
    assert dataset.timer is None  # the timer is detached after each pass


def test_a_slow_state_is_named_with_the_snapshot_fix(short_corpus: str, monkeypatch) -> None:
    real = Reader._reader_state

    def slow_state(self: Reader) -> Any:
        spin(0.002)  # a state that costs, for the bench to find
        return real(self)

    monkeypatch.setattr(Reader, "_reader_state", slow_state)
    report = bench.run_bench(short_corpus, num_workers=[0], records=1000)
    assert report["costliest"] == report["bottleneck"] == "state"
    assert report["timer_seconds"]["state"] >= report["batches"] * 0.002
    assert "snapshot_every_n_steps" in report["recommendations"][0]
    off = bench.run_bench(short_corpus, num_workers=[0], records=1000,
                          state_every_batch=False)
    assert off["costliest"] != "state"


def test_rows_add_up_to_the_wall_time_and_nest(short_corpus: str) -> None:
    report = measure(StreamingJsonl(short_corpus).map(lambda record: record))
    seconds = report["timer_seconds"]
    chain = [seconds[name] for name in Reader.STAGES]
    assert chain == sorted(chain)  # a stage's time includes its sources'
    assert sum(s["seconds"] for s in report["stages"].values()) == pytest.approx(
        report["seconds"])
    assert report["stages"]["other"]["seconds"] == pytest.approx(
        report["seconds"] - seconds["emit"] - seconds["state_dict"])


def test_a_failing_pass_detaches_the_timer(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": 1}\nnot json\n')
    dataset = StreamingJsonl(str(path))
    with pytest.raises(ValueError, match="line 2"):
        measure(dataset)
    assert dataset.timer is None
