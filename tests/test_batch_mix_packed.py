"""`.batch(...)` on a `Mix` and on packed data: exactly once per epoch, exact resume after any
batch (0 and 2 workers), the same semantics as `StreamingJsonl.batch`; `.map`/`.filter` on
both.

Two small corpora of plain JSONL (ids 0.. and 10_000..), shuffled. Resume checks use the
shared contract (`resume_contract.run_test_save_load_state`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import corpus
import pytest
from resume_contract import ids, run_test_save_load_state
from test_elastic import assert_exactly_once
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import (
    LengthBuckets,
    Mix,
    PackTokens,
    StateMismatchError,
    StreamingJsonl,
    TokenBudget,
    merge_states,
)
from streamds.stages.batch import RecordBatch

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

SIZES = {"a": (3, 25, 0), "b": (2, 20, 10_000)}  # files, records per file, first id
EOS = 0


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[int]]]:
    root = tmp_path_factory.mktemp("batch_mix")
    found = {}
    for name, (files, per_file, first) in SIZES.items():
        (root / name).mkdir()
        every: list[int] = []
        for number in range(files):
            start = first + number * per_file
            corpus.write_plain(root / name / f"part-{number}.jsonl",
                               corpus.jsonl(corpus.make_records(per_file, start=start)))
            every += range(start, start + per_file)
        found[name] = (str(root / name), every)
    return found


def every_id(sources: dict[str, tuple[str, list[int]]]) -> list[int]:
    return [i for _, every in sources.values() for i in every]


def mix(sources: dict[str, tuple[str, list[int]]], **world: Any) -> Mix:
    readers = [StreamingJsonl(path, shuffle=True, seed=5, buffer_size=8, **world)
               for path, _ in sources.values()]
    return Mix(readers, [0.6, 0.4], seed=3, stop="all")


def text_length(record: dict[str, Any]) -> int:
    return len(record["text"])


def tokens(record: dict[str, Any]) -> dict[str, Any]:
    """Record id i -> 1 + i % 5 tokens of value i + 1 (never EOS), so tokens name records."""
    return {"input_ids": [record["id"] + 1] * (1 + record["id"] % 5)}


def token_lists(batch: list[dict[str, Any]]) -> list[list[int]]:
    """Collate packed sequences to plain lists (comparable with ==, picklable)."""
    return [sequence["input_ids"].tolist() for sequence in batch]


def packed(sources: dict[str, tuple[str, list[int]]]) -> Any:
    path, _ = sources["a"]
    reader = StreamingJsonl(path, shuffle=True, seed=5, buffer_size=8).map(tokens)
    return reader.pack(PackTokens(seq_len=7, eos_id=EOS, key="input_ids"))


def tokens_of(batches: list[list[list[int]]]) -> Counter[int]:
    return Counter(t for batch in batches for seq in batch for t in seq if t != EOS)


def expected_tokens(every: list[int]) -> Counter[int]:
    return Counter({i + 1: 1 + i % 5 for i in every})


# -- Mix.batch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_mix_batch_resumes_exactly_after_any_batch(sources, workers: int) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(mix(sources).batch(4, collate=ids), batch_size=None,
                                  num_workers=workers)

    cuts = range(0, 30) if workers == 0 else [0, 1, 5, 13]
    reference = run_test_save_load_state(make, cuts)
    assert_exactly_once(reference, every_id(sources))
    full = [len(batch) for batch in reference]
    assert max(full) == 4 and full.count(4) >= len(full) - max(1, workers)  # a short end each


@pytest.mark.parametrize("rule", [
    LengthBuckets(4, buffer_size=12, length=text_length),
    LengthBuckets(4, buffer_size=12, length=text_length, drop_last=True),
    TokenBudget(60, buffer_size=10, length=text_length),
])
def test_mix_batch_by_rule_resumes_exactly(sources, rule) -> None:
    make = lambda: mix(sources).batch(rule, collate=ids)  # noqa: E731
    reference = run_test_save_load_state(make, range(0, 25))
    seen = [i for batch in reference for i in batch]
    if getattr(rule, "drop_last", False):
        assert all(len(batch) == 4 for batch in reference)
        assert len(every_id(sources)) - 4 < len(seen) <= len(every_id(sources))
        assert len(set(seen)) == len(seen)
    else:
        assert_exactly_once([seen], every_id(sources))
    if isinstance(rule, TokenBudget):
        lengths = {r["id"]: len(r["text"]) for _, (path, _) in enumerate(sources.values())
                   for r in StreamingJsonl(path)}
        assert all(len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 60 for b in reference)


def test_mix_batch_every_epoch_once_in_a_new_order(sources) -> None:
    batched = mix(sources).batch(5, collate=ids)
    epochs = []
    for epoch in range(2):
        batched.set_epoch(epoch)
        assert batched.source.epoch == epoch  # the mix's epoch moves with it
        epochs.append(list(batched))
        assert_exactly_once(epochs[-1], every_id(sources))
    assert epochs[0] != epochs[1]


def test_mix_batch_has_the_semantics_of_streamingjsonl_batch(sources) -> None:
    plain = [record["id"] for record in mix(sources)]
    batches = list(mix(sources).batch(8))
    assert all(isinstance(batch, RecordBatch) for batch in batches)  # the default collate
    assert [r["id"] for batch in batches for r in batch] == plain  # arrival order, all of it
    assert [len(b) for b in batches] == [8] * (len(plain) // 8) + [len(plain) % 8]
    dropped = list(mix(sources).batch(8, collate=ids, drop_last=True))
    assert [i for batch in dropped for i in batch] == plain[: len(plain) // 8 * 8]
    with pytest.raises(ValueError, match="pass drop_last to LengthBuckets"):
        mix(sources).batch(LengthBuckets(4), drop_last=True)
    with pytest.raises(ValueError, match="size"):
        mix(sources).batch(0)
    with pytest.raises(ValueError, match="collate must be callable"):
        mix(sources).batch(4, collate="ids")


def test_mix_batch_state_is_refused_by_another_batching(sources) -> None:
    first = mix(sources).batch(4, collate=ids)
    iterator = iter(first)
    next(iterator)
    state = first.state_dict()
    with pytest.raises(StateMismatchError, match="configured as"):
        mix(sources).batch(5, collate=ids).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="configured as"):
        mix(sources).batch(LengthBuckets(4, length=text_length)).load_state_dict(state)


def test_mix_batch_merges_and_resumes_in_another_world(sources) -> None:
    """Fixed-size batches end a pool at every batch, so merge_states carries them over."""
    consumed: list[int] = []
    states = []
    for rank, count in ((0, 3), (1, 5)):
        batched = mix(sources, rank=rank, world_size=2).batch(4, collate=ids)
        iterator = iter(batched)
        for _ in range(count):
            consumed += next(iterator)
        states.append(batched.state_dict())
    resumed = mix(sources).batch(4, collate=ids).with_resume(merge_states(states))
    rest = [i for batch in resumed for i in batch]
    assert_exactly_once([consumed, rest], every_id(sources))


# -- packed data -------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_batch_resumes_exactly_after_any_batch(sources, workers: int) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(packed(sources).batch(3, collate=token_lists),
                                  batch_size=None, num_workers=workers)

    cuts = range(0, 16) if workers == 0 else [0, 1, 4, 9]
    reference = run_test_save_load_state(make, cuts)
    assert tokens_of(reference) == expected_tokens(sources["a"][1])  # every token once
    assert all(len(seq) == 7 for batch in reference for seq in batch)


def test_packed_batch_merges_and_resumes_in_another_world(sources) -> None:
    path, every = sources["a"]
    consumed: list[list[list[int]]] = []
    states = []
    for rank, count in ((0, 2), (1, 1)):
        reader = StreamingJsonl(path, shuffle=True, seed=5, buffer_size=8, rank=rank,
                                world_size=2).map(tokens)
        batched = reader.pack(PackTokens(seq_len=7, eos_id=EOS)).batch(2, collate=token_lists)
        iterator = iter(batched)
        consumed += [next(iterator) for _ in range(count)]
        states.append(batched.state_dict())
    merged = merge_states(states)
    rest = list(packed(sources).batch(2, collate=token_lists).with_resume(merged))
    assert tokens_of(consumed + rest) == expected_tokens(every)  # every token once
    with pytest.raises(ValueError, match="StatefulDataLoader"):
        packed(sources).batch(2).resume_after_batches(3, batch_size=2, num_workers=0)


def test_packed_batch_is_the_packed_sequences_in_order(sources) -> None:
    sequences = token_lists(list(packed(sources)))
    batches = list(packed(sources).batch(4, collate=token_lists))
    assert [seq for batch in batches for seq in batch] == sequences
    kept = list(packed(sources).batch(4, collate=token_lists, drop_last=True))
    assert [len(b) for b in kept] == [4] * (len(sequences) // 4)
    batched = packed(sources).batch(4, collate=token_lists)
    batched.set_epoch(1)
    assert batched.source.epoch == 1
    assert list(batched) != batches  # the reader's next epoch's order


# -- map and filter on a Mix and on packed data -----------------------------------------------


def even(record: dict[str, Any]) -> bool:
    return record["id"] % 2 == 0


def id_only(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "double": 2 * record["id"]}


def no_nines(sequence: dict[str, Any]) -> bool:
    """Drops the packed sequences holding a token of record id 8 (value 9)."""
    return 9 not in sequence["input_ids"].tolist()


def with_length(sequence: dict[str, Any]) -> dict[str, Any]:
    return {**sequence, "real": int((sequence["document_ids"] >= 0).sum())}


def sequence_ids(batch: list[dict[str, Any]]) -> list[Any]:
    return [[seq["input_ids"].tolist(), seq["real"]] for seq in batch]


def fails_on_seven(record: dict[str, Any]) -> dict[str, Any]:
    if record["id"] == 7:
        raise KeyError("no such field")
    return record


@pytest.mark.parametrize("workers", [0, 2])
def test_mix_map_and_filter_resume_exactly(sources, workers: int) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(mix(sources).filter(even).map(id_only), batch_size=3,
                                  num_workers=workers, collate_fn=ids)

    cuts = range(0, 21) if workers == 0 else [0, 2, 7]
    reference = run_test_save_load_state(make, cuts)
    kept = [i for i in every_id(sources) if i % 2 == 0]
    assert_exactly_once(reference, kept)
    if workers == 0:
        plain = [id_only(r) for r in mix(sources) if even(r)]
        assert list(mix(sources).filter(even).map(id_only)) == plain


def test_mix_map_leaves_the_mix_it_came_from_alone(sources) -> None:
    plain = mix(sources)
    mapped = plain.map(id_only)
    first = iter(plain)
    head = [next(first)["id"] for _ in range(5)]
    state = plain.state_dict()
    assert [r["double"] for r in mapped][:5] == [2 * i for i in head]  # its own sources
    assert plain.state_dict() == state  # still where this mix's own reader stands
    assert head + [r["id"] for r in first] == [r["id"] for r in mix(sources)]
    assert plain.taken == [75, 40]
    batched = plain.filter(even).batch(4, collate=ids)  # .filter(...).batch(...) chains
    assert_exactly_once(list(batched), [i for i in every_id(sources) if i % 2 == 0])


def test_mix_map_error_keeps_its_type_and_names_the_step(sources) -> None:
    with pytest.raises(KeyError) as caught:
        list(mix(sources).map(fails_on_seven))
    assert "map step 1 of 1" in "".join(caught.value.__notes__)
    assert "this Mix" in "".join(caught.value.__notes__)
    with pytest.raises(ValueError, match="map needs a callable"):
        mix(sources).map(3)


def test_mix_filter_refuses_a_plain_loader_resume(sources) -> None:
    with pytest.raises(ValueError, match=r"a \.filter\(\) step"):
        mix(sources).filter(even).resume_after_batches(2, batch_size=4, num_workers=0)


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_map_filter_batch_resume_exactly(sources, workers: int) -> None:
    def make() -> StatefulDataLoader:
        batched = packed(sources).filter(no_nines).map(with_length).batch(
            2, collate=sequence_ids)
        return StatefulDataLoader(batched, batch_size=None, num_workers=workers)

    cuts = range(0, 22) if workers == 0 else [0, 3, 8]
    reference = run_test_save_load_state(make, cuts)
    sequences = [seq for batch in reference for seq in batch]
    assert all(9 not in tokens for tokens, _ in sequences)
    padded = [real for _, real in sequences if real < 7]  # the map saw each sequence
    assert 1 <= len(padded) <= max(1, workers)  # each reader's last one only
    if workers == 0:
        whole = [with_length(seq) for seq in packed(sources) if no_nines(seq)]
        assert sequences == [[seq["input_ids"].tolist(), seq["real"]] for seq in whole]
        assert len(whole) < len(list(packed(sources)))  # the filter dropped some

