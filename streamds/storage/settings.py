"""`Storage`: how a dataset reaches its files, one value beside the order and world settings.

    ds = StreamingJsonl("s3://bucket/train/", storage=streamds.Storage(
        options={"anon": True}, readahead="64MB", cache_dir="/content/cache",
        cache_limit="40GB", retry=streamds.RetryPolicy(give_up_after=600)))

Checked when it is made, each message naming the setting, the value and the fix. Its repr
shows the names of the fsspec options, never their values: they may hold keys.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..checks import check_int, size_setting
from ..retry import RetryPolicy
from .cache import CacheSpec, namespace_of
from .plan import DEFAULT_BLOCK_SIZE, MIN_BLOCK_SIZE
from .shards import Shard

__all__ = ["Storage", "storage_of"]


@dataclass(frozen=True, repr=False)
class Storage:
    """fsspec `options` (credentials, endpoint), `readahead` ("auto": on for remote and
    mounted shards; bytes in flight such as "64MB"; 0/None: off), a local `cache_dir` with its
    `cache_limit` in bytes (or "40GB"; None: as much as the disk holds), the `retry` policy of
    failing reads (None: `RetryPolicy()`), and the `block_size` the corpus is cut into (at
    least 64 KiB; it is part of a resume state's identity)."""

    options: dict[str, Any] | None = None
    readahead: int | str | None = "auto"
    cache_dir: str | os.PathLike | None = None
    cache_limit: int | str | None = None
    retry: RetryPolicy | None = None
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.options is not None and not isinstance(self.options, dict):
            raise ValueError(  # its value is not shown: it may hold keys
                f"Storage(options=) must be a dict, got {type(self.options).__name__}; pass "
                "e.g. {'anon': True} (parse a JSON string with json.loads first)")
        if self.readahead != "auto":
            size_setting("readahead", self.readahead,
                         "'auto' (the default) or 0/None to turn it off")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, (str, os.PathLike))
                                           or "://" in os.fspath(self.cache_dir)):
            raise ValueError(
                f"cache_dir must be a local directory, got {self.cache_dir!r}; on Colab use the "
                "runtime's own disk, e.g. cache_dir='/content/cache'"
            )
        size_setting("cache_limit", self.cache_limit, "None: as much as the disk holds")
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise ValueError(
                f"retry must be a streamds.RetryPolicy or None, got {self.retry!r}; e.g. "
                "RetryPolicy(give_up_after=600) to retry a failing read for 10 minutes"
            )
        check_int("block_size", self.block_size, MIN_BLOCK_SIZE, "blocks are at least 64 KiB")
        if self.options is not None:  # a copy: changing the caller's dict later changes nothing
            object.__setattr__(self, "options", dict(self.options))

    def __repr__(self) -> str:
        options = None if self.options is None else f"<{', '.join(sorted(map(str, self.options)))}>"
        return (f"Storage(options={options}, readahead={self.readahead!r}, "
                f"cache_dir={self.cache_dir!r}, cache_limit={self.cache_limit!r}, "
                f"retry={self.retry!r}, block_size={self.block_size})")

    @property
    def ahead_bytes(self) -> int | None:
        """Read-ahead in bytes, or None for "auto" (decided by where the shards are)."""
        if self.readahead == "auto":
            return None
        return size_setting("readahead", self.readahead, "")

    @property
    def cache_limit_bytes(self) -> int | None:
        """The cache's limit in bytes; None: no limit."""
        return size_setting("cache_limit", self.cache_limit, "") or None

    def cache_of(self, shards: Sequence[Shard]) -> CacheSpec | None:
        """The cache of `shards` under `cache_dir`; None: no cache."""
        if self.cache_dir is None:
            return None
        directory = os.path.abspath(os.fspath(self.cache_dir))
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"cache_dir {directory!r} is a file; pass a directory")
        return CacheSpec(directory, self.cache_limit_bytes, namespace_of(shards))


def storage_of(storage: Storage | None) -> Storage:
    """The storage settings of a `StreamingJsonl`: `storage`, or the defaults for None."""
    if storage is None:
        return Storage()
    if not isinstance(storage, Storage):
        raise ValueError(  # its value is not shown: a dict may hold keys
            f"storage must be a streamds.Storage or None, got {type(storage).__name__}; pass "
            "e.g. storage=streamds.Storage(options={'anon': True})")
    return storage
