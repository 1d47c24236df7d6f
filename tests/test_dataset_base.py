"""What the one base (`streamds.datasets.base.StreamdsDataset`) gives every dataset type:
`.cache` on a mix, packed data and batches (stored per source reader: the same items, order
and states, the steps before it not run again), `len()` wherever the count is known exactly
(a mix with stop="all", batches of a known count) and a TypeError naming why elsewhere
(packed data, stop="first"), and the types built through the base's registry.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import corpus
import pytest
from resume_contract import run_test_save_load_state
from torch.utils.data import DataLoader

from streamds import Mix, PackTokens, StreamingJsonl
from streamds.datasets.base import StreamdsDataset
from streamds.datasets.batching import Batched
from streamds.datasets.pack import Packed
from streamds.preprocess.convert import convert

EOS = 0
CALLS = {"map": 0}


def tokens(record: dict[str, Any]) -> dict[str, Any]:
    """Counts its calls; record id i -> 1 + i % 3 tokens of value i + 1 (never EOS)."""
    CALLS["map"] += 1
    return {"input_ids": [record["id"] + 1] * (1 + record["id"] % 3), "id": record["id"]}


def plain(item: Any) -> Any:
    if isinstance(item, dict) and "position_ids" in item:
        return item["input_ids"].tolist()
    if isinstance(item, dict):
        return item["id"]
    return [plain(one) for one in item]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return corpus.write_two_sources(tmp_path_factory.mktemp("base"), 40)


def sources(paths: tuple[str, str], **options: Any) -> list[StreamingJsonl]:
    return [StreamingJsonl(path, shuffle=True, seed=1, buffer_size=6, **options).map(tokens)
            for path in paths]


def mix(paths: tuple[str, str]) -> Mix:
    return Mix(sources(paths), [0.6, 0.4], seed=2)


def packed_mix(paths: tuple[str, str]) -> Any:
    return mix(paths).pack(PackTokens(seq_len=5, eos_id=EOS))


def batched_mix(paths: tuple[str, str]) -> Any:
    return mix(paths).batch(4, collate=list)


MAKERS: list[Callable[[tuple[str, str]], Any]] = [mix, packed_mix, batched_mix]
IDS = ["mix", "packed", "batched"]


# -- .cache ------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", MAKERS, ids=IDS)
def test_cache_of_every_type_yields_the_same_items_and_skips_the_stored_steps(
    paths: tuple[str, str], make: Any, tmp_path: Path
) -> None:
    want = {epoch: _epoch(make(paths), epoch) for epoch in (0, 1)}
    cached = make(paths).cache(tmp_path / "cache", key="tokens-v1")
    assert type(cached) is type(make(paths))
    assert _epoch(cached, 0) == want[0]  # the filling epoch
    assert any((tmp_path / "cache").iterdir())  # records were stored
    CALLS["map"] = 0
    assert _epoch(cached, 1) == want[1]  # read back: the sources' map is not run again
    assert CALLS["map"] == 0


@pytest.mark.parametrize("make", MAKERS, ids=IDS)
def test_cache_of_every_type_resumes_exactly(paths: tuple[str, str], make: Any,
                                             tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    _epoch(make(paths).cache(directory, key="tokens-v1"), 0)  # fill it

    class Plain:
        def __init__(self) -> None:
            self.dataset = make(paths).cache(directory, key="tokens-v1")

        def __iter__(self) -> Any:
            return (plain(item) for item in self.dataset)

        def state_dict(self) -> dict[str, Any]:
            return self.dataset.state_dict()

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.dataset.load_state_dict(state)

    reference = run_test_save_load_state(Plain, [0, 1, 3, 7])
    assert reference == [plain(item) for item in make(paths)]


def test_a_state_moves_between_a_cached_and_an_uncached_mix(paths: tuple[str, str],
                                                            tmp_path: Path) -> None:
    every = [plain(item) for item in mix(paths)]
    cached = mix(paths).cache(tmp_path / "cache", key="k")
    iterator = iter(cached)
    before = [plain(next(iterator)) for _ in range(9)]
    plain_mix = mix(paths)
    plain_mix.load_state_dict(cached.state_dict())
    assert before + [plain(item) for item in plain_mix] == every


@pytest.mark.parametrize("make", MAKERS, ids=IDS)
def test_cache_after_the_types_own_steps_is_refused(paths: tuple[str, str], make: Any,
                                                    tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cache\(\) after \.map/\.filter of .*call "
                                         r"\.cache\(\) before adding them"):
        make(paths).map(plain).cache(tmp_path, key="k")


def test_cache_arguments_are_checked_once_for_every_type(paths: tuple[str, str],
                                                         tmp_path: Path) -> None:
    for dataset in (mix(paths), packed_mix(paths), batched_mix(paths)):
        with pytest.raises(ValueError, match="cache key must be a non-empty str"):
            dataset.cache(tmp_path, key="")
        with pytest.raises(ValueError, match="must be a local path"):
            dataset.cache("s3://bucket/cache", key="k")


# -- len() -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two converted corpora (their manifests list the records of every frame)."""
    root = tmp_path_factory.mktemp("converted")
    found = []
    for name, count, start in (("a", 70, 0), ("b", 45, 1000)):
        (root / f"{name}.jsonl").write_bytes(
            corpus.jsonl(corpus.make_records(count, start=start)))
        convert([str(root / f"{name}.jsonl")], root / name, shard_size=1500, frame_size=600)
        found.append(str(root / name))
    return found[0], found[1]


def converted_mix(converted: tuple[str, str], stop: str = "all", **options: Any) -> Mix:
    sources = [StreamingJsonl(path, **options) for path in converted]
    return Mix(sources, [0.5, 0.5], seed=3, stop=stop)


def test_len_of_a_mix_of_known_sources_is_every_record_once(converted: tuple[str, str]) -> None:
    assert len(converted_mix(converted)) == 70 + 45 == len(list(converted_mix(converted)))
    shares = [len(converted_mix(converted, rank=rank, world_size=2)) for rank in range(2)]
    assert shares == [len(list(converted_mix(converted, rank=rank, world_size=2)))
                      for rank in range(2)]
    assert sum(shares) == 115


@pytest.mark.parametrize("workers", [0, 2])
def test_len_of_a_loader_over_a_mix_and_its_batches_is_what_it_yields(
    converted: tuple[str, str], workers: int
) -> None:
    loader = DataLoader(converted_mix(converted), batch_size=8, num_workers=workers,
                        collate_fn=list)
    assert len(loader) == sum(1 for _ in loader)
    batches = converted_mix(converted).batch(8, collate=list)
    assert len(batches) == len(list(batches))
    loader = DataLoader(converted_mix(converted).batch(8, collate=list, drop_last=True),
                        batch_size=None, num_workers=workers, collate_fn=_same)
    assert len(loader) == sum(1 for _ in loader)


def test_len_where_the_count_is_not_known_says_why(converted: tuple[str, str],
                                                   paths: tuple[str, str]) -> None:
    with pytest.raises(TypeError, match=r"stop='first' is unknown: where its stream ends "
                                        r"depends on each epoch's draws"):
        len(converted_mix(converted, stop="first"))
    with pytest.raises(TypeError, match=r"Mix with a \.filter\(\)"):
        len(converted_mix(converted).filter(bool))
    with pytest.raises(TypeError, match="shards list no record counts"):
        len(mix(paths))  # plain JSONL sources: no manifest counts
    with pytest.raises(TypeError, match=r"packed data is unknown: .*token counts"):
        len(converted_mix(converted).pack(PackTokens(seq_len=5, eos_id=EOS)))
    with pytest.raises(TypeError, match=r"LengthBuckets or TokenBudget"):
        from streamds import LengthBuckets

        len(converted_mix(converted).batch(LengthBuckets(4, length="id")))


# -- the registry of types -----------------------------------------------------------------------


def test_batch_and_pack_build_the_types_registered_with_the_base(paths: tuple[str, str]) -> None:
    assert StreamdsDataset.of_kind("reader") is StreamingJsonl
    assert StreamdsDataset.of_kind("mix") is Mix
    assert isinstance(mix(paths).batch(2), StreamdsDataset.of_kind("batched"))
    assert StreamdsDataset.of_kind("batched") is Batched
    assert isinstance(mix(paths).pack(PackTokens(seq_len=5, eos_id=EOS)), Packed)
    with pytest.raises(LookupError, match="no dataset type 'zip'"):
        StreamdsDataset.of_kind("zip")


def _epoch(dataset: Any, epoch: int) -> list[Any]:
    dataset.set_epoch(epoch)
    return [plain(item) for item in dataset]


def _same(batch: Any) -> Any:
    return batch


# -- state and start, once in the base ----------------------------------------------------------


def reader(paths: tuple[str, str]) -> StreamingJsonl:
    return sources(paths)[0]


@pytest.mark.parametrize("make", [reader, *MAKERS], ids=["reader", *IDS])
def test_every_type_refuses_a_state_of_another_version_by_name(paths: tuple[str, str],
                                                               make: Any) -> None:
    dataset = make(paths)
    old = {**dataset.state_dict(), "format": "streamds/2"}
    with pytest.raises(Exception, match="a state from another version of streamds"):
        dataset.load_state_dict(old)
    with pytest.raises(Exception, match="a state from another version of streamds"):
        dataset.with_resume(old)


@pytest.mark.parametrize("make", [reader, *MAKERS], ids=["reader", *IDS])
def test_a_copy_or_a_pickle_leaves_the_running_iterator_behind(paths: tuple[str, str],
                                                               make: Any) -> None:
    import pickle

    dataset = make(paths)
    iterator = iter(dataset)
    next(iterator)
    fresh = make(paths).state_dict()
    assert dataset.state_dict() != fresh  # it moved
    assert pickle.loads(pickle.dumps(dataset)).state_dict() == fresh
    if make in (reader, mix):  # packed data and batches share their source with a copy
        assert dataset.map(_same).state_dict() == fresh
