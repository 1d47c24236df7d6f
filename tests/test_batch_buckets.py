"""`StreamingJsonl.batch(LengthBuckets(...) | TokenBudget(...))`: batches cut by length in the
reader (so in the workers), each record once, exact resume after any batch with
StatefulDataLoader and with a plain DataLoader's batch count, elastic merge mid-pool."""

from __future__ import annotations

import pickle
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from resume_contract import checkpoint, ids, run_test_save_load_state
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import (
    LengthBuckets,
    StateMismatchError,
    StreamingJsonl,
    TokenBudget,
    merge_states,
)
from streamds.datasets.batching import padding_of
from streamds.seeds import shuffle_seed_parts
from streamds.stages.buckets import pool_rng

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

RULES = {
    "buckets": lambda: LengthBuckets(5, buffer_size=12, length="text"),
    "tokens": lambda: TokenBudget(900, buffer_size=13, length="text"),
}


def text_length(record: dict[str, Any]) -> int:
    return len(record["text"])


def dataset(source: Path, rule: Any, *, shuffle: bool = True,
            resume_from: dict[str, Any] | None = None, **options: Any) -> StreamingJsonl:
    ds = StreamingJsonl(str(source), shuffle=shuffle, seed=3, buffer_size=16, **options)
    if resume_from is not None:
        ds = ds.with_resume(resume_from)
    return ds.batch(rule, collate=ids)


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("kind", sorted(RULES))
def test_stateful_loader_resumes_exactly_after_any_batch(
    mixed: tuple[Path, list[int]], kind: str, num_workers: int, shuffle: bool
) -> None:
    source, every = mixed

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(dataset(source, RULES[kind](), shuffle=shuffle),
                                  batch_size=None, num_workers=num_workers)

    reference = run_test_save_load_state(make, [0, 1, 2, 3, 9, 30])
    assert sorted(i for batch in reference for i in batch) == sorted(every)
    if kind == "buckets":
        assert all(len(batch) <= 5 for batch in reference)


def pools_cut_by_hand(source: Path, rule: Any) -> list[list[int]]:
    """What the stage must yield for one reader, shuffle=False: the rule applied to each pool
    of the record stream, with the reader's seed for that pool."""
    records = list(StreamingJsonl(str(source), seed=3, buffer_size=16))
    parts = shuffle_seed_parts(3, 0, 0, 0)
    out = []
    for number, start in enumerate(range(0, len(records), rule.pool_size)):
        pool = records[start : start + rule.pool_size]
        for batch in rule.cut([text_length(r) for r in pool], pool_rng(parts, number)):
            out.append([pool[i]["id"] for i in batch])
    return out


@pytest.mark.parametrize("kind", sorted(RULES))
def test_the_stage_cuts_each_pool_by_the_rule(mixed: tuple[Path, list[int]], kind: str) -> None:
    source, _ = mixed
    rule = RULES[kind]()
    assert list(dataset(source, rule, shuffle=False)) == pools_cut_by_hand(source, rule)


def test_buckets_pad_less_than_arrival_order(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    plain = StreamingJsonl(str(source), shuffle=True, seed=3, buffer_size=16).batch(5)
    bucketed = StreamingJsonl(str(source), shuffle=True, seed=3, buffer_size=16).batch(
        LengthBuckets(5, buffer_size=40, length="text"))
    assert padding_of(bucketed, "text").padded < 0.9 * padding_of(plain, "text").padded


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_plain_loader_resumes_from_its_batch_count(
    mixed: tuple[Path, list[int]], num_workers: int, drop_last: bool
) -> None:
    source, every = mixed
    rule = LengthBuckets(5, buffer_size=12, length="text", drop_last=drop_last)
    ds = dataset(source, rule)

    def loader(of: StreamingJsonl) -> DataLoader:
        return DataLoader(of, batch_size=None, num_workers=num_workers)

    whole = list(loader(ds))
    flat = [i for batch in whole for i in batch]
    assert len(flat) == len(set(flat))
    if not drop_last:
        assert sorted(flat) == sorted(every)
    for consumed in (0, 1, 4, 11, len(whole) - 1, len(whole)):
        resumed = ds.resume_after_batches(consumed, batch_size=5, num_workers=num_workers,
                                          drop_last=drop_last)
        assert whole[:consumed] + list(loader(resumed)) == whole, consumed


def test_plain_loader_resume_refuses_a_token_budget(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    with pytest.raises(ValueError, match="cannot count batches cut by a token budget"):
        dataset(source, RULES["tokens"]()).resume_after_batches(2, batch_size=5, num_workers=0)
    with pytest.raises(ValueError, match="makes batches of 5"):
        dataset(source, RULES["buckets"]()).resume_after_batches(2, batch_size=4, num_workers=0)


@pytest.mark.parametrize("kind", sorted(RULES))
def test_states_taken_mid_pool_merge_for_an_elastic_resume(
    mixed: tuple[Path, list[int]], kind: str
) -> None:
    source, every = mixed
    states, seen = [], []
    for rank, taken in ((0, 4), (1, 2)):  # mid-pool: some of the pool's batches handed out
        ds = dataset(source, RULES[kind](), rank=rank, world_size=2)
        iterator = iter(ds)
        seen += [i for batch in islice(iterator, taken) for i in batch]
        while not ds.state_dict()["pipeline"]["emitted"]:  # stop inside a pool
            seen += next(iterator)
        states.append(checkpoint(ds.state_dict()))
    merged = merge_states(states)
    for world_size in (1, 3):
        rest = [i for rank in range(world_size)
                for batch in dataset(source, RULES[kind](), resume_from=merged, rank=rank,
                                     world_size=world_size)
                for i in batch]
        assert sorted(seen + rest) == sorted(every), world_size
    # merged states resume an unbatched dataset only when no pool was under way
    with pytest.raises(StateMismatchError, match="batched by the same rule"):
        list(StreamingJsonl(str(source), shuffle=True, seed=3, buffer_size=16).with_resume(merged))


def test_a_mid_pool_merge_without_shuffle_is_refused(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    ds = dataset(source, RULES["buckets"](), shuffle=False)
    next(iter(ds))
    with pytest.raises(ValueError, match="cannot carry over the rest of a pool"):
        merge_states([ds.state_dict()])


def test_states_of_other_batching_are_refused(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    ds = dataset(source, RULES["buckets"]())
    next(iter(ds))
    state = ds.state_dict()
    with pytest.raises(StateMismatchError, match=r"with \.batch\(rule\) but is loaded"):
        StreamingJsonl(str(source), shuffle=True, seed=3, buffer_size=16).batch(
            5).load_state_dict(state)
    other = dataset(source, LengthBuckets(6, buffer_size=12, length="text"))
    other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="cuts them by"):
        next(iter(other))


def test_a_state_after_the_last_batch_is_finished(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    ds = dataset(source, RULES["tokens"]())
    assert list(ds)
    state = ds.state_dict()
    assert state["finished"]
    fresh = dataset(source, RULES["tokens"]())
    fresh.load_state_dict(state)
    assert list(fresh) == []


def test_batch_arguments_name_the_fix(mixed: tuple[Path, list[int]]) -> None:
    source, _ = mixed
    ds = StreamingJsonl(str(source))
    with pytest.raises(ValueError, match="pass drop_last to LengthBuckets"):
        ds.batch(LengthBuckets(4), drop_last=True)
    with pytest.raises(ValueError, match="LengthBuckets / TokenBudget rule"):
        ds.batch("4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens must be"):
        TokenBudget(0)


@pytest.mark.parametrize("kind", sorted(RULES))
def test_a_loader_state_with_workers_merges_for_fewer_workers(
    mixed: tuple[Path, list[int]], kind: str
) -> None:
    source, every = mixed
    loader = StatefulDataLoader(dataset(source, RULES[kind]()), batch_size=None, num_workers=2)
    iterator = iter(loader)
    seen = [i for batch in islice(iterator, 5) for i in batch]
    while not any(emitted(loader.state_dict())):  # stop where a worker is inside a pool
        seen += next(iterator)
    state = checkpoint(loader.state_dict())
    del iterator, loader
    rest = [i for batch in dataset(source, RULES[kind](), resume_from=merge_states([state]))
            for i in batch]
    assert sorted(seen + rest) == sorted(every)


def emitted(found: Any) -> list[int]:
    """The `emitted` counts of every pooled-batch stage state nested in `found`."""
    if isinstance(found, dict):
        own = [found["emitted"]] if "emitted" in found else []
        return own + [n for value in found.values() for n in emitted(value)]
    if isinstance(found, (list, tuple)):
        return [n for value in found for n in emitted(value)]
    return []


class CharCount:
    def __call__(self, record: dict[str, Any]) -> int:
        return len(record["text"])


def test_a_rule_names_its_length_function_the_same_in_every_process() -> None:
    def config(length: Any) -> list[Any]:
        return pickle.loads(pickle.dumps(LengthBuckets(4, length=length))).config()

    assert config(CharCount()) == LengthBuckets(4, length=CharCount()).config()
    assert config(text_length) == LengthBuckets(4, length=text_length).config()
    assert "CharCount" in str(config(CharCount())) and "0x" not in str(config(CharCount()))
