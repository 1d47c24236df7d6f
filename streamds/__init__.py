"""streamds: stream large JSONL corpora into PyTorch training.

``StreamingJsonl(path)`` is an IterableDataset for ``torch.utils.data.DataLoader`` that
reads JSONL (plain, .zst, .gz, .bz2, .xz) and tar shards through fsspec, splits the work
across workers and ranks, shuffles through a buffer and resumes exactly.
"""

from .batching import Batches, BucketBatches, PaddingStats, TokenBudgetBatches, padding_of
from .collate import PadCollate, as_list
from .dataset import StreamingJsonl
from .errors import CorruptRecordError, CorruptShardError, MissingCodecError, StateMismatchError
from .prefetch import DevicePrefetcher
from .resume import merge_states
from .retry import RetryPolicy
from .stall import StallMeter
from .world import World, detect_world

__all__ = [
    "Batches",
    "BucketBatches",
    "CorruptRecordError",
    "CorruptShardError",
    "DevicePrefetcher",
    "MissingCodecError",
    "PadCollate",
    "PaddingStats",
    "RetryPolicy",
    "StallMeter",
    "StateMismatchError",
    "StreamingJsonl",
    "TokenBudgetBatches",
    "World",
    "as_list",
    "detect_world",
    "merge_states",
    "padding_of",
]

__version__ = "0.1.0"
