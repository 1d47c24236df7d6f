"""PyTorch Lightning: set_epoch every epoch, and every rank's exact loader state in checkpoints.

What Lightning 2.6 does with an `IterableDataset`, and what this module does about it:

- it never calls `set_epoch` on the dataset (only on samplers): `StreamdsCallback` calls it at
  every epoch start, so each epoch has its own order;
- its fetcher fetches one batch ahead of the one being trained when the loader has no len(),
  so a loader state taken for a checkpoint already counts a batch that was never trained:
  `StreamdsLoader` keeps the state after each batch it hands out, and its `state_dict()` is
  the state after the last batch trained (the callback counts them);
- it warns that an `IterableDataset`'s `__len__` "could be inaccurate" with workers; a
  streamds loader's length is exact for every rank and worker (or it has none), so the
  callback silences that one warning while Lightning sets up the loaders, and nothing else;
- under DDP the checkpoint holds rank 0's loader state only, loaded into every rank:
  `StreamdsLoader.state_dict()` gathers every rank's state (`streamds.integrations.loader`),
  and `load_state_dict` gives each rank its own, or, when the world changed, finishes the
  epoch from `streamds.merge_states` of them (elastic resume).

Example::

    loader = StreamdsLoader(StreamingJsonl("shards/", shuffle=True), batch_size=32,
                            num_workers=2, collate_fn=collate)
    trainer = lightning.Trainer(callbacks=[StreamdsCallback()], ...)
    trainer.fit(model, train_dataloaders=loader)   # resume: ckpt_path=...
"""

from __future__ import annotations

import warnings
from typing import Any

from . import require
from .loader import StreamdsLoader

_pl = require("lightning.pytorch")

__all__ = ["StreamdsCallback", "StreamdsLoader"]

# Lightning's warning for any IterableDataset with a len(), while it sets up the loaders
_LEN_WARNING = r"Your `IterableDataset` has `__len__` defined"


class StreamdsCallback(_pl.Callback):
    """Calls `set_epoch` on the train dataset at every epoch start and counts the batches
    trained for `StreamdsLoader` (so a checkpoint never counts the prefetched batch).
    A StreamdsLoader iterated by a Trainer without it refuses to start."""

    counts_streamds_batches = True  # what StreamdsLoader looks for (loader.COUNTS_BATCHES)

    def __init__(self) -> None:
        self._setting_up: warnings.catch_warnings | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # the fit loop sets up its loaders (and checks their len()) between these two hooks
        self._setting_up = warnings.catch_warnings()
        self._setting_up.__enter__()
        warnings.filterwarnings("ignore", message=_LEN_WARNING)

    def _set_up(self) -> None:
        if self._setting_up is not None:
            self._setting_up.__exit__(None, None, None)
            self._setting_up = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._set_up()

    def _loaders(self, trainer: Any) -> list[Any]:
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        return [] if combined is None else list(combined.flattened)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._set_up()
        # from here on the callback counts (also in a run resumed in the middle of an epoch,
        # where on_train_epoch_start is not called); the fetcher may already hold a batch
        for loader in self._loaders(trainer):
            if isinstance(loader, StreamdsLoader) and loader.trained is None:
                loader.trained = 0
        # a run restored from a checkpoint taken at an epoch's end starts the next epoch
        # without on_train_epoch_start; a mid-epoch state already set the dataset's epoch
        self._set_epoch(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._set_epoch(trainer)

    def _set_epoch(self, trainer: Any) -> None:
        for loader in self._loaders(trainer):
            dataset = getattr(loader, "dataset", None)
            if hasattr(dataset, "set_epoch") and dataset.epoch != trainer.current_epoch:
                dataset.set_epoch(trainer.current_epoch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for loader in self._loaders(trainer):
            if isinstance(loader, StreamdsLoader) and loader.trained is not None:
                loader.trained += 1
