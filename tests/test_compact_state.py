"""A state taken in a DataLoader worker comes compact: StatefulDataLoader walks every key of
the state after every batch (in the worker and, per worker, in the main process), so the
compact form has four keys, its long values (a shuffle buffer's positions) and what did not
change since the last batch riding apart so torchdata ships them only when they change. It
expands to exactly the tree a state taken outside a worker is, and every reader of states
(load_state_dict, merge_states, counts_of) takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import corpus
import pytest
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.incremental_state import _flatten

import streamds.datasets.base as base
from streamds import Mix, StreamingJsonl, counts_of, merge_states
from streamds.stages.state import COMPACT, STAGE, compacted, expanded, expanded_within


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("compact")
    found = []
    for name, start in (("a", 0), ("b", 1000)):
        path = root / f"{name}.jsonl"
        corpus.write_plain(path, corpus.jsonl(corpus.make_records(2000, start=start * 10)))
        found.append(str(path))
    return found[0], found[1]


def reader(paths: tuple[str, str]) -> StreamingJsonl:
    return StreamingJsonl(paths[0], shuffle=True, seed=1, buffer_size=300)


def mix(paths: tuple[str, str]) -> Mix:
    return Mix([StreamingJsonl(path, shuffle=True, seed=1, buffer_size=300) for path in paths],
               [0.5, 0.5], seed=2)


def batched(paths: tuple[str, str]) -> Any:
    return reader(paths).batch(7)


class _AnyWorker:
    """What get_worker_info() returns in a DataLoader worker (only its being there counts)."""


@pytest.mark.parametrize("make", [reader, mix, batched], ids=["reader", "mix", "batched"])
def test_a_worker_state_is_compact_and_expands_to_the_tree(
    paths: tuple[str, str], make: Callable[[tuple[str, str]], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = make(paths)
    items = iter(made)
    for _ in range(150 if make is batched else 1100):  # past a renewed buffer snapshot
        next(items)
    trees, compacts = [], []
    for _ in range(2):  # the second time, what did not change rides apart whole
        next(items)
        trees.append(made.state_dict())
        with monkeypatch.context() as worker:
            worker.setattr(base, "get_worker_info", _AnyWorker)
            compacts.append(made.state_dict())
    for tree, compact in zip(trees, compacts, strict=True):
        assert compact[STAGE] == COMPACT
        assert len(_flatten(compact)) <= 4  # what torchdata walks after every batch
        assert expanded(compact) == tree
    assert len(repr(compacts[1]["tree"])) < len(repr(compacts[0]["tree"])) / 2
    if make is not mix:  # (a mix's sources have not yet renewed their buffers' snapshots)
        assert any(isinstance(value, bytes) for _, value in compacts[0]["apart"]), \
            "the shuffle buffer's positions ride apart"
    rest = list(items)
    resumed = make(paths)
    resumed.load_state_dict(compacts[1])
    assert list(resumed) == rest


def test_compacting_keeps_every_value(paths: tuple[str, str]) -> None:
    state = {"format": "streamds/5", "stage": "x", "long": b"a" * 100, "short": [1, [2, "b"]],
             "nodes": [{"blob": list(range(70)), "n": 1}, {"empty": {}}], "text": "t" * 64}
    compact = compacted(state)
    assert expanded(compact) == state
    assert expanded(compact) is not expanded(compact)  # a copy: the loader keeps its own
    assert [path for path, _ in compact["apart"]] == [["long"], ["nodes", 0, "blob"]]


def test_a_loader_state_of_compact_workers_merges_counts_and_resumes(
    paths: tuple[str, str], tmp_path: Path
) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(reader(paths), batch_size=10, num_workers=2,
                                  collate_fn=lambda batch: [r["id"] for r in batch])

    whole = [i for batch in make() for i in batch]
    loader = make()
    batches = iter(loader)
    seen = [i for _, batch in zip(range(13), batches, strict=False) for i in batch]
    state = loader.state_dict()
    worker = state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]
    assert worker[STAGE] == COMPACT
    assert counts_of(state)["bad"] == 0
    assert merge_states([state])["stage"] == "merged"
    resumed = make()
    resumed.load_state_dict(state)
    rest = [i for batch in resumed for i in batch]
    assert seen + rest == whole


def test_expanded_within_expands_each_compact_state_once_and_shares_the_rest() -> None:
    tree = {"format": "streamds/5", "stage": "x", "positions": b"p" * 80, "n": 1}
    plain = {"other": [1, 2], "n": 3}
    loader = {"workers": [compacted(tree), plain], "step": 5}
    found = expanded_within(loader)
    assert found == {"workers": [tree, plain], "step": 5}
    assert found["workers"][1] is plain  # (a merge finds nodes by id: one walk, one copy)
    assert expanded_within(plain) is plain
