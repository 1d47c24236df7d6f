"""accelerate: a loader that streamds alone splits, checkpointed with `Accelerator.save_state`.

`Accelerator.prepare(DataLoader(streamds dataset))` splits the data a second time when more
than one process runs (streamds refuses with `DoubleSplitError`). `prepare_loader` builds the
loader instead: prepare the model and optimizer with accelerate, not this loader. Each rank
reads only its share; `accelerator.save_state` stores every rank's loader state (gathered by
`StreamdsLoader.state_dict`) and `accelerator.load_state` gives each rank its own.

Example::

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = prepare_loader(StreamingJsonl("shards/", even_ranks="drop"), accelerator,
                            batch_size=32, num_workers=2, collate_fn=collate)
    for batch in loader:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        ...
"""

from __future__ import annotations

from typing import Any

from . import require
from .loader import StreamdsLoader

require("accelerate")

__all__ = ["StreamdsLoader", "prepare_loader"]


def prepare_loader(dataset: Any, accelerator: Any, **options: Any) -> StreamdsLoader:
    """A `StreamdsLoader` over `dataset` (DataLoader `options`), registered with
    `accelerator.register_for_checkpointing`. Call it once, at the same point on every rank
    (checkpoints match registered objects by order)."""
    loader = StreamdsLoader(dataset, **options)
    accelerator.register_for_checkpointing(loader)
    return loader
