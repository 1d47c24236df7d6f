"""Every dataset type (a reader, a mix, packed data) offers the same methods: `map`, `filter`,
`batch`, `pack`, `set_epoch`, `state_dict`, `load_state_dict`, `with_resume`
(`streamds.datasets.base.METHODS`), each of them resuming exactly where it yields data.
Packed data refuses `pack`, naming why.

One small corpus of plain JSONL per source (ids 0.. and 1000..), shuffled; resume checks use
the shared contract (`resume_contract.run_test_save_load_state`), in one process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import corpus
import pytest
from resume_contract import run_test_save_load_state

from streamds import Mix, PackTokens, StreamingJsonl, merge_states
from streamds.datasets.base import METHODS, StreamdsDataset

EOS = 0


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return corpus.write_two_sources(tmp_path_factory.mktemp("methods"), 30)


def tokens(record: dict[str, Any]) -> dict[str, Any]:
    """Record id i -> 1 + i % 3 tokens of value i + 1 (never EOS), so tokens name records."""
    return {"input_ids": [record["id"] + 1] * (1 + record["id"] % 3), "id": record["id"]}


def reader(paths: tuple[str, str]) -> StreamingJsonl:
    return StreamingJsonl(paths[0], shuffle=True, seed=1, buffer_size=6).map(tokens)


def mix(paths: tuple[str, str]) -> Mix:
    sources = [StreamingJsonl(path, shuffle=True, seed=1, buffer_size=6).map(tokens)
               for path in paths]
    return Mix(sources, [0.6, 0.4], seed=2)


def packed(paths: tuple[str, str]) -> Any:
    return reader(paths).pack(PackTokens(seq_len=5, eos_id=EOS))


TYPES: list[tuple[str, Callable[[tuple[str, str]], Any]]] = [
    ("reader", reader), ("mix", mix), ("packed", packed)]
IDS = [name for name, _ in TYPES]
MAKERS = [make for _, make in TYPES]


def plain(item: Any) -> Any:
    """An item as comparable plain values (a packed sequence's tensors as lists)."""
    if isinstance(item, dict) and "position_ids" in item:
        return [item["input_ids"].tolist(), item.get("tag")]
    if isinstance(item, dict):
        return [item["id"], item.get("tag")]
    return item


def plain_batch(batch: list[Any]) -> list[Any]:
    return [plain(item) for item in batch]


def tag(item: Any) -> Any:
    return {**item, "tag": "mapped"}


def keep(item: Any) -> bool:
    """Keep two items in three, by content (id or first token)."""
    first = item["id"] if "position_ids" not in item else int(item["input_ids"][0])
    return first % 3 != 1


@pytest.mark.parametrize("make", MAKERS, ids=IDS)
def test_every_type_offers_the_same_methods(paths: tuple[str, str], make: Any) -> None:
    dataset = make(paths)
    assert isinstance(dataset, StreamdsDataset)
    for name in METHODS:
        assert callable(getattr(dataset, name)), f"{type(dataset).__name__} lacks {name}"


@pytest.mark.parametrize("make", MAKERS, ids=IDS)
def test_map_and_filter_return_new_datasets_that_resume_exactly(
    paths: tuple[str, str], make: Any
) -> None:
    base = make(paths)
    before = [plain(item) for item in make(paths)]
    derived = base.map(tag).filter(keep)
    assert type(derived) is type(base)
    reference = run_test_save_load_state(lambda: _Plain(make(paths).map(tag).filter(keep)),
                                         [0, 1, 4, 9])
    assert reference and all(item[1] == "mapped" for item in reference)
    assert len(reference) < len(before)  # the filter dropped some
    assert [plain(item) for item in base] == before  # the original is unchanged


@pytest.mark.parametrize("make", MAKERS, ids=IDS)
def test_batch_yields_whole_batches_that_resume_exactly(
    paths: tuple[str, str], make: Any
) -> None:
    reference = run_test_save_load_state(lambda: make(paths).batch(4, collate=plain_batch),
                                         [0, 1, 3, 4])
    items = [item for batch in reference for item in batch]
    assert items == [plain(item) for item in make(paths)]
    assert [len(batch) for batch in reference[:-1]] == [4] * (len(reference) - 1)


@pytest.mark.parametrize("make", [reader, mix], ids=["reader", "mix"])
def test_pack_packs_every_token_once_and_resumes_exactly(
    paths: tuple[str, str], make: Any
) -> None:
    def packed_of() -> _Plain:
        return _Plain(make(paths).pack(PackTokens(seq_len=5, eos_id=EOS)))

    reference = run_test_save_load_state(packed_of, [0, 1, 5, 11])
    assert {len(tokens_) for tokens_, _ in reference} == {5}
    got = Counter(t for tokens_, _ in reference for t in tokens_ if t != EOS)
    want = Counter(t for item in make(paths) for t in item["input_ids"])
    assert got - want == Counter()  # no token twice or made up
    assert sum((want - got).values()) < 5  # only the padding of the last sequence differs


def test_pack_of_packed_data_is_refused_naming_why(paths: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match=r"packed already .*sequences of 5 tokens.*"
                                         r"source\.pack\(PackTokens"):
        packed(paths).pack(PackTokens(seq_len=10, eos_id=EOS))


@pytest.mark.parametrize("make", MAKERS, ids=IDS)
def test_set_epoch_gives_each_epoch_its_order(paths: tuple[str, str], make: Any) -> None:
    def epoch_items(epoch: int) -> list[Any]:
        dataset = make(paths)
        dataset.set_epoch(epoch)
        return [plain(item) for item in dataset]

    assert epoch_items(1) == epoch_items(1)
    assert epoch_items(1) != epoch_items(0)
    if make is packed:  # the same tokens, cut into other sequences
        assert _tokens(epoch_items(1)) == _tokens(epoch_items(0))
    else:
        assert sorted(map(str, epoch_items(1))) == sorted(map(str, epoch_items(0)))


@pytest.mark.parametrize("make", MAKERS, ids=IDS)
def test_state_dict_and_with_resume_finish_the_epoch(paths: tuple[str, str], make: Any) -> None:
    """A state loads back exactly (load_state_dict) and, merged, finishes the epoch in
    another world (with_resume): every item of the epoch once."""
    every = [plain(item) for item in make(paths)]
    first = make(paths)
    iterator = iter(first)
    before = [plain(next(iterator)) for _ in range(7)]
    state = first.state_dict()
    again = make(paths)
    again.load_state_dict(state)
    assert before + [plain(item) for item in again] == every
    merged = merge_states([state])
    rest = []
    for rank in range(2):  # the rest of the epoch, under two ranks
        resumed = _with_world(make, paths, rank, 2).with_resume(merged)
        rest += [plain(item) for item in resumed]
    if make is packed:  # sequences are cut anew under the new world: compare tokens
        assert _tokens(before + rest) == _tokens(every)
    else:
        assert sorted(map(str, before + rest)) == sorted(map(str, every))


def _tokens(items: list[Any]) -> Counter[int]:
    return Counter(t for tokens_, _ in items for t in tokens_ if t != EOS)


def _with_world(make: Any, paths: tuple[str, str], rank: int, world_size: int) -> Any:
    if make is mix:
        sources = [StreamingJsonl(path, shuffle=True, seed=1, buffer_size=6, rank=rank,
                                  world_size=world_size).map(tokens) for path in paths]
        return Mix(sources, [0.6, 0.4], seed=2)
    dataset = StreamingJsonl(paths[0], shuffle=True, seed=1, buffer_size=6, rank=rank,
                             world_size=world_size).map(tokens)
    return dataset.pack(PackTokens(seq_len=5, eos_id=EOS)) if make is packed else dataset


class _Plain:
    """A dataset whose items come out as plain values, with its state methods."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Any:
        return (plain(item) for item in self.dataset)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)


# -- the batches of a mix or of packed data are a dataset of the same kind ---------------------


def id_list(batch: list[Any]) -> list[Any]:
    return [plain(item) for item in batch]


def batched(paths: tuple[str, str]) -> Any:
    return mix(paths).batch(3, collate=id_list)


def first_id_even(batch: list[Any]) -> bool:
    return batch[0][0] % 2 == 0


def with_size(batch: list[Any]) -> list[Any]:
    return [len(batch), *batch]


def test_batches_offer_the_same_methods(paths: tuple[str, str]) -> None:
    dataset = batched(paths)
    assert isinstance(dataset, StreamdsDataset)
    for name in METHODS:
        assert callable(getattr(dataset, name)), f"Batched lacks {name}"


def test_map_and_filter_of_batches_resume_exactly(paths: tuple[str, str]) -> None:
    whole = list(batched(paths))
    derived = batched(paths).map(with_size).filter(lambda batch: first_id_even(batch[1:]))
    reference = run_test_save_load_state(
        lambda: batched(paths).filter(first_id_even).map(with_size), [0, 1, 3, 5])
    assert reference == [with_size(batch) for batch in whole if first_id_even(batch)]
    assert list(derived) == reference
    assert 0 < len(reference) < len(whole)


def test_batches_of_batches_and_pack_of_batches(paths: tuple[str, str]) -> None:
    reference = run_test_save_load_state(lambda: batched(paths).batch(2, collate=list),
                                         [0, 1, 4])
    assert [batch for pair in reference for batch in pair] == list(batched(paths))
    with pytest.raises(ValueError, match=r"whole batches, not tokenized documents.*pack "
                                         r"before batching"):
        batched(paths).pack(PackTokens(seq_len=5, eos_id=EOS))


def test_mapped_batches_finish_a_merged_epoch(paths: tuple[str, str]) -> None:
    first = batched(paths).map(with_size)
    iterator = iter(first)
    before = [next(iterator) for _ in range(4)]  # 4 whole pools of 3: nothing under way
    merged = merge_states([first.state_dict()])
    rest = list(batched(paths).map(with_size).with_resume(merged))
    assert all(batch[0] == len(batch) - 1 for batch in before + rest)  # the map still runs
    items = [item for batch in before + rest for item in batch[1:]]
    assert sorted(map(str, items)) == sorted(map(str, [plain(i) for i in mix(paths)]))
