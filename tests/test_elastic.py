"""Elastic resume (DESIGN.md guarantee 4): finish an epoch under another world, exactly once.

A run of 2 ranks x 2 DataLoader workers (ranks simulated with rank= / world_size= in this
process) is stopped part-way; the StatefulDataLoader states of both ranks are merged with
`streamds.merge_states` and the epoch is finished under other worlds. What was consumed plus
what the new world yields must be the corpus, every record once.
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
from resume_contract import (
    ids,
    records,
    run_test_save_load_state,
    stop_ranks_part_way,
    write_mixed,
)
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import StateMismatchError, StreamingJsonl, merge_states
from streamds.resume.merge import share_of
from streamds.world import World

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

BATCH = 8


def keep(record: dict[str, Any]) -> bool:
    return record["id"] % 7 != 3


@pytest.fixture(scope="module")
def source(mixed: tuple[Path, list[int]]) -> tuple[str, list[int]]:
    directory, every = mixed
    return str(directory), [i for i in every if i % 7 != 3]


def dataset(path: str, shuffle: bool, *, seed: int = 11,
            resume_from: dict[str, Any] | None = None, **world: Any) -> StreamingJsonl:
    data = StreamingJsonl(path, shuffle=shuffle, seed=seed, buffer_size=16, **world).filter(keep)
    return data if resume_from is None else data.with_resume(resume_from)


def stop_part_way(
    path: str,
    shuffle: bool,
    world_size: int,
    num_workers: int,
    batches: Sequence[int],
    **options: Any,
) -> tuple[list[int], list[Any]]:
    """Each rank consumes `batches[rank]` batches; returns (ids consumed, checkpointed states)."""
    return stop_ranks_part_way(
        lambda rank: StatefulDataLoader(
            dataset(path, shuffle, rank=rank, world_size=world_size, **options),
            batch_size=BATCH, num_workers=num_workers, collate_fn=ids),
        [batches[rank] for rank in range(world_size)])


def finish(path: str, shuffle: bool, merged: dict[str, Any], world_size: int, workers: int):
    """Everything every rank of the new world yields for the rest of the epoch."""
    out: list[int] = []
    for rank in range(world_size):
        data = dataset(path, shuffle, rank=rank, world_size=world_size, resume_from=merged)
        loader = DataLoader(data, batch_size=BATCH, num_workers=workers, collate_fn=ids)
        out.extend(i for batch in loader for i in batch)
    return out


def assert_exactly_once(parts: Sequence[list[int]], expected: list[int]) -> None:
    seen = Counter(i for part in parts for i in part)
    repeated = sorted(i for i, n in seen.items() if n > 1)
    missing = sorted(set(expected) - set(seen))
    unknown = sorted(set(seen) - set(expected))
    assert not repeated and not missing and not unknown, (
        f"repeated {repeated[:10]} ({len(repeated)}), missing {missing[:10]} ({len(missing)}), "
        f"not in the corpus {unknown[:10]}"
    )


@pytest.fixture(scope="module", params=[False, True], ids=["ordered", "shuffled"])
def stopped(request: pytest.FixtureRequest, source: tuple[str, list[int]]):
    """The 2 x 2 run stopped part-way: (shuffle, ids consumed, merged state)."""
    path, expected = source
    consumed, states = stop_part_way(path, request.param, 2, 2, batches=[3, 7])
    assert 0 < len(consumed) < len(expected)
    return request.param, consumed, merge_states(states)


@pytest.mark.parametrize(("world_size", "workers"), [(3, 3), (1, 0), (4, 1)])
def test_finish_under_another_world(
    source: tuple[str, list[int]],
    stopped: tuple[bool, list[int], dict],
    world_size: int,
    workers: int,
) -> None:
    path, expected = source
    shuffle, consumed, merged = stopped
    rest = finish(path, shuffle, merged, world_size, workers)
    assert_exactly_once([consumed, rest], expected)


def test_merged_state_survives_a_checkpoint(
    source: tuple[str, list[int]], stopped: tuple[bool, list[int], dict]
) -> None:
    path, expected = source
    shuffle, consumed, merged = stopped
    rest = finish(path, shuffle, pickle.loads(pickle.dumps(merged)), 2, 1)
    assert_exactly_once([consumed, rest], expected)


def test_merge_a_merge_resumed_run(
    source: tuple[str, list[int]], stopped: tuple[bool, list[int], dict]
) -> None:
    """2 x 2 -> merged -> 3 x 1, stopped again (one rank before its first batch) -> 2 x 2."""
    path, expected = source
    shuffle, consumed, merged = stopped
    second: list[int] = []
    states = []
    for rank, batches in enumerate([2, 0, 4]):
        data = dataset(path, shuffle, rank=rank, world_size=3, resume_from=merged)
        loader = StatefulDataLoader(data, batch_size=BATCH, num_workers=1, collate_fn=ids)
        iterator = iter(loader)
        for _ in range(batches):
            second.extend(next(iterator))
        states.append(pickle.loads(pickle.dumps(loader.state_dict())))
        del iterator, loader
    remerged = merge_states(states)
    rest = finish(path, shuffle, remerged, 2, 2)
    assert second and rest
    assert_exactly_once([consumed, second, rest], expected)


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_after_an_elastic_resume(
    source: tuple[str, list[int]], stopped: tuple[bool, list[int], dict], workers: int
) -> None:
    """Preempted again in the new world: the same-world state continues exactly."""
    path, _ = source
    shuffle, _, merged = stopped

    def make() -> StatefulDataLoader:
        data = dataset(path, shuffle, rank=1, world_size=3, resume_from=merged)
        return StatefulDataLoader(data, batch_size=BATCH, num_workers=workers, collate_fn=ids)

    reference = list(make())
    cuts = range(len(reference) + 1) if workers == 0 else [1, len(reference) // 2]
    run_test_save_load_state(make, cuts, expected=reference)


def test_merge_dataset_states_of_a_resumed_run_with_an_idle_rank(
    source: tuple[str, list[int]],
) -> None:
    path, expected = source
    consumed: list[int] = []
    states = []
    for rank in range(2):  # the first run: dataset states, no loader
        data = dataset(path, False, rank=rank, world_size=2)
        iterator = iter(data)
        consumed.extend(next(iterator)["id"] for _ in range(10))
        states.append(data.state_dict())
    merged = merge_states(states)
    states = []
    for rank in range(2):  # the resumed run: rank 1 checkpoints before reading anything
        data = dataset(path, False, rank=rank, world_size=2, resume_from=merged)
        if rank == 0:
            iterator = iter(data)
            consumed.extend(next(iterator)["id"] for _ in range(10))
        states.append(data.state_dict())
    rest = [record["id"] for record in dataset(path, False, resume_from=merge_states(states))]
    assert_exactly_once([consumed, rest], expected)


def test_states_before_the_first_batch_merge_to_the_whole_epoch(
    source: tuple[str, list[int]],
) -> None:
    path, expected = source
    consumed, states = stop_part_way(path, True, 2, 2, batches=[0, 0])
    assert consumed == []
    assert_exactly_once([finish(path, True, merge_states(states), 3, 0)], expected)


def test_states_after_the_last_batch_merge_to_nothing_left(
    source: tuple[str, list[int]],
) -> None:
    path, expected = source
    consumed: list[int] = []
    states = []
    for rank in range(2):
        data = dataset(path, True, rank=rank, world_size=2)
        loader = StatefulDataLoader(data, batch_size=BATCH, num_workers=2, collate_fn=ids)
        consumed.extend(i for batch in loader for i in batch)
        states.append(loader.state_dict())
    assert_exactly_once([consumed], expected)
    assert finish(path, True, merge_states(states), 3, 1) == []


def test_merge_refuses_a_missing_rank(source: tuple[str, list[int]]) -> None:
    path, _ = source
    _, states = stop_part_way(path, False, 3, 2, batches=[1, 1, 1])
    with pytest.raises(ValueError, match=r"missing \(rank, worker\): \[\(1, 0\), \(1, 1\)\]"):
        merge_states([states[0], states[2]])
    with pytest.raises(ValueError, match=r"repeated"):
        merge_states([states[0], states[1], states[2], states[1]])
    with pytest.raises(ValueError, match="no streamds reader state"):
        merge_states([{"not": "a state"}])


def test_merge_refuses_a_loader_state_taken_between_snapshots(
    source: tuple[str, list[int]],
) -> None:
    """With snapshot_every_n_steps=3 the worker states in a loader's state are up to 2
    batches old (the loader itself replays them on load); merging them would read those
    batches again, so merge_states refuses, and accepts a state taken at a snapshot."""
    path, expected = source
    for batches in (2, 3):
        loader = StatefulDataLoader(dataset(path, True), batch_size=BATCH, num_workers=2,
                                    collate_fn=ids, snapshot_every_n_steps=3)
        iterator = iter(loader)
        consumed = [i for _ in range(batches) for i in next(iterator)]
        state = loader.state_dict()
        del iterator, loader
        if batches == 2:
            with pytest.raises(ValueError, match="2 batches after its last snapshot"):
                merge_states([state])
        else:
            assert_exactly_once([consumed, finish(path, True, merge_states([state]), 1, 0)],
                                expected)


def test_merge_refuses_states_of_different_runs(source: tuple[str, list[int]]) -> None:
    path, _ = source
    _, first = stop_part_way(path, True, 2, 0, batches=[1, 1])
    _, other_seed = stop_part_way(path, True, 2, 0, batches=[1, 1], seed=12)
    with pytest.raises(StateMismatchError, match="different datasets or epochs"):
        merge_states([first[0], other_seed[1]])


def test_merge_finds_the_states_inside_a_batchers_loader_state(tmp_path) -> None:
    """A batcher's state (a Mix's `.batch`) holds the mix's state, and that its readers':
    merge_states looks inside it rather than refusing it as an unknown state."""
    from streamds import Mix, as_list

    directory = tmp_path / "mixed"
    write_mixed(directory)
    batcher = Mix([StreamingJsonl(str(directory), shuffle=True, buffer_size=16)], [1.0],
                  seed=0).batch(8)
    loader = StatefulDataLoader(batcher, batch_size=None, num_workers=2, collate_fn=as_list)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    merged = merge_states([loader.state_dict()])
    assert merged["stage"] == "merged-mix" and merged["epoch"] == 0


# -- even ranks: exact at every cut, the shuffle buffer's drain included (issue 26) --------------
#
# What merge_states promises under even_ranks, checked below: the rest (what the new world
# yields after with_resume(merged)) never holds a record read before the checkpoint, and never
# one twice unless the new world's own split pads. With "drop", before + rest hold every record
# the uninterrupted epoch would have read (records an old reader would have dropped at its
# quota may be read too: they are left to read, never read twice). With "pad", before + rest
# hold every record of the corpus; the only records read twice are the old world's pad repeats
# handed out before the checkpoint (they were read twice in the uninterrupted epoch as well).

EVEN_RECORDS = 2300  # 2 ranks share ~1,150 each: past the shuffle's 1,024-record round
EVEN_BUFFER = 128


@pytest.fixture(scope="module")
def even_source(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("even_elastic") / "corpus.jsonl"
    corpus.write_plain(path, corpus.jsonl(records(EVEN_RECORDS, 0)))
    return str(path)


def even_dataset(path: str, mode: str, *, buffer: int = EVEN_BUFFER, seed: int = 5,
                 resume_from: dict[str, Any] | None = None, **world: Any) -> StreamingJsonl:
    data = StreamingJsonl(path, shuffle=True, seed=seed, buffer_size=buffer, even_ranks=mode,
                          **world)
    return data if resume_from is None else data.with_resume(resume_from)


@pytest.fixture(scope="module")
def even_epochs(even_source: str) -> dict[tuple[str, int], list[list[list[int]]]]:
    """The uninterrupted epoch's batches of each rank of 2, per (mode, DataLoader workers)."""
    out = {}
    for mode in ("drop", "pad"):
        for workers in (0, 2):
            out[mode, workers] = [
                list(DataLoader(even_dataset(even_source, mode, rank=rank, world_size=2),
                                batch_size=BATCH, num_workers=workers, collate_fn=ids))
                for rank in range(2)]
    return out


def flat(batches: Sequence[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def read_part_way(path: str, mode: str, cuts: Sequence[int], *, buffer: int = EVEN_BUFFER,
                  seed: int = 5) -> tuple[list[int], list[Any]]:
    """Each rank of 2 (no DataLoader) yields `cuts[rank]` records; (ids read, states)."""
    read, states = [], []
    for rank, cut in enumerate(cuts):
        data = even_dataset(path, mode, buffer=buffer, seed=seed, rank=rank, world_size=2)
        iterator = iter(data)
        read += [next(iterator)["id"] for _ in range(cut)]
        states.append(pickle.loads(pickle.dumps(data.state_dict())))
    return read, states


def finish_even(path: str, mode: str, merged: dict[str, Any], world_size: int, workers: int,
                *, buffer: int = EVEN_BUFFER, seed: int = 5) -> list[list[int]]:
    out = []
    for rank in range(world_size):
        data = even_dataset(path, mode, buffer=buffer, seed=seed, rank=rank,
                            world_size=world_size, resume_from=merged)
        loader = DataLoader(data, batch_size=BATCH, num_workers=workers, collate_fn=ids)
        out.append([i for batch in loader for i in batch])
    return out


def assert_even_resume(mode: str, before: list[int], rest: list[int],
                       uninterrupted: list[int], every: int) -> None:
    """The promise above, for a new world whose split neither drops nor pads (one rank)."""
    twice = sorted(i for i, n in Counter(rest).items() if n > 1)
    again = sorted(set(before) & set(rest))
    assert not twice and not again, f"rest repeats {twice[:10]}, re-reads {again[:10]} " \
        f"({len(twice)}, {len(again)})"
    together = set(before) | set(rest)
    if mode == "drop":
        assert len(before) == len(set(before))
        lost = sorted(set(uninterrupted) - together)
        assert not lost, f"never read: {lost[:10]} ({len(lost)})"
        assert together <= set(range(every))
    else:
        lost = sorted(set(range(every)) - together)
        assert not lost, f"never read: {lost[:10]} ({len(lost)})"
        # the only repeats: the old world's pad records, which its epoch repeats too
        old_repeats = len(uninterrupted) - len(set(uninterrupted))
        assert len(before) - len(set(before)) <= old_repeats


@pytest.mark.parametrize("mode", ["pad", "drop"])
def test_the_issues_checkpoint_in_the_drain_resumes_exactly(
    tmp_path: Path, mode: str
) -> None:
    """Issue 26: 2 ranks, buffer_size=256, 2,010 records, checkpoint after 900 per rank (in
    the buffer's drain), finished by one process: was 62 records twice and 62 never."""
    path = corpus.write_plain(tmp_path / "c.jsonl", corpus.jsonl(
        {"id": i, "text": "x" * (20 + i % 50)} for i in range(2010)))
    before, states = read_part_way(str(path), mode, [900, 900], buffer=256, seed=0)
    [rest] = finish_even(str(path), mode, merge_states(states), 1, 0, buffer=256, seed=0)
    whole = [r["id"] for rank in range(2) for r in even_dataset(
        str(path), mode, buffer=256, seed=0, rank=rank, world_size=2)]
    assert_even_resume(mode, before, rest, whole, 2010)


@st.composite
def even_cuts(draw: st.DrawFn) -> tuple[str, list[int]]:
    """A mode and each rank's cut: anywhere, or in the last buffer's worth (the drain)."""
    mode = draw(st.sampled_from(["drop", "pad"]))
    share = EVEN_RECORDS // 2 - 40  # a little below either rank's share, whatever the mode
    anywhere = st.integers(0, share)
    drain = st.integers(share - EVEN_BUFFER - 20, share)
    return mode, [draw(st.one_of(anywhere, drain)) for _ in range(2)]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=even_cuts())
def test_even_ranks_resume_elastically_at_any_cut(
    even_source: str, even_epochs: dict[tuple[str, int], list[list[list[int]]]],
    cut: tuple[str, list[int]],
) -> None:
    mode, cuts = cut
    uninterrupted = [flat(rank) for rank in even_epochs[mode, 0]]
    cuts = [min(c, len(rank)) for c, rank in zip(cuts, uninterrupted, strict=True)]
    before, states = read_part_way(even_source, mode, cuts)
    assert before == [i for c, rank in zip(cuts, uninterrupted, strict=True) for i in rank[:c]]
    [rest] = finish_even(even_source, mode, merge_states(states), 1, 0)
    assert_even_resume(mode, before, rest, [i for rank in uninterrupted for i in rank],
                       EVEN_RECORDS)


@pytest.mark.parametrize("mode", ["drop", "pad"])
@pytest.mark.parametrize("where", ["middle", "drain", "last_batch", "end"])
def test_even_ranks_with_two_workers_resume_elastically(
    even_source: str, even_epochs: dict[tuple[str, int], list[list[list[int]]]], mode: str,
    where: str,
) -> None:
    """2 ranks x 2 workers stopped in the middle, in the workers' drains, before the last
    batch and after it; finished by 1 rank x 2 workers."""
    uninterrupted = even_epochs[mode, 2]
    batches = len(uninterrupted[0])
    assert batches == len(uninterrupted[1])
    at = {"middle": batches // 2, "drain": batches - EVEN_BUFFER // BATCH,
          "last_batch": batches - 1, "end": batches}[where]
    before, states = stop_ranks_part_way(
        lambda rank: StatefulDataLoader(
            even_dataset(even_source, mode, rank=rank, world_size=2),
            batch_size=BATCH, num_workers=2, collate_fn=ids), [at, at])
    assert before == [i for rank in uninterrupted for i in flat(rank[:at])]
    [rest] = finish_even(even_source, mode, merge_states(states), 1, 2)
    assert_even_resume(mode, before, rest, [i for rank in uninterrupted for i in flat(rank)],
                       EVEN_RECORDS)


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_even_ranks_resume_under_three_ranks_evenly(even_source: str, mode: str) -> None:
    """A new world that evens again: every rank the same count; drop reads nothing twice,
    pad misses nothing."""
    before, states = read_part_way(even_source, mode, [700, 1000])
    rest = finish_even(even_source, mode, merge_states(states), 3, 0)
    assert len({len(rank) for rank in rest}) == 1
    flat = [i for rank in rest for i in rank]
    if mode == "drop":
        assert not set(before) & set(flat) and len(flat) == len(set(flat))
    else:
        assert set(before) | set(flat) == set(range(EVEN_RECORDS))


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_even_ranks_merge_a_merge_resumed_run(even_source: str, mode: str) -> None:
    """2 ranks -> merged -> 3 ranks (their buffers start with carried-over records) stopped
    again -> merged -> 1 rank: the second rest re-reads nothing read before."""
    before, states = read_part_way(even_source, mode, [600, 1100])
    merged = merge_states(states)
    again = []
    for rank, cut in enumerate([100, 0, 150]):
        data = even_dataset(even_source, mode, rank=rank, world_size=3, resume_from=merged)
        iterator = iter(data)
        before += [next(iterator)["id"] for _ in range(cut)]
        again.append(pickle.loads(pickle.dumps(data.state_dict())))
    [rest] = finish_even(even_source, mode, merge_states(again), 1, 0)
    assert not set(before) & set(rest) and len(rest) == len(set(rest))
    if mode == "pad":
        assert set(before) | set(rest) == set(range(EVEN_RECORDS))
    else:
        assert len(before) == len(set(before))


def test_even_ranks_deal_the_remaining_work_by_record_count() -> None:
    """Under even_ranks the remaining items of a merged state go, largest first, to the
    reader holding the fewest records: in turn, the shares below would be 115 and 95 records
    (a pad of 20 repeats); by count they are 105 and 105 (none)."""
    merged = {"remaining": [[0, None], [1, 40], [2, None], [3, None], [4, 7]],
              "pending": [], "counts": {}}
    sizes = [100, 5, 10, 90, 5]
    shares = [share_of(merged, World(rank, 2, 0, 1), sizes)[0] for rank in range(2)]
    loads = [sum(sizes[block] for block, _ in share) for share in shares]
    assert loads == [105, 105]
    assert sorted(item for share in shares for item in share) == [
        (0, None), (1, 40), (2, None), (3, None), (4, 7)]
    assert shares[0] == [(0, None), (1, 40)]  # each reader keeps the merged state's order
    # buffered records count too: they are dealt in turn first
    merged["pending"] = [[9, i] for i in range(10)]
    shares = [share_of(merged, World(rank, 2, 0, 1), sizes) for rank in range(2)]
    loads = [sum(sizes[block] for block, _ in work) + len(prefill)
             for work, prefill, _ in shares]
    assert max(loads) - min(loads) <= max(sizes)
    assert sum(loads) == sum(sizes) + 10
