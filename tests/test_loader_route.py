"""`ds.loader`'s record-size route on a corpus whose first records are small and later ones
large: the route is chosen from lines sampled across the file, and on the small-record route
a worker's message ends at MESSAGE_BYTES of lines, so the memory in flight stays bounded,
with exact resume and merge."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import orjson
import pytest
from resume_contract import ids, run_test_save_load_state

from streamds import StreamingJsonl, merge_states
from streamds.datasets import reader_length
from streamds.stages.batch import Batch
from streamds.train import loader as loader_module
from streamds.train.loader import MESSAGE_RECORDS, SMALL_RECORD

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

SMALL, LARGE = 3000, 200  # ~100-byte records, then ~6 KB ones
BOUND = 150_000  # MESSAGE_BYTES in these tests: a few large records, many small ones


def rows() -> list[dict[str, Any]]:
    small = [{"id": i, "text": "s" * (60 + i % 41)} for i in range(SMALL)]
    large = [{"id": i, "text": "L" * (6000 + i % 97)} for i in range(SMALL, SMALL + LARGE)]
    return small + large


@pytest.fixture(scope="module")
def grows(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two files, each small records then large ones (the first 64 KiB all small)."""
    root = tmp_path_factory.mktemp("grows")
    every = rows()
    for part in (0, 1):
        mine = [row for row in every if row["id"] % 2 == part]
        (root / f"part-{part}.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n"
                                                          for r in mine))
    return str(root)


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader_module, "MESSAGE_BYTES", BOUND)


def test_the_route_is_chosen_from_lines_across_the_files(grows: str) -> None:
    ds = StreamingJsonl(grows)
    head = reader_length._window_mean(ds._shards[0], 0)  # what the first 64 KiB say
    assert head is not None and head < SMALL_RECORD
    assert ds.record_bytes() > 5000  # the windows over the large records say it
    assert not ds.loader(32, num_workers=0).small_records


def test_a_file_of_small_records_keeps_the_small_route(tmp_path: Path) -> None:
    path = tmp_path / "small.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": i, "t": "x" * 90}) + b"\n"
                              for i in range(20_000)))  # ~2 MB: 8 windows, all small
    size = StreamingJsonl(str(path)).record_bytes()
    assert size is not None and 95 < size < 115


def test_a_window_inside_one_long_line_counts_it_as_large(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    lines = [orjson.dumps({"id": 0, "t": "x" * 50})]
    lines += [orjson.dumps({"id": i, "t": "y" * 300_000}) for i in (1, 2)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    size = StreamingJsonl(str(path)).record_bytes()
    assert size is not None and size >= reader_length.SAMPLE_BYTES


def message_sizes(loader: Any) -> list[tuple[int, int]]:
    """(records, bytes of their JSON lines) of each message the loader's workers hand over."""
    return [(len(message), sum(len(orjson.dumps(r)) for r in message))
            for message in loader.loader]


@pytest.mark.usefixtures("bound")
def test_messages_of_growing_records_stay_bounded_in_bytes(grows: str) -> None:
    loader = StreamingJsonl(grows, shuffle=False).loader(32, num_workers=2,
                                                         small_records=True, collate=ids)
    sizes = message_sizes(loader)
    largest_line = max(len(orjson.dumps(r)) for r in rows())
    # each message ends once its lines reach BOUND: at most a list of Batch.PIECE past it
    assert max(size for _, size in sizes) <= BOUND + (Batch.PIECE - 1) * largest_line
    assert max(count for count, _ in sizes) <= MESSAGE_RECORDS
    # the training batches still hold every record once, all full but the last
    batches = list(loader)
    assert sorted(i for batch in batches for i in batch) == list(range(SMALL + LARGE))
    assert [len(batch) for batch in batches[:-1]] == [32] * (len(batches) - 1)


@pytest.mark.usefixtures("bound")
@pytest.mark.parametrize("workers", [1, 2])
def test_bounded_messages_resume_exactly(grows: str, workers: int) -> None:
    def make() -> Any:
        ds = StreamingJsonl(grows, shuffle=True, seed=3, buffer_size=64)
        return ds.loader(32, num_workers=workers, small_records=True, collate=ids)

    # cuts among the small records, inside messages of large ones, and near the end
    run_test_save_load_state(make, [3, 40, 80, 95, 99])


@pytest.mark.usefixtures("bound")
def test_bounded_messages_merge_exactly(grows: str) -> None:
    seen: list[int] = []
    states = []
    for rank in (0, 1):
        ds = StreamingJsonl(grows, shuffle=False, rank=rank, world_size=2)
        loader = ds.loader(32, num_workers=2, small_records=True, collate=ids)
        iterator = iter(loader)
        for _ in range(40):  # 1,280 of the rank's 1,382 or 1,818 records, large ones among them
            seen += next(iterator)
        states.append(pickle.loads(pickle.dumps(loader.state_dict())))
        del iterator
    assert all(state["skip"] for state in states)
    merged = merge_states(states)
    rest = [r["id"] for rank in range(3)
            for r in StreamingJsonl(grows, shuffle=False, rank=rank,
                                    world_size=3).with_resume(merged)]
    assert sorted(seen + rest) == list(range(SMALL + LARGE))
