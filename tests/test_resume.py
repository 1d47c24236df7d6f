"""Exact resume (DESIGN.md guarantee 3): a state taken after any item continues exactly.

Every test runs `resume_contract.run_test_save_load_state`: the stages on their own (every
record of tiny corpora), then the whole dataset under torchdata's StatefulDataLoader with 0-3
workers (every batch boundary of a small corpus of every shard format; random cuts of a larger
one). Then the refusals: a state of another dataset or another world, and what a state costs.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import corpus
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume_contract import ids, records, run_test_save_load_state, write_mixed
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import StateMismatchError, StreamingJsonl
from streamds.stages.balance import EvenRanks
from streamds.stages.lines import Lines
from streamds.stages.parse import Parse
from streamds.stages.records import Records, fetch_records
from streamds.stages.shuffle import Shuffle
from streamds.stages.state import STATE_FORMAT
from streamds.stages.transform import Transform
from streamds.storage.plan import make_blocks
from streamds.storage.shards import resolve_shards

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

# shard writers by suffix; each takes (path, decoded JSONL bytes)
FORMATS: dict[str, Callable[[Path, bytes], Path]] = {
    "plain.jsonl": corpus.write_plain,
    "seekable.jsonl.zst": lambda path, data: corpus.write_seekable_zst(path, data, frame_size=8192),
    "foreign.jsonl.zst": corpus.write_foreign_zst,
    "gzip.jsonl.gz": corpus.write_gz,
    "json-members.tar": corpus.write_tar_json,
    "jsonl-members.tar": corpus.write_tar_jsonl,
}


def keep(record: dict[str, Any]) -> bool:
    return record["id"] % 5 != 1


def slim(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "length": len(record["text"])}


# -- stages on their own: a cut at every record ----------------------------------------------


def write_tiny(directory: Path, suffix: str, *, defects: bool) -> list[Path]:
    """Three shards of one format, 9-12 records each; with a blank and a malformed line."""
    directory.mkdir()
    paths = []
    for shard, count in enumerate((12, 9, 11)):
        data = corpus.jsonl(records(count, 100 * shard))
        if defects and shard == 1:
            lines = data.split(b"\n")
            lines[3:3] = [b"", b'{"id": "cut']
            data = b"\n".join(lines)
        paths.append(FORMATS[suffix](directory / f"part-{shard}.{suffix}", data))
    return paths


STEPS = [("filter", keep), ("map", slim)]


def stages(paths: list[Path], *, on_error: str = "raise", steps=()) -> dict[str, Any]:
    """Every chunk stage over `paths`, each wrapping the one before (lines -> transform)."""
    shards = resolve_shards([str(path) for path in paths])
    blocks = make_blocks(shards)
    lines = Lines(shards, blocks, [(block, None) for block in range(len(blocks))],
                  on_error=on_error)
    parse = Parse(lines, shards, blocks, on_error=on_error)
    transform = Transform(parse, steps)

    def fetch(positions):
        return fetch_records(positions, shards=shards, blocks=blocks,
                             prepare=lambda chunk: transform.transform(parse.parse(chunk)))

    return {"lines": lines, "parse": parse, "transform": transform, "fetch": fetch}


def record_stream(paths: list[Path], **options: Any) -> Records:
    return Records(stages(paths, **options)["transform"])


def shuffle_stage(paths: list[Path], size: int, *, round_size: int | None = None,
                  steps=STEPS) -> Shuffle:
    chain = stages(paths, steps=steps)
    return Shuffle(chain["transform"], size=size, seed_parts=(7,), fetch=chain["fetch"],
                   round_size=round_size)


@pytest.mark.parametrize("suffix", FORMATS)
def test_record_stream_resumes_at_every_record(tmp_path: Path, suffix: str) -> None:
    paths = write_tiny(tmp_path / "c", suffix, defects=True)

    def make() -> Records:
        return record_stream(paths, on_error="skip", steps=STEPS)

    reference = run_test_save_load_state(make, range(0, 26), after=lambda stream: stream.counts)
    assert len(reference) == 32 - 7  # 32 records, 7 filtered out; the bad line yields none
    final = make()
    list(final)
    assert final.counts["bad"] == 1 and final.counts["dropped"] == 7


@pytest.mark.parametrize("stage", ["lines", "parse", "transform", "even"])
def test_every_chunk_stage_resumes_at_every_record(tmp_path: Path, stage: str) -> None:
    """The contract through each stage on its own, read record by record."""
    paths = write_tiny(tmp_path / "c", "plain.jsonl", defects=False)

    def make() -> Records:
        chain = stages(paths, steps=STEPS)
        if stage == "even":
            return Records(EvenRanks(chain["transform"], 17))
        return Records(chain[stage])

    count = {"lines": 32, "parse": 32, "transform": 25, "even": 17}[stage]
    reference = run_test_save_load_state(make, range(0, count + 1))
    assert len(reference) == count


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize("round_size", [None, 1, 4])
def test_shuffle_buffer_resumes_at_every_record(
    tmp_path: Path, size: int, round_size: int | None
) -> None:
    paths = [
        *write_tiny(tmp_path / "plain", "plain.jsonl", defects=False),
        *write_tiny(tmp_path / "zst", "seekable.jsonl.zst", defects=False),
        *write_tiny(tmp_path / "tar", "jsonl-members.tar", defects=False),
    ]

    def make() -> Shuffle:
        return shuffle_stage(paths, size, round_size=round_size)

    reference = run_test_save_load_state(make, range(0, 3 * 25 + 1))
    assert len(reference) == 3 * 25
    if size > 1:  # the buffer really shuffles, so a resume has an order to get wrong
        assert reference != sorted(reference, key=lambda record: record["id"])


def test_taking_the_shuffle_state_is_constant_time(tmp_path: Path) -> None:
    """Between snapshots the state is the same packed bytes object: nothing is re-packed."""
    paths = write_tiny(tmp_path / "plain", "plain.jsonl", defects=False)
    stage = shuffle_stage(paths, 5, round_size=10, steps=())
    iterator = iter(stage)
    for _ in range(12):
        next(iterator)
    first = stage.get_state()
    next(iterator)
    second = stage.get_state()
    assert second["positions"] is first["positions"]  # the same snapshot, not a new packing
    assert (first["round"], first["since"], second["since"]) == (1, 2, 3)


# -- the contract catches broken states ------------------------------------------------------


def next_line_start(data: bytes, offset: int) -> int:
    return data.index(b"\n", offset) + 1


def test_contract_catches_a_state_moved_by_one_line(tmp_path: Path) -> None:
    paths = write_tiny(tmp_path / "c", "plain.jsonl", defects=False)
    data = {str(path): path.read_bytes() for path in paths}
    urls = [str(path) for path in paths]

    class OneLineAhead(Records):
        def get_state(self) -> dict[str, Any]:
            state = dict(super().get_state())
            if state["item"] >= 0:
                text = data[urls[self._chunk.block]]  # one block per tiny shard
                if state["offset"] < len(text):
                    state["offset"] = next_line_start(text, state["offset"])
            return state

    def make() -> Records:
        return OneLineAhead(stages(paths)["transform"])

    with pytest.raises(AssertionError, match="differs from the uninterrupted run"):
        run_test_save_load_state(make, range(1, 12))


def test_contract_catches_a_state_that_is_ignored(tmp_path: Path) -> None:
    paths = write_tiny(tmp_path / "c", "plain.jsonl", defects=False)

    class Forgetful(Records):
        def reset(self, state: dict[str, Any] | None = None) -> None:
            super().reset(None)

    def make() -> Forgetful:
        return Forgetful(stages(paths)["transform"])

    with pytest.raises(AssertionError, match="resume after 1 of 32"):
        run_test_save_load_state(make, [1])


def test_contract_catches_a_lost_shuffle_buffer(tmp_path: Path) -> None:
    paths = write_tiny(tmp_path / "c", "plain.jsonl", defects=False)

    class LosesBuffer(Shuffle):
        def get_state(self) -> dict[str, Any]:
            state = super().get_state()
            state[self.POSITIONS] = shuffle_stage(paths, 1).get_state()[self.POSITIONS]
            return state  # an empty buffer, in whatever form it is kept

    def make() -> LosesBuffer:
        chain = stages(paths)
        return LosesBuffer(chain["transform"], size=8, seed_parts=(7,), fetch=chain["fetch"],
                           round_size=4)

    with pytest.raises(AssertionError, match="differs from the uninterrupted run"):
        run_test_save_load_state(make, [10])


def shift_reader_offsets(found: Any, data: bytes) -> int:
    """Move the position of every started, unshuffled reader state in `found` one line on."""
    moved = 0
    if isinstance(found, dict):
        if found.get("stage") == "compact":  # a worker's state: the tree with long values apart
            return shift_reader_offsets(found["tree"][0], data)
        if found.get("format") == STATE_FORMAT:
            position = found["pipeline"]
            if position is None:
                return 0
            if position["item"] < 0:  # between chunks: the line reader holds the position
                position = position["source"]
                while "item" not in position:
                    position = position["source"]
            if position["offset"] is not None and 0 <= position["offset"] < len(data):
                position["offset"] = next_line_start(data, position["offset"])
                moved += 1
            return moved
        return sum(shift_reader_offsets(value, data) for value in found.values())
    return moved


@pytest.mark.parametrize("num_workers", [0, 2])
def test_contract_catches_a_loader_state_moved_by_one_line(
    tmp_path: Path, num_workers: int
) -> None:
    path = tmp_path / "one.jsonl"
    data = corpus.jsonl(records(120, 0))
    path.write_bytes(data)
    moved: list[int] = []

    class Tampering(StatefulDataLoader):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            moved.append(shift_reader_offsets(state, data))
            super().load_state_dict(state)

    def make() -> StatefulDataLoader:
        return Tampering(
            StreamingJsonl(str(path)), batch_size=8, num_workers=num_workers, collate_fn=ids
        )

    with pytest.raises(AssertionError, match="differs from the uninterrupted run"):
        run_test_save_load_state(make, [3])
    assert moved and moved[0] >= 1


# -- the whole dataset under StatefulDataLoader ------------------------------------------------


def loader_maker(
    source: Path, *, num_workers: int, shuffle: bool, batch_size: int = 16,
    filtered: bool = True, **options: Any
) -> Callable[[], StatefulDataLoader]:
    def make() -> StatefulDataLoader:
        dataset = StreamingJsonl(str(source), shuffle=shuffle, seed=3, buffer_size=16, **options)
        dataset = (dataset.filter(keep) if filtered else dataset).map(slim)
        return StatefulDataLoader(
            dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=ids
        )

    return make


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_loader_resumes_at_every_batch_boundary(
    mixed: tuple[Path, list[int]], num_workers: int, shuffle: bool
) -> None:
    source, every = mixed
    make = loader_maker(source, num_workers=num_workers, shuffle=shuffle, batch_size=32)
    reference = list(make())
    run_test_save_load_state(make, range(len(reference) + 1), expected=reference)
    flat = [i for batch in reference for i in batch]
    assert sorted(flat) == sorted(i for i in every if i % 5 != 1)  # the whole epoch, once
    assert (flat == sorted(flat)) is (not shuffle and num_workers <= 1)


@pytest.mark.parametrize("suffix", FORMATS)
def test_each_format_resumes_under_workers(tmp_path: Path, suffix: str) -> None:
    directory = tmp_path / "c"
    directory.mkdir()
    FORMATS[suffix](directory / f"a.{suffix}", corpus.jsonl(records(130, 0, width=1200)))
    FORMATS[suffix](directory / f"b.{suffix}", corpus.jsonl(records(20, 500)))
    make = loader_maker(directory, num_workers=2, shuffle=True, batch_size=8)
    reference = list(make())
    cuts = [1, len(reference) // 2, len(reference) - 1]
    run_test_save_load_state(make, cuts, expected=reference)


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_resume_with_even_ranks(mixed: tuple[Path, list[int]], mode: str) -> None:
    source, _ = mixed
    for rank in (0, 1):
        make = loader_maker(
            source,
            num_workers=2,
            shuffle=True,
            batch_size=8,
            rank=rank,
            world_size=2,
            even_ranks=mode,
            filtered=mode == "pad",  # a filter under "drop" is refused (quotas count lines)
        )
        reference = list(make())
        run_test_save_load_state(
            make, [1, len(reference) // 2, len(reference) - 1], expected=reference
        )


def test_dataset_state_resumes_without_a_loader(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed

    def make() -> StreamingJsonl:
        return StreamingJsonl(str(source), shuffle=True, seed=5, buffer_size=32).filter(keep)

    run_test_save_load_state(make, [0, 1, 31, 32, 33, 150, 256, 257])


def test_state_carries_the_epoch(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed

    def make() -> StreamingJsonl:
        return StreamingJsonl(str(source), shuffle=True, seed=5, buffer_size=32)

    epoch1 = make()
    epoch1.set_epoch(1)
    whole = [record["id"] for record in epoch1]
    first = make()
    first.set_epoch(1)
    iterator = iter(first)
    prefix = [next(iterator)["id"] for _ in range(40)]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    fresh = make()  # epoch 0 until the state says otherwise
    fresh.load_state_dict(state)
    assert prefix + [record["id"] for record in fresh] == whole
    epoch0 = [record["id"] for record in make()]
    assert epoch0 != whole


LARGE_BATCHES: dict[tuple[int, bool], list[list[int]]] = {}


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("resume") / "large"
    write_mixed(directory, scale=4)
    return directory


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_loader_resumes_at_random_cut_points(large: Path, data: st.DataObject) -> None:
    num_workers = data.draw(st.integers(0, 3), label="num_workers")
    shuffle = data.draw(st.booleans(), label="shuffle")
    make = loader_maker(large, num_workers=num_workers, shuffle=shuffle, batch_size=24)
    key = (num_workers, shuffle)
    if key not in LARGE_BATCHES:
        LARGE_BATCHES[key] = list(make())
    reference = LARGE_BATCHES[key]
    cuts = data.draw(st.lists(st.integers(0, len(reference)), min_size=1, max_size=2), label="cuts")
    run_test_save_load_state(make, cuts, expected=reference)


# -- refusals ------------------------------------------------------------------------------------


def taken_state(source: str | list[str], **options: Any) -> dict[str, Any]:
    dataset = StreamingJsonl(source, **options)
    iterator = iter(dataset)
    for _ in range(5):
        next(iterator)
    return dataset.state_dict()


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"seed": 4}, "seed=3 in the state, 4 here"),
        ({"shuffle": False}, "shuffle=True in the state, False here"),
        ({"buffer_size": 17}, "buffer_size=16 in the state, 17 here"),
        ({"source": "other"}, r"other size: 'part-0.jsonl' \(\d+ bytes in the state, \d+ here\)"),
        ({"source": "fewer"}, r"missing here \(only in the state\): 'part-5.jsonl.zst'"),
    ],
    ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, dict) else "",
)
def test_state_of_another_dataset_is_refused(
    mixed: tuple[Path, list[int]], tmp_path: Path, changed: dict[str, Any], message: str
) -> None:
    source, _ = mixed
    options = {"shuffle": True, "seed": 3, "buffer_size": 16}
    state = taken_state(str(source), **options)
    other = {**options, **changed}
    target: str | list[str] = str(source)
    if other.pop("source", None) == "other":  # the corpus elsewhere, one file grown
        write_mixed(tmp_path / "copy")
        with open(tmp_path / "copy" / "part-0.jsonl", "ab") as grown:
            grown.write(b'{"id": -1}\n')
        target = str(tmp_path / "copy")
    elif "source" in changed:
        target = sorted(str(path) for path in source.iterdir())[:-1]
    with pytest.raises(StateMismatchError, match=message) as refused:
        StreamingJsonl(target, **other).load_state_dict(state)
    assert "build the dataset over the files and with the settings" in str(refused.value)


def test_something_else_is_refused_as_a_state(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    dataset = StreamingJsonl(str(source))
    for wrong in ({}, {"stream": None}, [1, 2]):
        with pytest.raises(StateMismatchError, match="state_dict"):
            dataset.load_state_dict(wrong)  # type: ignore[arg-type]


def test_a_state_with_a_missing_or_unknown_key_is_refused(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    state = taken_state(str(source), shuffle=True, buffer_size=16)
    missing = {key: value for key, value in state.items() if key != "quota"}
    with pytest.raises(StateMismatchError, match=r"missing keys \['quota'\]"):
        StreamingJsonl(str(source), shuffle=True, buffer_size=16).load_state_dict(missing)
    unknown = {**state, "stream": {}}
    with pytest.raises(StateMismatchError, match=r"unknown keys \['stream'\]"):
        StreamingJsonl(str(source), shuffle=True, buffer_size=16).load_state_dict(unknown)


@pytest.mark.parametrize(("version", "message"), [
    ("streamds.state/1", "a state from another version of streamds"),
    ("streamds/9", "a state from another version of streamds"),
    ("other/1", "unknown state format 'other/1'"),
])
def test_a_state_of_another_version_is_refused(
    mixed: tuple[Path, list[int]], version: str, message: str
) -> None:
    source, _ = mixed
    state = {**taken_state(str(source)), "format": version}
    with pytest.raises(StateMismatchError, match=message):
        StreamingJsonl(str(source)).load_state_dict(state)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [((0, 2), (1, 2)), ((1, 2), (1, 3)), ((0, 2), (None, None)), ((0, 1), (0, 2))],
)
def test_state_of_another_rank_is_refused(
    mixed: tuple[Path, list[int]], saved: tuple[int, int], loaded: tuple[Any, Any]
) -> None:
    source, _ = mixed
    state = taken_state(str(source), rank=saved[0], world_size=saved[1])
    dataset = StreamingJsonl(str(source), rank=loaded[0], world_size=loaded[1])
    dataset.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="merge_states"):
        next(iter(dataset))


@pytest.mark.parametrize(("saved", "loaded"), [(2, 3), (2, 1)])
def test_state_of_other_workers_is_refused(
    mixed: tuple[Path, list[int]], saved: int, loaded: int
) -> None:
    source, _ = mixed
    first = loader_maker(source, num_workers=saved, shuffle=False)()
    iterator = iter(first)
    next(iterator)
    next(iterator)
    state = first.state_dict()
    del iterator, first
    fresh = loader_maker(source, num_workers=loaded, shuffle=False)()
    fresh.load_state_dict(state)
    before = set(multiprocessing.active_children())
    with pytest.raises(StateMismatchError, match="merge_states"):
        list(fresh)
    # The loader raises while building its iterator and leaves that iterator's workers
    # waiting; end them here rather than let interpreter exit wait 5 s for each.
    for worker in set(multiprocessing.active_children()) - before:
        worker.terminate()
        worker.join()


# -- what a state costs ------------------------------------------------------------------------


def pickled_state_after(path: Path, consumed: int) -> bytes:
    dataset = StreamingJsonl(str(path), shuffle=True, buffer_size=10_000)
    loader = StatefulDataLoader(dataset, batch_size=100, num_workers=0, collate_fn=ids)
    iterator = iter(loader)
    for _ in range(consumed // 100):
        next(iterator)
    return pickle.dumps(loader.state_dict())


def test_state_stays_small_and_independent_of_corpus_size(tmp_path: Path) -> None:
    sizes = {}
    for count in (30_000, 120_000):
        path = tmp_path / f"corpus-{count}.jsonl"
        path.write_bytes(corpus.jsonl({"id": i, "text": f"payload-{i}"} for i in range(count)))
        blob = pickled_state_after(path, 12_000)  # the 10,000-record buffer is full
        assert b"payload" not in blob  # positions, never records
        sizes[count] = len(blob)
    assert max(sizes.values()) < 200_000, sizes
    assert sizes[120_000] < 1.3 * sizes[30_000], sizes


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_exactly_with_sparse_snapshots(
    mixed: tuple[Path, list[int]], num_workers: int
) -> None:
    """StatefulDataLoader(snapshot_every_n_steps=8), the cheaper setting the README suggests:
    torchdata replays the batches since the last snapshot, and the result is still exact."""
    source, _ = mixed

    def make() -> StatefulDataLoader:
        dataset = StreamingJsonl(str(source), shuffle=True, seed=3, buffer_size=16).filter(keep)
        return StatefulDataLoader(dataset, batch_size=8, num_workers=num_workers,
                                  collate_fn=ids, snapshot_every_n_steps=8)

    reference = list(make())
    run_test_save_load_state(make, [3, 9, 17, len(reference) - 1], expected=reference)
