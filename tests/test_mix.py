"""`streamds.Mix`: proportions, stopping rules, exactly once per source, exact and elastic resume.

Two corpora of a few plain JSONL files each (ids 0.. and 10_000..), shuffled; the mix yields
their records. Resume checks use the shared contract (`resume_contract`), every batch boundary
without workers, a few cuts with 1-3 workers, hypothesis cuts on the dataset itself.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import corpus
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resume_contract import ids, run_test_save_load_state, stop_ranks_part_way
from test_elastic import assert_exactly_once
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import (
    LengthBuckets,
    Mix,
    StateMismatchError,
    StreamingJsonl,
    merge_states,
    source_counts,
)
from streamds.stages.mixing import ROUND, Draws

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

SIZES = {"a": (4, 30, 0), "b": (3, 20, 10_000)}  # files, records per file, first id
WEIGHTS = [0.7, 0.3]


def write_source(directory: Path, files: int, per_file: int, first: int) -> list[int]:
    directory.mkdir(parents=True)
    every = []
    for number in range(files):
        start = first + number * per_file
        corpus.write_plain(directory / f"part-{number}.jsonl",
                           corpus.jsonl(corpus.make_records(per_file, start=start)))
        every += range(start, start + per_file)
    return every


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[int]]]:
    root = tmp_path_factory.mktemp("mix")
    return {name: (str(root / name), write_source(root / name, *size))
            for name, size in SIZES.items()}


def datasets(sources: dict[str, tuple[str, list[int]]], **world: Any) -> list[StreamingJsonl]:
    return [StreamingJsonl(path, shuffle=True, seed=5, buffer_size=8, **world)
            for path, _ in sources.values()]


def mix(sources: dict[str, tuple[str, list[int]]], stop: str = "all", **world: Any) -> Mix:
    return Mix(datasets(sources, **world), WEIGHTS, seed=9, stop=stop)


def every_id(sources: dict[str, tuple[str, list[int]]]) -> list[int]:
    return [i for _, every in sources.values() for i in every]


def record_ids(stream: Any) -> list[int]:
    return [record["id"] for record in stream]


# -- the draws ---------------------------------------------------------------------------------


def test_draws_are_a_function_of_their_index() -> None:
    parts = ("mix", 1, 0, 0, 0)
    whole = Draws(parts, 0)
    first = [next(whole) for _ in range(2 * ROUND + 5)]
    for start in (0, 1, ROUND - 1, ROUND, ROUND + 7, 2 * ROUND + 4):
        assert next(Draws(parts, start)) == first[start]
    assert next(Draws(("mix", 1, 0, 0, 1), 0)) != first[0]  # another worker draws otherwise


def test_same_inputs_same_sequence(sources) -> None:
    once = record_ids(mix(sources))
    assert once == record_ids(mix(sources))
    assert once != record_ids(Mix(datasets(sources), WEIGHTS, seed=10))
    other_epoch = mix(sources)
    other_epoch.set_epoch(1)
    assert record_ids(other_epoch) != once


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("large")
    return [write_source(root / name, 1, 3000, first) and str(root / name)
            for name, first in (("a", 0), ("b", 10_000), ("c", 20_000))]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 2], [0.9, 0.05, 0.05]])
def test_proportions_within_the_binomial_bound(large: list[str], weights: list[float]) -> None:
    """The first n records (no source runs out): source i's count ~ Binomial(n, p_i)."""
    n = 2000
    shares = [w / sum(weights) for w in weights]
    for seed in range(3):
        ds = [StreamingJsonl(path) for path in large[: len(weights)]]
        stream = iter(Mix(ds, weights, seed=seed))
        counts = Counter(next(stream)["id"] // 10_000 for _ in range(n))
        for index, p in enumerate(shares):
            bound = 4.5 * (n * p * (1 - p)) ** 0.5  # P(outside) < 1e-5 per check
            assert abs(counts[index] - n * p) <= bound, (seed, index, counts)


# -- stopping rules ----------------------------------------------------------------------------


def test_stop_all_yields_every_record_once(sources) -> None:
    m = mix(sources, "all")
    out = record_ids(m)
    assert_exactly_once([out], every_id(sources))
    assert m.taken == [len(every) for _, every in sources.values()]


def test_stop_first_ends_when_one_source_runs_out(sources) -> None:
    m = mix(sources, "first")
    out = record_ids(m)
    assert len(out) == len(set(out))
    sizes = [len(every) for _, every in sources.values()]
    assert sum(m.taken) == len(out)
    assert any(t == size for t, size in zip(m.taken, sizes, strict=True))
    assert not all(t == size for t, size in zip(m.taken, sizes, strict=True))


def test_stop_cycle_restarts_a_source_in_a_new_order(sources) -> None:
    m = mix(sources, "cycle")
    out = record_ids(m)
    state = m.state_dict()
    assert set(out) == set(every_id(sources))  # every source ran out at least once
    assert state["finished"] and state["ran_out"] == [True, True]
    repeated = [i for i, n in Counter(out).items() if n > 1]
    cycled = [index for index, passes in enumerate(state["passes"]) if passes]
    assert repeated and cycled
    assert all(i // 10_000 in cycled for i in repeated)
    # the new pass reads the source's next epoch: its own new order
    index = cycled[0]
    path = list(sources.values())[index][0]
    again = StreamingJsonl(path, shuffle=True, seed=5, buffer_size=8)
    again.set_epoch(1)
    second_pass = [i for i in out if i // 10_000 == index][len(list(sources.values())[index][1]):]
    assert second_pass == record_ids(again)[: len(second_pass)]


def test_a_source_with_nothing_for_this_reader_drops_out_of_a_cycle(sources, tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    ds = [*datasets(sources)[:1], StreamingJsonl(str(empty))]
    out = record_ids(Mix(ds, WEIGHTS, seed=1, stop="cycle"))
    assert sorted(out) == sources["a"][1]


# -- exactly once across workers and ranks -----------------------------------------------------


def run_world(sources, stop: str, world_size: int, workers: int) -> list[list[int]]:
    """What each rank's loader yields over one epoch."""
    out = []
    for rank in range(world_size):
        loader = DataLoader(mix(sources, stop, rank=rank, world_size=world_size),
                            batch_size=8, num_workers=workers, collate_fn=ids)
        out.append([i for batch in loader for i in batch])
    return out


@pytest.mark.parametrize(("world_size", "workers"), [(1, 3), (2, 2), (3, 0)])
def test_exactly_once_per_source_across_worlds(sources, world_size: int, workers: int) -> None:
    assert_exactly_once(run_world(sources, "all", world_size, workers), every_id(sources))
    first = [i for part in run_world(sources, "first", world_size, workers) for i in part]
    assert len(first) == len(set(first)) and set(first) <= set(every_id(sources))


# -- exact resume ------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["first", "all", "cycle"])
def test_resume_at_every_batch_boundary(sources, stop: str) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(mix(sources, stop), batch_size=6, num_workers=0,
                                  collate_fn=ids)

    reference = list(make())
    run_test_save_load_state(make, range(len(reference) + 1), expected=reference)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_resume_with_workers(sources, workers: int) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(mix(sources, "cycle"), batch_size=6, num_workers=workers,
                                  collate_fn=ids)

    reference = run_test_save_load_state(make, [1, 5])
    flat = [i for batch in reference for i in batch]
    assert set(flat) == set(every_id(sources))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(stop=st.sampled_from(["first", "all", "cycle"]), data=st.data())
def test_resume_at_hypothesis_cut_points(sources, stop: str, data: st.DataObject) -> None:
    reference = list(mix(sources, stop))
    cuts = data.draw(st.lists(st.integers(0, len(reference)), min_size=1, max_size=3))
    run_test_save_load_state(lambda: mix(sources, stop), cuts, expected=reference)


@pytest.mark.parametrize("stop", ["first", "all", "cycle"])
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_plain_loader_resume_after_any_batch(sources, stop: str, workers: int) -> None:
    """resume_after_batches: the rest of a plain DataLoader's epoch, worked out from counts."""
    def loader(data: Mix) -> DataLoader:
        return DataLoader(data, batch_size=5, num_workers=workers, collate_fn=ids)

    reference = list(loader(mix(sources, stop)))
    cuts = range(len(reference) + 1) if workers == 0 else [1, len(reference) // 2,
                                                           len(reference) - 1]
    for cut in cuts:
        resumed = mix(sources, stop).resume_after_batches(cut, batch_size=5,
                                                          num_workers=workers)
        rest = list(loader(resumed))
        assert reference[:cut] + rest == reference, f"resume after {cut} batches"


def text_length(record: dict[str, Any]) -> int:
    return len(record["text"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mix_batched_by_length_resumes_exactly(sources, workers: int) -> None:
    """The summarisation example's shape: Mix(...).batch(LengthBuckets), StatefulDataLoader."""
    def make() -> StatefulDataLoader:
        batched = mix(sources, "cycle").batch(
            LengthBuckets(4, buffer_size=16, length=text_length), collate=ids)
        return StatefulDataLoader(batched, batch_size=None, num_workers=workers)

    reference = run_test_save_load_state(make, [0, 3, 11])
    assert set(i for batch in reference for i in batch) == set(every_id(sources))


def test_plain_loader_resume_refuses_a_count_past_the_epoch(sources) -> None:
    length = len(list(DataLoader(mix(sources), batch_size=5, collate_fn=ids)))
    with pytest.raises(ValueError, match=f"yields {length} batches per epoch"):
        mix(sources).resume_after_batches(length + 1, batch_size=5, num_workers=0)


def test_source_counts_of_a_loader_state(sources) -> None:
    loader = StatefulDataLoader(mix(sources, "all"), batch_size=5, num_workers=2,
                                collate_fn=ids)
    iterator = iter(loader)
    seen = [i for _ in range(6) for i in next(iterator)]
    counts = source_counts(loader.state_dict())
    assert sum(counts) >= len(seen)  # workers may have read ahead of the batches delivered
    assert counts[1] > 0
    whole = list(iterator)
    assert len(whole) > 0
    assert source_counts(loader.state_dict()) == [len(e) for _, e in sources.values()]


# -- elastic resume ----------------------------------------------------------------------------


def stop_part_way(sources, stop: str, batches: Sequence[int]) -> tuple[list[int], list[Any]]:
    """2 ranks x 2 workers; rank r consumes batches[r] batches; (ids, checkpointed states)."""
    return stop_ranks_part_way(
        lambda rank: StatefulDataLoader(mix(sources, stop, rank=rank, world_size=2),
                                        batch_size=4, num_workers=2, collate_fn=ids),
        [batches[rank] for rank in range(2)])


@pytest.mark.parametrize(("world_size", "workers"), [(3, 1), (1, 0)])
def test_elastic_resume_of_a_mix(sources, world_size: int, workers: int) -> None:
    consumed, states = stop_part_way(sources, "all", [3, 5])
    merged = pickle.loads(pickle.dumps(merge_states(states)))
    rest = []
    for rank in range(world_size):
        resumed = Mix(datasets(sources, rank=rank, world_size=world_size), WEIGHTS, seed=9,
                      stop="all").with_resume(merged)
        loader = DataLoader(resumed, batch_size=4, num_workers=workers, collate_fn=ids)
        rest += [i for batch in loader for i in batch]
    assert_exactly_once([consumed, rest], every_id(sources))
    assert sum(source_counts(merged)) <= len(consumed) + 2 * 2 * 4  # workers' read-ahead


def test_elastic_resume_of_a_first_stop_mix_reads_nothing_twice(sources) -> None:
    consumed, states = stop_part_way(sources, "first", [2, 4])
    merged = merge_states(states)
    rest = record_ids(mix(sources, "first").with_resume(merged))
    assert len(consumed + rest) == len(set(consumed + rest))


def test_exact_resume_after_an_elastic_resume(sources) -> None:
    _, states = stop_part_way(sources, "all", [3, 1])
    merged = merge_states(states)

    def make() -> Mix:
        return Mix(datasets(sources, rank=1, world_size=3), WEIGHTS, seed=9,
                   stop="all").with_resume(merged)

    reference = list(make())
    run_test_save_load_state(make, range(0, len(reference) + 1, 3), expected=reference)


@pytest.mark.parametrize("stop", ["first", "all", "cycle"])
def test_a_finished_state_resumed_keeps_its_sources_states(sources, stop: str) -> None:
    """A reader resumed from a finished state (a worker that ran out before the others, at
    a checkpoint) yields nothing; its next state is still the finished one, sources included,
    so a merge of it reads none of its records again. Its next iterator starts the epoch."""
    whole = mix(sources, stop)
    reference = record_ids(whole)
    finished = pickle.loads(pickle.dumps(whole.state_dict()))
    assert finished["finished"]
    resumed = mix(sources, stop)
    resumed.load_state_dict(finished)
    assert record_ids(resumed) == []
    assert resumed.state_dict() == finished
    if stop == "all":
        merged = merge_states([resumed.state_dict()])
        assert record_ids(mix(sources).with_resume(merged)) == []
    assert record_ids(resumed) == reference  # nothing loaded is left behind in its sources


def test_a_mix_batched_by_length_merges_only_between_pools(sources) -> None:
    """A batched mix keeps the mix's state where its pool began: merged in the middle of a
    pool it would hand the pool's yielded batches out again, so merge_states refuses; at a
    pool's end it carries over every record once."""
    def bucketed(rank: int) -> Any:
        return mix(sources, "all", rank=rank, world_size=2).batch(
            LengthBuckets(4, buffer_size=16, length=text_length), collate=list)

    def stopped(batches: int) -> tuple[list[int], list[Any]]:
        consumed, states = [], []
        for rank in range(2):
            batcher = bucketed(rank)
            iterator = iter(batcher)
            for _ in range(batches):
                consumed += [record["id"] for record in next(iterator)]
            states.append(batcher.state_dict())
        return consumed, states

    _, mid_pool = stopped(3)
    with pytest.raises(ValueError, match="3 of its batches already handed out"):
        merge_states(mid_pool)
    consumed, at_pool_end = stopped(4)  # 16 records: one whole pool per rank
    rest = record_ids(mix(sources).with_resume(merge_states(at_pool_end)))
    assert_exactly_once([consumed, rest], every_id(sources))


def test_a_cycling_mix_merges_when_its_readers_are_in_one_pass(sources) -> None:
    consumed, states = stop_part_way(sources, "cycle", [1, 1])
    rest = record_ids(mix(sources, "cycle").with_resume(merge_states(states)))
    assert set(consumed + rest) == set(every_id(sources))
    for index, (_, every) in enumerate(sources.values()):  # the first pass: each record once
        remaining = set(every) - set(consumed)
        of_source = [i for i in rest if i // 10_000 == index]
        assert sorted(of_source[: len(remaining)]) == sorted(remaining)


def test_a_cycling_mix_in_different_passes_refuses_to_merge(sources) -> None:
    states = []
    for rank, count in ((0, 0), (1, 75)):
        m = mix(sources, "cycle", rank=rank, world_size=2)
        iterator = iter(m)
        for _ in range(count):
            next(iterator)
        states.append(m.state_dict())
    assert states[1]["passes"] != states[0]["passes"]
    with pytest.raises(ValueError, match="different passes"):
        merge_states(states)


# -- refusals ----------------------------------------------------------------------------------


def test_bad_arguments_name_the_fix(sources) -> None:
    ds = datasets(sources)
    with pytest.raises(ValueError, match="one weight per dataset"):
        Mix(ds, [1.0], seed=0)
    with pytest.raises(ValueError, match=r"weights\[1\] must be a finite number > 0"):
        Mix(ds, [1.0, 0.0], seed=0)
    with pytest.raises(ValueError, match="stop must be one of"):
        Mix(ds, WEIGHTS, seed=0, stop="longest")
    with pytest.raises(ValueError, match=r"datasets\[0\] must be a streamds.StreamingJsonl"):
        Mix([[1, 2], ds[1]], WEIGHTS, seed=0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="different rank/world_size"):
        Mix([ds[0], StreamingJsonl(sources["b"][0], rank=0, world_size=2)], WEIGHTS, seed=0)
    with pytest.raises(ValueError, match="with_resume needs the dict"):
        Mix(ds, WEIGHTS, seed=0).with_resume({"format": "streamds/5", "stage": "merged"})


def test_states_of_another_mix_or_world_are_refused(sources) -> None:
    m = mix(sources)
    next(iter(m))
    state = m.state_dict()
    with pytest.raises(StateMismatchError, match="configured as"):
        Mix(datasets(sources), [0.5, 0.5], seed=9).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="not a streamds mix dataset state"):
        mix(sources).load_state_dict(datasets(sources)[0].state_dict())
    other = mix(sources, rank=1, world_size=2)
    other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="merge_states"):
        iter(other)
