"""A dataset derived from another (`map`, `filter`, `batch`, `pack`) follows its base's epoch
(issue 27, item 9): ``base.set_epoch(e)`` before each epoch of ``DataLoader(base.map(f))``
gives epoch e's order, never a silently repeated one. A `streamds.Mix` sets its sources'
epochs itself, so a source's own set_epoch that it would ignore is refused instead.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import torch
from torch.utils.data import DataLoader

from streamds import Mix, PackTokens, StreamingJsonl

RECORDS = 600
EPOCHS = 3


def with_ids(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "input_ids": [record["id"], record["id"] + 1]}


def odd(record: dict[str, Any]) -> bool:
    return record["id"] % 2 == 1


def keep(batch: list) -> list:
    return batch


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One plain JSONL file of several 64 KiB blocks, so that both workers read some."""
    path = tmp_path_factory.mktemp("epochs") / "a.jsonl"
    pad = "x" * 400
    path.write_bytes(b"".join(orjson.dumps({"id": i, "pad": pad}) + b"\n"
                              for i in range(RECORDS)))
    return str(path)


def ids_of(dataset: Any, workers: int, *, batched: bool = False) -> list[int]:
    """Every id one epoch of a real DataLoader over `dataset` yields, in the order it yields."""
    loader = DataLoader(dataset, batch_size=None if batched else 16, num_workers=workers,
                        collate_fn=keep)
    out: list[int] = []
    for batch in loader:
        if isinstance(batch, dict):  # a packed sequence: its first token of each record
            out.extend(int(t) for t in batch["input_ids"][::3] if t != 0)
        else:
            out.extend(item["id"] if isinstance(item, dict) else int(item) for item in batch)
    return out


DERIVED = {
    "map": lambda base: base.map(with_ids),
    "filter": lambda base: base.filter(odd),
    "map then filter": lambda base: base.map(with_ids).filter(odd),
    "batch(8)": lambda base: base.batch(8, collate=keep),
    "pack": lambda base: base.map(with_ids).pack(PackTokens(seq_len=30, eos_id=0)),
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("derive", DERIVED.values(), ids=DERIVED.keys())
def test_a_derived_dataset_follows_set_epoch_on_its_base(source, derive, workers):
    base = StreamingJsonl(source, shuffle=True, seed=1, buffer_size=64)
    derived = derive(base)
    batched = not isinstance(derived, StreamingJsonl) or derived._batch is not None
    orders = []
    for epoch in range(EPOCHS):
        base.set_epoch(epoch)
        orders.append(ids_of(derived, workers, batched=batched))
    # each epoch is the order of that epoch, as a dataset set to it directly yields
    for epoch, order in enumerate(orders):
        direct = derive(StreamingJsonl(source, shuffle=True, seed=1, buffer_size=64))
        direct.set_epoch(epoch)
        assert order == ids_of(direct, workers, batched=batched)
    assert len({tuple(order) for order in orders}) == EPOCHS  # never a repeated order
    assert sorted(orders[0]) == sorted(orders[1])  # the same records each epoch


def test_set_epoch_on_the_derived_copy_reaches_the_base(source):
    base = StreamingJsonl(source, shuffle=True)
    derived = base.map(with_ids).batch(4)
    derived.set_epoch(5)
    assert base.epoch == 5 and base.map(with_ids).epoch == 5


def test_a_loaded_state_sets_the_epoch_of_the_whole_family(source):
    base = StreamingJsonl(source, shuffle=True, buffer_size=32)
    derived = base.map(with_ids)
    derived.set_epoch(2)
    iterator = iter(derived)
    for _ in range(10):
        next(iterator)
    state = derived.state_dict()
    fresh = StreamingJsonl(source, shuffle=True, buffer_size=32)
    again = fresh.map(with_ids)
    again.load_state_dict(state)
    assert fresh.epoch == 2  # the loaded mid-epoch state chose the epoch for both
    with pytest.raises(ValueError, match="in the middle of epoch 2"):
        fresh.set_epoch(0)  # it would drop the loaded state: refused, as on `again` itself
    rest = [record["id"] for record in again]
    expected = [record["id"] for record in iterator]
    assert rest == expected
    fresh.set_epoch(3)  # the loaded state started: any epoch again


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mix_refuses_a_source_epoch_it_would_ignore(source, workers):
    a = StreamingJsonl(source, shuffle=True, buffer_size=64)
    b = StreamingJsonl(source, shuffle=True, seed=7, buffer_size=64)
    mix = Mix([a, b.map(with_ids)], [0.5, 0.5], seed=0)
    first = ids_of(mix, workers)
    a.set_epoch(1)
    b.set_epoch(1)
    with pytest.raises(ValueError, match=r"mix\.set_epoch\(1\)"):
        ids_of(mix, workers)
    mix.set_epoch(1)  # the mix's own epoch: its sources follow it
    second = ids_of(mix, workers)
    assert second != first and sorted(second) == sorted(first)


def test_pack_sequences_are_tensors(source):
    """The packed case above reads ids from tensors: they are tensors of input ids."""
    packed = StreamingJsonl(source).map(with_ids).pack(PackTokens(seq_len=30, eos_id=0))
    first = next(iter(packed))
    assert isinstance(first["input_ids"], torch.Tensor)
