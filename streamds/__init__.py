"""streamds: stream large JSONL corpora into PyTorch training.

``StreamingJsonl(path)`` is an IterableDataset for ``torch.utils.data.DataLoader`` that
reads JSONL (plain, .zst, .gz, .bz2, .xz) and tar shards through fsspec, splits the work
across workers and ranks, shuffles through a buffer and resumes exactly.

Names are imported on first use, so the command line and the shard writers start without
importing torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

# what the README's examples and most training scripts use, and the error classes
__all__ = [
    "CorruptRecordError",
    "CorruptShardError",
    "DoubleSplitError",
    "LengthBuckets",
    "MissingCodecError",
    "Mix",
    "PackTokens",
    "PadCollate",
    "Rebatch",
    "StateMismatchError",
    "Storage",
    "StreamingJsonl",
    "TokenBudget",
    "as_list",
    "merge_states",
]

__version__ = "0.1.0"

# name -> the module that defines it. The names outside __all__ live in those named
# sub-modules (`streamds.train.stall.StallMeter`, `streamds.resume.totals.counts_of`, ...);
# ``streamds.NAME`` still reaches them for code written against earlier releases.
_HOMES = {
    "PaddingStats": "datasets.batching",
    "padding_of": "datasets.batching",
    "LengthBuckets": "stages.buckets",
    "TokenBudget": "stages.buckets",
    "PadCollate": "train.collate",
    "as_list": "train.collate",
    "StreamingJsonl": "datasets.dataset",
    "Storage": "storage.settings",
    "RecordBatch": "stages.batch",
    "Rebatch": "stages.rebatch",
    "CorruptRecordError": "errors",
    "CorruptShardError": "errors",
    "MissingCodecError": "errors",
    "StateMismatchError": "errors",
    "DoubleSplitError": "datasets.callers",
    "DevicePrefetcher": "train.prefetch",
    "merge_states": "resume.merge",
    "counts_of": "resume.totals",
    "source_counts": "resume.totals",
    "token_counts": "resume.totals",
    "Mix": "datasets.mix",
    "PackTokens": "datasets.pack",
    "document_mask": "datasets.pack",
    "load_loader_state": "resume.loader_state",
    "RetryPolicy": "retry",
    "StallMeter": "train.stall",
    "World": "world",
    "detect_world": "world",
}


# deprecated names (one release): still importable from here, with a DeprecationWarning that
# names the `.batch(...)` spelling; not in __all__, and not cached, so every import warns
_DEPRECATED = {
    "Batches": "datasets.batching",
    "BucketBatches": "datasets.batching",
    "TokenBudgetBatches": "datasets.batching",
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        module = importlib.import_module(f".{_DEPRECATED[name]}", __name__)
        warnings.warn(module.deprecation(name), DeprecationWarning, stacklevel=2)
        return getattr(module, name)
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'streamds' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    # `NAME as NAME`: names that live in sub-modules, still reached as streamds.NAME
    from .datasets.batching import PaddingStats as PaddingStats
    from .datasets.batching import padding_of as padding_of
    from .datasets.callers import DoubleSplitError
    from .datasets.dataset import StreamingJsonl
    from .datasets.mix import Mix
    from .datasets.pack import PackTokens
    from .datasets.pack import document_mask as document_mask
    from .errors import (
        CorruptRecordError,
        CorruptShardError,
        MissingCodecError,
        StateMismatchError,
    )
    from .resume.loader_state import load_loader_state as load_loader_state
    from .resume.merge import merge_states
    from .resume.totals import counts_of as counts_of
    from .resume.totals import source_counts as source_counts
    from .resume.totals import token_counts as token_counts
    from .retry import RetryPolicy as RetryPolicy
    from .stages.batch import RecordBatch as RecordBatch
    from .stages.buckets import LengthBuckets, TokenBudget
    from .stages.rebatch import Rebatch
    from .storage.settings import Storage
    from .train.collate import PadCollate, as_list
    from .train.prefetch import DevicePrefetcher as DevicePrefetcher
    from .train.stall import StallMeter as StallMeter
    from .world import World as World
    from .world import detect_world as detect_world
