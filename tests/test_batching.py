"""Batches, BucketBatches, TokenBudgetBatches: exactly once, budgets, padding, order, resume.

The wrappers are deprecated in favour of ``dataset.batch(...)``; they keep working (and these
tests keep checking them) for one release."""

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

from streamds import StateMismatchError, Storage, StreamingJsonl
from streamds.datasets.batching import (
    Batches,
    BucketBatches,
    PaddingStats,
    TokenBudgetBatches,
    padding_of,
)
from streamds.train.collate import as_list

pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
    # the deprecated wrappers' own tests: they keep working for one release
    pytest.mark.filterwarnings("ignore:streamds .*Batches is deprecated:DeprecationWarning"),
]

LENGTH = itemgetter(1)  # records are (id, length) pairs in the property tests
lengths_st = st.lists(st.integers(1, 300), min_size=0, max_size=300)


def records_of(lengths: list[int]) -> list[tuple[int, int]]:
    return list(enumerate(lengths))


def ids(batches) -> list[list[int]]:
    return [[r[0] if isinstance(r, tuple) else r["id"] for r in batch] for batch in batches]


def make(kind: str, source, seed: int = 0, **kw):
    if kind == "plain":
        return Batches(source, batch_size=kw.get("batch_size", 4), length=LENGTH)
    if kind == "bucket":
        return BucketBatches(source, batch_size=kw.get("batch_size", 4),
                             buffer_size=kw.get("buffer_size", 16), length=LENGTH, seed=seed)
    return TokenBudgetBatches(source, max_tokens=kw.get("max_tokens", 400),
                              buffer_size=kw.get("buffer_size", 16), length=LENGTH, seed=seed)


# --- exactly once -------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(lengths_st, st.integers(1, 9), st.integers(1, 40), st.integers(0, 2**32),
       st.sampled_from(["plain", "bucket", "tokens"]))
def test_every_record_exactly_once(lengths, batch_size, buffer_size, seed, kind):
    source = records_of(lengths)
    batches = list(make(kind, source, seed, batch_size=batch_size, buffer_size=buffer_size,
                        max_tokens=batch_size * 100))
    seen = Counter(i for batch in ids(batches) for i in batch)
    assert sorted(seen) == list(range(len(lengths)))
    assert set(seen.values()) <= {1}
    assert all(batches)  # no empty batch


@settings(max_examples=50, deadline=None)
@given(lengths_st, st.integers(1, 9), st.integers(1, 40))
def test_fixed_size_batches(lengths, batch_size, buffer_size):
    batches = list(make("bucket", records_of(lengths), batch_size=batch_size,
                        buffer_size=buffer_size))
    short = [b for b in batches if len(b) != batch_size]
    assert all(len(b) <= batch_size for b in batches)
    pool = -(-buffer_size // batch_size) * batch_size
    pools = -(-len(lengths) // pool) if lengths else 0
    assert len(short) <= pools  # at most one short batch per pool (only the last pool's, here)
    assert len(short) <= 1


def test_drop_last_drops_only_the_short_batch():
    source = records_of([5] * 10)
    plain = list(Batches(source, batch_size=4, drop_last=True, length=LENGTH))
    assert [len(b) for b in plain] == [4, 4]
    bucket = list(BucketBatches(source, batch_size=4, buffer_size=8, length=LENGTH,
                                drop_last=True))
    assert sorted(len(b) for b in bucket) == [4, 4]


# --- token budget -------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(lengths_st, st.integers(1, 600), st.integers(1, 50), st.one_of(st.none(),
       st.integers(1, 6)))
def test_no_batch_exceeds_the_budget(lengths, max_tokens, buffer_size, cap):
    batches = list(TokenBudgetBatches(records_of(lengths), max_tokens=max_tokens,
                                      buffer_size=buffer_size, max_batch_size=cap,
                                      length=LENGTH))
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
    sizes = {LENGTH(b[0]): len(b) for b in TokenBudgetBatches(source, max_tokens=200,
                                                             buffer_size=48, length=LENGTH)}
    assert sizes == {10: 20, 100: 2}


# --- padding ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=80), st.integers(1, 9), st.integers(1, 6),
       st.integers(0, 1000))
def test_bucketing_never_pads_more_than_plain_batching(lengths, batch_size, pool_batches, seed):
    source = records_of(lengths)
    plain = padding_of(Batches(source, batch_size=batch_size, length=LENGTH), LENGTH)
    bucket = padding_of(BucketBatches(source, batch_size=batch_size,
                                      buffer_size=pool_batches * batch_size, length=LENGTH,
                                      seed=seed), LENGTH)
    assert bucket.real == plain.real == sum(lengths)
    assert bucket.padded <= plain.padded


def test_bucketing_cuts_padding_on_random_lengths():
    rng = random.Random(7)
    source = records_of([rng.randint(1, 512) for _ in range(4000)])
    plain = padding_of(Batches(source, batch_size=32, length=LENGTH), LENGTH)
    bucket = padding_of(BucketBatches(source, batch_size=32, buffer_size=1024,
                                      length=LENGTH), LENGTH)
    budget = padding_of(TokenBudgetBatches(source, max_tokens=32 * 256, buffer_size=1024,
                                           length=LENGTH), LENGTH)
    assert plain.pad_fraction > 0.4
    assert bucket.pad_fraction < 0.05
    assert budget.pad_fraction < 0.05


def test_padding_stats_arithmetic_and_batcher_stats():
    stats = PaddingStats()
    stats.add([3, 1])
    stats.add([])
    assert (stats.batches, stats.records, stats.real, stats.padded) == (1, 2, 4, 6)
    assert stats.pad_tokens == 2 and stats.pad_fraction == pytest.approx(1 / 3)
    total = stats + stats
    assert total.as_dict()["padded"] == 12
    batcher = make("bucket", records_of([random.Random(1).randint(1, 50) for _ in range(50)]))
    batches = list(batcher)
    assert batcher.stats == padding_of(batches, LENGTH)


def test_length_may_be_a_field_name():
    source = [{"id": i, "input_ids": [0] * n} for i, n in enumerate([3, 1, 2, 5])]
    stats = padding_of(BucketBatches(source, batch_size=2, buffer_size=4), "input_ids")
    assert (stats.real, stats.padded) == (11, 2 * 2 + 2 * 5)


# --- order --------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(lengths_st, st.integers(0, 2**32), st.sampled_from(["bucket", "tokens"]))
def test_same_seed_same_batches(lengths, seed, kind):
    source = records_of(lengths)
    assert ids(make(kind, source, seed)) == ids(make(kind, source, seed))


def test_seed_and_epoch_change_the_order():
    source = records_of([random.Random(3).randint(1, 100) for _ in range(200)])
    first = ids(make("bucket", source, seed=1))
    assert ids(make("bucket", source, seed=2)) != first
    batcher = make("bucket", source, seed=1)
    batcher.set_epoch(1)
    assert ids(batcher) != first
    batcher.set_epoch(0)
    assert ids(batcher) == first


def test_set_epoch_reaches_the_source():
    class Source(list):
        epoch = None

        def set_epoch(self, epoch):
            self.epoch = epoch

    source = Source(records_of([1, 2, 3]))
    make("bucket", source).set_epoch(5)
    assert source.epoch == 5


# --- arguments ----------------------------------------------------------------------------


def test_bad_arguments_fail_early():
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        BucketBatches([], batch_size=0)
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBudgetBatches([], max_tokens=0)
    with pytest.raises(ValueError, match="one-shot iterator"):
        Batches(iter([]), batch_size=2)
    with pytest.raises(ValueError, match="length must be"):
        Batches([], batch_size=2, length=3)
    with pytest.raises(ValueError, match="seed"):
        BucketBatches([], batch_size=2, seed=-1)


# --- resume -------------------------------------------------------------------------------


def resume_matches(factory, at: int) -> None:
    """State after `at` batches, loaded into a fresh batcher, continues the same batches."""
    full = ids(factory())
    batcher = factory()
    iterator = iter(batcher)
    head = [next(iterator) for _ in range(at)]
    state = batcher.state_dict()
    fresh = factory()
    fresh.load_state_dict(state)
    assert ids(head) + ids(fresh) == full


@pytest.mark.parametrize("kind", ["plain", "bucket", "tokens"])
def test_resume_at_every_batch_of_a_list(kind):
    source = records_of([random.Random(5).randint(1, 120) for _ in range(60)])

    def factory():
        return make(kind, source, seed=3, buffer_size=13)

    for at in range(len(list(factory())) + 1):
        resume_matches(factory, at)


def test_state_is_refused_by_another_batcher():
    source = records_of([1, 2, 3, 4])
    state = make("bucket", source).state_dict()
    with pytest.raises(StateMismatchError, match="configured as"):
        make("bucket", source, seed=9).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="not a streamds batcher state"):
        make("bucket", source).load_state_dict({"pool": 0})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("batching") / "corpus.jsonl"
    rng = random.Random(0)
    with path.open("wb") as f:
        for i in range(600):
            f.write(orjson.dumps({"id": i, "input_ids": [1] * rng.randint(1, 200)}) + b"\n")
    return str(path)


def stream_batcher(corpus: str, kind: str):
    ds = StreamingJsonl(corpus, shuffle=True, seed=4, buffer_size=32,
                        storage=Storage(block_size=64 << 10))
    if kind == "bucket":
        return BucketBatches(ds, batch_size=8, buffer_size=48, seed=1)
    return TokenBudgetBatches(ds, max_tokens=600, buffer_size=50, seed=1)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["bucket", "tokens"])
def test_stateful_dataloader_resumes_exactly(corpus, kind, num_workers):
    def loader():
        return StatefulDataLoader(stream_batcher(corpus, kind), batch_size=None,
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


def test_plain_dataloader_with_workers_reads_everything_once(corpus):
    batcher = stream_batcher(corpus, "bucket")
    loader = DataLoader(batcher, batch_size=None, num_workers=2, collate_fn=as_list)
    seen = [i for batch in ids(loader) for i in batch]
    assert sorted(seen) == list(range(600))
