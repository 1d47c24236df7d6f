"""streamds: stream large JSONL corpora into PyTorch training.

``StreamingJsonl(path)`` is an IterableDataset for ``torch.utils.data.DataLoader`` that
reads JSONL (plain, .zst, .gz, .bz2, .xz) and tar shards through fsspec, splits the work
across workers and ranks, shuffles through a buffer and resumes exactly.
"""

from .dataset import StreamingJsonl
from .errors import CorruptRecordError, CorruptShardError, MissingCodecError, StateMismatchError
from .resume import merge_states
from .world import World, detect_world

__all__ = [
    "CorruptRecordError",
    "CorruptShardError",
    "MissingCodecError",
    "StateMismatchError",
    "StreamingJsonl",
    "World",
    "detect_world",
    "merge_states",
]

__version__ = "0.1.0"
