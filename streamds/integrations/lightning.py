"""PyTorch Lightning: set_epoch every epoch, and every rank's exact loader state in checkpoints.

What Lightning 2.6 does with an `IterableDataset`, and what this module does about it:

- it never calls `set_epoch` on the dataset (only on samplers): `StreamdsCallback` calls it at
  every epoch start, so each epoch has its own order;
- its fetcher fetches one batch ahead of the one being trained, so a loader state taken for a
  checkpoint already counts a batch that was never trained: `StreamdsLoader` keeps the state
  after each batch it hands out, and its `state_dict()` is the state after the last batch
  trained (the callback counts them);
- under DDP the checkpoint holds rank 0's loader state only, loaded into every rank:
  `StreamdsLoader.state_dict()` gathers every rank's state (it runs on every rank while a
  checkpoint is written), and `load_state_dict` gives each rank its own, or, when the world
  changed, finishes the epoch from `streamds.merge_states` of them (elastic resume).

Example::

    loader = StreamdsLoader(StreamingJsonl("shards/", shuffle=True), batch_size=32,
                            num_workers=2, collate_fn=collate)
    trainer = lightning.Trainer(callbacks=[StreamdsCallback()], ...)
    trainer.fit(model, train_dataloaders=loader)   # resume: ckpt_path=...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from . import require

_pl = require("lightning.pytorch")
_stateful = require("torchdata.stateful_dataloader")

__all__ = ["StreamdsCallback", "StreamdsLoader"]

RANKS = "streamds_ranks"  # key of the gathered states: one loader state per rank, by rank


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class StreamdsLoader(_stateful.StatefulDataLoader):
    """A torchdata `StatefulDataLoader` whose state is that of the last batch trained, from
    every rank. Use it with `StreamdsCallback`, which counts the batches trained."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._after: dict[int, dict[str, Any]] = {}  # batches handed out -> state after them
        self._handed = 0
        self.trained = 0  # batches of the current iterator trained (set by StreamdsCallback)

    def __iter__(self) -> Iterator[Any]:
        iterator = super().__iter__()
        self._handed = self.trained = 0
        self._after = {0: super().state_dict()}
        return self._keep_states(iterator)

    def _keep_states(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            self._handed += 1
            self._after[self._handed] = super().state_dict()
            for old in [n for n in self._after if n < self.trained]:
                del self._after[old]  # only the batches ahead of training are kept
            yield batch

    def own_state_dict(self) -> dict[str, Any]:
        """This rank's state after the last batch trained."""
        if not self._after:
            return super().state_dict()
        return self._after[min(self.trained, self._handed)]

    def state_dict(self) -> dict[str, Any]:
        """Every rank's `own_state_dict()`, gathered (a collective call under DDP)."""
        import torch.distributed as dist

        own = self.own_state_dict()
        _, size = _world()
        states: list[Any] = [None] * size
        if size > 1:
            dist.all_gather_object(states, own)
        else:
            states[0] = own
        return {RANKS: states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's own state when the world is the same, else the merged states of all
        ranks (the dataset then finishes their epoch under this world)."""
        from ..resume.merge import merge_states

        states = state_dict[RANKS]
        rank, size = _world()
        if len(states) == size:
            super().load_state_dict(states[rank])
            return
        merged = merge_states(states)
        resumed = self.dataset.with_resume(merged)
        vars(self.dataset).update(vars(resumed))  # the loader keeps its dataset object


class StreamdsCallback(_pl.Callback):
    """Calls `set_epoch` on the train dataset at every epoch start and counts the batches
    trained for `StreamdsLoader` (so a checkpoint never counts the prefetched batch)."""

    def _loaders(self, trainer: Any) -> list[Any]:
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        return [] if combined is None else list(combined.flattened)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        for loader in self._loaders(trainer):
            dataset = getattr(loader, "dataset", None)
            if hasattr(dataset, "set_epoch") and dataset.epoch != trainer.current_epoch:
                dataset.set_epoch(trainer.current_epoch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for loader in self._loaders(trainer):
            if isinstance(loader, StreamdsLoader):
                loader.trained += 1
