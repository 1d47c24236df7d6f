"""`Rebatch`: a loader's big batches -> training batches (see `streamds.stages.rebatch`, where
the stage lives, below the merge that reads its state), told which of a torchdata
StatefulDataLoader's workers made each big batch, so that its state merges at any training
batch (`streamds.merge_states`)."""

from __future__ import annotations

from typing import Any

from ..stages import rebatch
from .loader_state import worker_of_last_batch

__all__ = ["Rebatch"]


class Rebatch(rebatch.Rebatch):
    __doc__ = rebatch.Rebatch.__doc__

    def made_by(self, loader_state: Any) -> int | None:
        """The worker that made the big batch yielded last (torchdata's state says it)."""
        return worker_of_last_batch(loader_state)
