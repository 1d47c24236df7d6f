"""streamds: stream large JSONL corpora into PyTorch training.

``StreamingJsonl(path)`` is an IterableDataset for ``torch.utils.data.DataLoader`` that
reads JSONL (plain, .zst, .gz, .bz2, .xz) and tar shards through fsspec, splits the work
across workers and ranks, shuffles through a buffer and resumes exactly.

Every name a training script needs is here, as ``streamds.NAME`` (the framework
integrations, which import their framework, are in ``streamds.integrations``). Names are
imported on first use, so the command line and the shard writers start without importing
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CorruptRecordError",
    "CorruptShardError",
    "DevicePrefetcher",
    "DoubleSplitError",
    "LengthBuckets",
    "MissingCodecError",
    "Mix",
    "PackTokens",
    "PadCollate",
    "PaddingStats",
    "Rebatch",
    "RecordBatch",
    "RetryPolicy",
    "StallMeter",
    "StateMismatchError",
    "Storage",
    "StreamingJsonl",
    "TokenBudget",
    "World",
    "as_list",
    "counts_of",
    "cpu_quota",
    "detect_world",
    "document_mask",
    "merge_states",
    "padding_of",
    "source_counts",
    "stateful_loader",
    "token_counts",
]

__version__ = "0.1.0"

# name -> the module that defines it (one entry for each name of __all__)
_HOMES = {
    "CorruptRecordError": "errors",
    "CorruptShardError": "errors",
    "DevicePrefetcher": "train.prefetch",
    "DoubleSplitError": "datasets.callers",
    "LengthBuckets": "stages.buckets",
    "MissingCodecError": "errors",
    "Mix": "datasets.mix",
    "PackTokens": "datasets.pack",
    "PadCollate": "train.collate",
    "PaddingStats": "datasets.batching",
    "Rebatch": "train.rebatch",
    "RecordBatch": "stages.batch",
    "RetryPolicy": "retry",
    "StallMeter": "train.stall",
    "StateMismatchError": "errors",
    "Storage": "storage.settings",
    "StreamingJsonl": "datasets.dataset",
    "TokenBudget": "stages.buckets",
    "World": "world",
    "as_list": "train.collate",
    "counts_of": "train.loader_state",
    "cpu_quota": "stages.cpus",
    "detect_world": "world",
    "document_mask": "datasets.pack",
    "merge_states": "train.loader_state",
    "padding_of": "datasets.batching",
    "source_counts": "resume.totals",
    "stateful_loader": "train.loader",
    "token_counts": "resume.totals",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'streamds' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .datasets.batching import PaddingStats, padding_of
    from .datasets.callers import DoubleSplitError
    from .datasets.dataset import StreamingJsonl
    from .datasets.mix import Mix
    from .datasets.pack import PackTokens, document_mask
    from .errors import (
        CorruptRecordError,
        CorruptShardError,
        MissingCodecError,
        StateMismatchError,
    )
    from .resume.totals import source_counts, token_counts
    from .retry import RetryPolicy
    from .stages.batch import RecordBatch
    from .stages.buckets import LengthBuckets, TokenBudget
    from .stages.cpus import cpu_quota
    from .storage.settings import Storage
    from .train.collate import PadCollate, as_list
    from .train.loader import stateful_loader
    from .train.loader_state import counts_of, merge_states
    from .train.prefetch import DevicePrefetcher
    from .train.rebatch import Rebatch
    from .train.stall import StallMeter
    from .world import World, detect_world
