"""`streamds.Storage`: the storage settings as one value.

`StreamingJsonl(source, storage=Storage(...))` is the one spelling of how the files are
reached (fsspec options, read-ahead, the shard cache, retries, the block size); the dataset's
constructor takes no loose storage keyword.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from pathlib import Path
from typing import Any

import corpus
import pytest

import streamds
from streamds import RetryPolicy, Storage, StreamingJsonl

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("storage")
    return corpus.write_parts(root, 120, 3)


def ids(data: Any) -> list[int]:
    return [record["id"] for record in data]


def test_storage_is_exported() -> None:
    assert "Storage" in streamds.__all__ and streamds.Storage is Storage


def test_storage_settings_reach_the_dataset_without_a_warning(
    source: str, tmp_path: Path
) -> None:
    retry = RetryPolicy(give_up_after=5)
    storage = Storage(options={}, readahead="1MB", cache_dir=tmp_path / "cache",
                      cache_limit="10MB", retry=retry, block_size=1 << 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = StreamingJsonl(source, storage=storage)
    assert (data.storage, data.readahead, data.retry, data.block_size) == (
        storage, 10**6, retry, 1 << 16)
    assert data._cache is not None and data._cache.limit == 10 * 10**6
    assert sorted(ids(data)) == list(range(120))


@pytest.mark.parametrize("keyword", ["storage_options", "readahead", "cache_dir",
                                     "cache_limit", "retry", "block_size", "transform",
                                     "resume_from"])
def test_no_loose_keyword_is_taken(source: str, keyword: str) -> None:
    with pytest.raises(TypeError, match=keyword):
        StreamingJsonl(source, **{keyword: None})


@pytest.mark.parametrize(("settings", "message"), [
    ({"options": '{"anon": true}'}, r"Storage\(options=\) must be a dict, got str"),
    ({"readahead": "lots"}, "readahead: "),
    ({"readahead": -1}, "readahead must be"),
    ({"cache_dir": "s3://bucket/cache"}, "cache_dir must be a local directory"),
    ({"cache_limit": "big"}, "cache_limit: "),
    ({"retry": 3}, "retry must be a streamds.RetryPolicy or None"),
    ({"block_size": 1024}, "block_size must be an integer >= 65536"),
])
def test_storage_checks_its_settings_when_made(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Storage(**settings)


def test_storage_never_shows_option_values_and_pickles() -> None:
    storage = Storage(options={"key": "AKIAEXAMPLE", "secret": SECRET})
    assert SECRET not in repr(storage) and "AKIAEXAMPLE" not in repr(storage)
    assert "key" in repr(storage)
    assert pickle.loads(pickle.dumps(storage)) == storage
    with pytest.raises(dataclasses.FrozenInstanceError):
        storage.readahead = 0  # type: ignore[misc]


def test_a_dict_passed_as_storage_is_refused_without_its_values(source: str) -> None:
    with pytest.raises(ValueError, match=r"storage must be a streamds\.Storage") as raised:
        StreamingJsonl(source, storage={"secret": SECRET})  # type: ignore[arg-type]
    assert SECRET not in str(raised.value)

