"""The stages beside the reader chain follow its protocol (``reset(state)``, iteration,
``get_state()``) and pass the shared exact-resume contract as stages, without a dataset
around them: `PoolStage` over a plain list (fast-forwarded by count) and over a stateful
source, and `Rebatch`.
"""

from __future__ import annotations

import random
from typing import Any

import corpus
import pytest
from resume_contract import run_test_save_load_state

from streamds import StreamingJsonl
from streamds.stages.buckets import LengthBuckets
from streamds.stages.pools import PoolStage
from streamds.stages.rebatch import Rebatch


def pools(source: Any) -> PoolStage:
    rule = LengthBuckets(3, buffer_size=9, length=len)
    return PoolStage(source, config=["test", 9], pool_size=rule.pool_size, measure=len,
                     cut=rule.cut, rng=lambda epoch, pool: random.Random(epoch * 1000 + pool),
                     collate=list, epoch=0)


def test_pool_stage_over_a_list_resumes_exactly() -> None:
    words = [f"w{'x' * (i % 7)}{i}" for i in range(40)]
    reference = run_test_save_load_state(lambda: pools(words), range(0, 14))
    assert sorted(w for batch in reference for w in batch) == sorted(words)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    file = tmp_path_factory.mktemp("stages") / "part.jsonl"
    corpus.write_plain(file, corpus.jsonl(corpus.make_records(40)))
    return str(file)


def texts(record: dict[str, Any]) -> str:
    return record["text"]


def test_pool_stage_over_a_stateful_source_resumes_exactly(path: str) -> None:
    def make() -> PoolStage:
        return pools(StreamingJsonl(path, shuffle=True, seed=3, buffer_size=8).map(texts))

    reference = run_test_save_load_state(make, range(0, 14))
    assert len([t for batch in reference for t in batch]) == 40


class _Loader:
    """The dataset itself as a loader with batch_size=None, in one process."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Any:
        return iter(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)


def ids(batch: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in batch]


def test_rebatch_as_a_stage_resumes_exactly(path: str) -> None:
    def make() -> Rebatch:
        big = StreamingJsonl(path, shuffle=True, seed=3, buffer_size=8).batch(7)
        return Rebatch(_Loader(big), 3, collate=ids)

    reference = run_test_save_load_state(make, range(0, 14))
    assert sorted(i for batch in reference for i in batch) == list(range(40))
    stage = make()
    stage.reset(None)  # where the loader stands: the start
    assert list(stage) == reference
