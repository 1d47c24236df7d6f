"""`Rebatch`: a loader's big batches -> training batches (see `streamds.stages.rebatch`, where
the stage lives, below the merge that asks it whether its state can be merged)."""

from __future__ import annotations

from ..stages.rebatch import Rebatch

__all__ = ["Rebatch"]
