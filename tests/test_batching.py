"""Batches cut by `LengthBuckets` and `TokenBudget`: exactly once, budgets, padding, order,
resume; the rules pool by pool, and `.batch(rule)` of a reader (cut in its workers) and of a
`Mix` (the pool batcher, `streamds.datasets.batching.Batched`)."""

from __future__ import annotations

import random
from collections import Counter
from operator import itemgetter

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import (
    LengthBuckets,
    Mix,
    PaddingStats,
    StateMismatchError,
    Storage,
    StreamingJsonl,
    TokenBudget,
    as_list,
    padding_of,
)

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]

LENGTH = itemgetter(1)  # records are (id, length) pairs in the property tests
lengths_st = st.lists(st.integers(1, 300), min_size=0, max_size=300)


def records_of(lengths: list[int]) -> list[tuple[int, int]]:
    return list(enumerate(lengths))


def ids(batches) -> list[list[int]]:
    return [[r[0] if isinstance(r, tuple) else r["id"] for r in batch] for batch in batches]


def rule_of(kind: str, **kw):
    if kind == "plain":  # fixed size in arrival order: one batch per pool, nothing sorted
        return None
    if kind == "bucket":
        return LengthBuckets(kw.get("batch_size", 4), buffer_size=kw.get("buffer_size", 16),
                             length=LENGTH, drop_last=kw.get("drop_last", False))
    return TokenBudget(kw.get("max_tokens", 400), buffer_size=kw.get("buffer_size", 16),
                       max_batch_size=kw.get("max_batch_size"), length=LENGTH)


def cut(kind: str, records: list, seed: int = 0, **kw) -> list[list]:
    """The batches `kind`'s rule cuts from `records`, pool by pool (as the batchers do)."""
    rule = rule_of(kind, **kw)
    if rule is None:
        size = kw.get("batch_size", 4)
        batches = [records[i:i + size] for i in range(0, len(records), size)]
        return [b for b in batches if len(b) == size] if kw.get("drop_last") else batches
    rng = random.Random(seed)
    batches = []
    for start in range(0, len(records), rule.pool_size):
        pool = records[start:start + rule.pool_size]
        lengths = [rule.length(record) for record in pool]
        batches += [[pool[i] for i in batch] for batch in rule.cut(lengths, rng)]
    return batches


# --- exactly once -------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(lengths_st, st.integers(1, 9), st.integers(1, 40), st.integers(0, 2**32),
       st.sampled_from(["plain", "bucket", "tokens"]))
def test_every_record_exactly_once(lengths, batch_size, buffer_size, seed, kind):
    source = records_of(lengths)
    batches = cut(kind, source, seed, batch_size=batch_size, buffer_size=buffer_size,
                  max_tokens=batch_size * 100)
    seen = Counter(i for batch in ids(batches) for i in batch)
    assert sorted(seen) == list(range(len(lengths)))
    assert set(seen.values()) <= {1}
    assert all(batches)  # no empty batch


@settings(max_examples=50, deadline=None)
@given(lengths_st, st.integers(1, 9), st.integers(1, 40))
def test_fixed_size_batches(lengths, batch_size, buffer_size):
    batches = cut("bucket", records_of(lengths), batch_size=batch_size,
                  buffer_size=buffer_size)
    short = [b for b in batches if len(b) != batch_size]
    assert all(len(b) <= batch_size for b in batches)
    pool = -(-buffer_size // batch_size) * batch_size
    pools = -(-len(lengths) // pool) if lengths else 0
    assert len(short) <= pools  # at most one short batch per pool (only the last pool's, here)
    assert len(short) <= 1


def test_drop_last_drops_only_the_short_batch():
    source = records_of([5] * 10)
    plain = cut("plain", source, batch_size=4, drop_last=True)
    assert [len(b) for b in plain] == [4, 4]
    bucket = cut("bucket", source, batch_size=4, buffer_size=8, drop_last=True)
    assert sorted(len(b) for b in bucket) == [4, 4]


# --- token budget -------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(lengths_st, st.integers(1, 600), st.integers(1, 50), st.one_of(st.none(),
       st.integers(1, 6)))
def test_no_batch_exceeds_the_budget(lengths, max_tokens, buffer_size, cap):
    batches = cut("tokens", records_of(lengths), max_tokens=max_tokens,
                  buffer_size=buffer_size, max_batch_size=cap)
    for batch in batches:
        longest = max(LENGTH(r) for r in batch)
        if longest > max_tokens:
            assert len(batch) == 1  # an oversized record comes alone, never dropped
        else:
            assert longest * len(batch) <= max_tokens
        if cap is not None:
            assert len(batch) <= cap
    assert sorted(i for b in ids(batches) for i in b) == list(range(len(lengths)))


def test_token_budget_makes_big_batches_of_short_records():
    source = records_of([10] * 40 + [100] * 8)
    sizes = {LENGTH(b[0]): len(b) for b in cut("tokens", source, max_tokens=200,
                                               buffer_size=48)}
    assert sizes == {10: 20, 100: 2}


# --- padding ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=80), st.integers(1, 9), st.integers(1, 6),
       st.integers(0, 1000))
def test_bucketing_never_pads_more_than_plain_batching(lengths, batch_size, pool_batches, seed):
    source = records_of(lengths)
    plain = padding_of(cut("plain", source, batch_size=batch_size), LENGTH)
    bucket = padding_of(cut("bucket", source, seed, batch_size=batch_size,
                            buffer_size=pool_batches * batch_size), LENGTH)
    assert bucket.real == plain.real == sum(lengths)
    assert bucket.padded <= plain.padded


def test_bucketing_cuts_padding_on_random_lengths():
    rng = random.Random(7)
    source = records_of([rng.randint(1, 512) for _ in range(4000)])
    plain = padding_of(cut("plain", source, batch_size=32), LENGTH)
    bucket = padding_of(cut("bucket", source, batch_size=32, buffer_size=1024), LENGTH)
    budget = padding_of(cut("tokens", source, max_tokens=32 * 256, buffer_size=1024), LENGTH)
    assert plain.pad_fraction > 0.4
    assert bucket.pad_fraction < 0.05
    assert budget.pad_fraction < 0.05


def test_padding_stats_arithmetic():
    stats = PaddingStats()
    stats.add([3, 1])
    stats.add([])
    assert (stats.batches, stats.records, stats.real, stats.padded) == (1, 2, 4, 6)
    assert stats.pad_tokens == 2 and stats.pad_fraction == pytest.approx(1 / 3)
    total = stats + stats
    assert total.as_dict()["padded"] == 12


def test_length_may_be_a_field_name():
    source = [{"id": i, "input_ids": [0] * n} for i, n in enumerate([3, 1, 2, 5])]
    rule = LengthBuckets(2, buffer_size=4)  # length="input_ids", the default
    batches = [[source[i] for i in b] for b in rule.cut([len(r["input_ids"]) for r in source],
                                                        random.Random(0))]
    stats = padding_of(batches, "input_ids")
    assert (stats.real, stats.padded) == (11, 2 * 2 + 2 * 5)


# --- order --------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(lengths_st, st.integers(0, 2**32), st.sampled_from(["bucket", "tokens"]))
def test_same_seed_same_batches(lengths, seed, kind):
    source = records_of(lengths)
    assert ids(cut(kind, source, seed)) == ids(cut(kind, source, seed))


# --- arguments ----------------------------------------------------------------------------


def test_bad_arguments_fail_early():
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        LengthBuckets(0)
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBudget(0)
    with pytest.raises(ValueError, match="length must be"):
        LengthBuckets(2, length=3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("batching") / "corpus.jsonl"
    rng = random.Random(0)
    with path.open("wb") as f:
        for i in range(600):
            f.write(orjson.dumps({"id": i, "input_ids": [1] * rng.randint(1, 200)}) + b"\n")
    return str(path)


def stream_batcher(corpus: str, kind: str, *, through: str = "reader", seed: int = 4):
    """`.batch(rule)` of a reader (cut in its workers), or of a one-source Mix (the pool
    batcher around it)."""
    ds = StreamingJsonl(corpus, shuffle=True, seed=seed, buffer_size=32,
                        storage=Storage(block_size=64 << 10))
    rule = (LengthBuckets(8, buffer_size=48) if kind == "bucket"
            else TokenBudget(600, buffer_size=50))
    if through == "mix":
        return Mix([ds], [1.0], seed=seed).batch(rule)
    return ds.batch(rule)


@pytest.mark.parametrize("through", ["reader", "mix"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["bucket", "tokens"])
def test_stateful_dataloader_resumes_exactly(corpus, kind, num_workers, through):
    def loader():
        return StatefulDataLoader(stream_batcher(corpus, kind, through=through), batch_size=None,
                                  num_workers=num_workers, collate_fn=as_list)

    full = ids(loader())
    assert sorted(i for batch in full for i in batch) == list(range(600))
    for at in (1, 7, len(full) // 2, len(full) - 1):
        first = loader()
        iterator = iter(first)
        head = [next(iterator) for _ in range(at)]
        state = first.state_dict()
        del iterator
        second = loader()
        second.load_state_dict(state)
        assert ids(head) + ids(second) == full, at


@pytest.mark.parametrize("through", ["reader", "mix"])
def test_plain_dataloader_with_workers_reads_everything_once(corpus, through):
    batcher = stream_batcher(corpus, "bucket", through=through)
    loader = DataLoader(batcher, batch_size=None, num_workers=2, collate_fn=as_list)
    seen = [i for batch in ids(loader) for i in batch]
    assert sorted(seen) == list(range(600))


def test_the_pool_batchers_stats_are_the_padding_of_its_batches(corpus):
    batcher = stream_batcher(corpus, "bucket", through="mix")
    batches = list(batcher)
    assert batcher.stats == padding_of(batches, "input_ids")
    assert batcher.stats.batches == len(batches) > 0


def test_seed_and_epoch_change_the_order(corpus):
    first = ids(stream_batcher(corpus, "bucket", through="mix", seed=1))
    assert ids(stream_batcher(corpus, "bucket", through="mix", seed=2)) != first
    batcher = stream_batcher(corpus, "bucket", through="mix", seed=1)
    batcher.set_epoch(1)
    assert batcher.source.epoch == 1  # set_epoch reaches the source
    assert ids(batcher) != first
    batcher.set_epoch(0)
    assert ids(batcher) == first


def test_state_is_refused_by_another_batcher(corpus):
    state = stream_batcher(corpus, "bucket", through="mix").state_dict()
    with pytest.raises(StateMismatchError, match="configured as"):
        stream_batcher(corpus, "bucket", through="mix", seed=9).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="not a streamds batcher state"):
        stream_batcher(corpus, "bucket", through="mix").load_state_dict({"pool": 0})
