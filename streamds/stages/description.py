"""`ReaderDescription`: what every reader of one dataset shares (a picklable value).

The shards, their blocks and plan, the map/filter steps, the options and the caches: the
dataset builds it once, each reader (`streamds.stages.pipeline.Reader`) builds its stages
from it and a `ReaderState`. It sits below the pipeline so that the stages the pipeline
builds can name it without importing the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..retry import DEFAULT_RETRY, RetryPolicy
from ..storage.plan import Block, Plan
from ..storage.read import Opener, open_decoded_at
from ..storage.shard_cache import ShardCacheSettings
from ..storage.shards import Shard
from .batch import BatchSettings
from .record_cache import RecordsCache
from .transform import Step

__all__ = ["ReaderDescription"]


@dataclass(frozen=True)
class ReaderDescription:
    """What every reader of one dataset shares."""

    shards: Sequence[Shard]
    blocks: Sequence[Block]
    plan: Plan
    steps: tuple[Step, ...]
    on_error: str
    buffer_size: int
    retry: RetryPolicy = DEFAULT_RETRY
    opener: Opener = open_decoded_at
    batch: BatchSettings | None = None  # whole batches out of the reader (`StreamingJsonl.batch`)
    readahead: int = 0  # stored bytes fetched ahead of each reader (0: none)
    cache: ShardCacheSettings | None = None  # the local copy of remote or mounted shards
    worker_cpus: str = "auto"  # workers leave the main process a CPU (streamds.stages.cpus); "all"
    records_cache: RecordsCache | None = None  # `ds.cache`: stored records of the first steps
    even_ranks: str | None = None  # "drop" | "pad" | None (`streamds.stages.balance`)
