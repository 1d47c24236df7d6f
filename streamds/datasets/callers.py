"""Who is calling the dataset: a framework that splits the data itself, or a DataLoader's len().

streamds splits by rank on its own. accelerate (and Hugging Face `Trainer`, which prepares its
loaders with accelerate) splits an `IterableDataset` again when it runs more than one process:

- `DataLoaderDispatcher` (``dispatch_batches=True``, accelerate's default for an iterable
  dataset): process 0 iterates its loader, concatenates one loader batch per process and
  slices the result, so only rank 0's share would ever be read; with DataLoader workers each
  worker's short last batch arrives mid-stream and the slicing drops records.
- `IterableDatasetShard` (``dispatch_batches=False``): every process iterates the dataset and
  keeps its slice of every global batch, so a second split by streamds leaves each rank a
  slice of its own share.

Both call `set_epoch` on the dataset on every process before the epoch's first batch (the
dispatcher from its `__iter__`, the shard through `DataLoaderShard.set_epoch`), which is where
streamds looks at its callers and refuses, so every rank stops at the same place. The frames
are recognised by their class and module names: accelerate is never imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

__all__ = ["DoubleSplitError", "LoaderCall", "OuterSplit", "check_outer_split", "loader_len_call",
           "outer_split"]

_DEPTH = 12  # frames looked at above the dataset's method: the frameworks call from close by
_ROUTE = ("see docs/frameworks/accelerate.md and docs/frameworks/trainer.md: "
          "streamds.integrations.transformers.StreamdsTrainer, or a loader you do not pass to "
          "accelerator.prepare() (streamds.integrations.accelerate.prepare_loader)")


class DoubleSplitError(RuntimeError):
    """A framework splits the data across processes while streamds splits it by rank too."""


@dataclass(frozen=True)
class OuterSplit:
    """How a framework splits the dataset's records across its processes."""

    kind: str  # "dispatcher" | "shard"
    num_processes: int
    num_workers: int  # the DataLoader workers of the dispatcher's loader (0 for a shard)
    drop_last: bool


def _frames(start: FrameType | None) -> list[FrameType]:
    frames = []
    while start is not None and len(frames) < _DEPTH:
        frames.append(start)
        start = start.f_back
    return frames


def _accelerate_self(frame: FrameType, name: str) -> Any:
    """The `self` of `frame` when it is an instance of accelerate's class `name`, else None."""
    obj = frame.f_locals.get("self")
    if obj is None:
        return None
    for cls in type(obj).__mro__:
        if cls.__name__ == name and cls.__module__.startswith("accelerate."):
            return obj
    return None


def _split_of(obj: Any, kind: str) -> OuterSplit | None:
    if kind == "shard":
        processes = int(getattr(obj, "num_processes", 1))
        return OuterSplit("shard", processes, 0, bool(getattr(obj, "drop_last", False)))
    state = getattr(obj, "state", None)
    processes = int(getattr(state, "num_processes", 1))
    return OuterSplit("dispatcher", processes, int(getattr(obj, "num_workers", 0) or 0),
                      bool(getattr(obj, "_drop_last", False)))


def outer_split(dataset: Any, *, depth: int = 2) -> OuterSplit | None:
    """The split accelerate applies around `dataset`, seen from the dataset's own method
    `depth` frames down the stack (or from a DataLoader worker holding a shard), else None."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is not None and info.dataset is not dataset:
        wrapper = info.dataset
        for cls in type(wrapper).__mro__:
            if cls.__name__ == "IterableDatasetShard" and cls.__module__.startswith("accelerate."):
                return _split_of(wrapper, "shard")
    for frame in _frames(sys._getframe(depth)):
        for name, kind in (("IterableDatasetShard", "shard"),
                           ("DataLoaderDispatcher", "dispatcher")):
            obj = _accelerate_self(frame, name)
            if obj is not None:
                return _split_of(obj, kind)
    return None


def check_outer_split(dataset: Any, world_size: Callable[[], int], *, depth: int = 3) -> None:
    """Refuse a second split: accelerate splits across processes and streamds splits by rank
    (`world_size()` > 1, asked only under accelerate's split), or accelerate's dispatcher
    would drop workers' short batches.

    Called from the dataset's `set_epoch` and `__iter__`; `depth`: frames from here to the
    caller of that method (3: called by the method itself).
    """
    split = outer_split(dataset, depth=depth)
    if split is None or split.num_processes <= 1:
        return
    if world_size() > 1:
        where = ("DataLoaderDispatcher, dispatch_batches=True" if split.kind == "dispatcher"
                 else "IterableDatasetShard, dispatch_batches=False")
        how = ("rank 0 reads and sends every rank a slice of its batches, so only rank 0's "
               "share would be trained" if split.kind == "dispatcher" else
               "every rank keeps its slice of every global batch of its own share")
        raise DoubleSplitError(
            f"accelerate splits this StreamingJsonl across {split.num_processes} processes "
            f"({where}) "
            f"and streamds splits it by rank too ({world_size()} ranks): {how}, and most records "
            f"would never be read (trained or evaluated). Let one of them split: streamds "
            f"(exact, each rank reads only its share) -- {_ROUTE}; or accelerate alone -- "
            "pass rank=0, world_size=1 to "
            "StreamingJsonl and dispatch_batches=False (every rank reads and parses the whole "
            "corpus; the last global batch is padded with repeated records)"
        )
    if split.kind == "dispatcher" and split.num_workers > 0 and not split.drop_last:
        raise DoubleSplitError(
            f"accelerate's DataLoaderDispatcher (dispatch_batches=True, {split.num_processes} "
            f"processes) with num_workers={split.num_workers}: each worker's last batch is "
            "short and arrives in the middle of the epoch, where the dispatcher slices the "
            "concatenated batches evenly and drops the records left over. Use "
            "dispatch_batches=False (Trainer: accelerator_config={'dispatch_batches': False}), "
            f"or num_workers=0, or let streamds split -- {_ROUTE}"
        )


@dataclass(frozen=True)
class LoaderCall:
    """The DataLoader whose `len()` asks for the dataset's length."""

    batch_size: int | None
    num_workers: int
    drop_last: bool


def loader_len_call(*, depth: int = 2) -> LoaderCall | None:
    """The torch DataLoader whose `__len__` called the dataset's `__len__`, else None."""
    from torch.utils.data import DataLoader

    for frame in _frames(sys._getframe(depth))[:3]:
        obj = frame.f_locals.get("self")
        if isinstance(obj, DataLoader) and frame.f_code.co_name == "__len__":
            return LoaderCall(obj.batch_size, obj.num_workers, bool(obj.drop_last))
    return None
