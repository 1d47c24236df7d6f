"""Evaluation under more than one process: every eval record counted once, equal steps.

An evaluation loop gathers at every step: Trainer all-gathers each rank's loss, logits and
labels, and an all-gather needs every rank, so every rank must make as many steps (a rank that
runs out first leaves the others waiting in their next gather). accelerate evens the steps by
padding: its loaders repeat records so that every rank's batches are full, and
`gather_for_metrics` cuts the last gathered batch to ``gradient_state.remainder`` rows. That
cut is exact only for accelerate's own layout, the records of the last global batch in rank
order at the front of it; for an `IterableDataset` it has no length to compute the remainder
from (`IterableDatasetShard` reports its padded length, so nothing is cut and the repeats are
counted).

Here each rank reads its own share, which the streamds dataset already splits by rank (every
record once over the ranks), and the two rules are kept apart from the records:

- equal steps: before each step the ranks exchange how many rows their next batch holds
  (one small all-gather); while any rank has a batch, every rank makes a step, a rank that has
  run out repeating its last batch (a rank that never had one gets the first rank's first);
- exact counting: the loader knows each rank's real rows of the current step (0 for a
  repeat), and `gather_rows` gathers a step's tensors and keeps exactly those rows of every
  rank, so a repeated batch counts nowhere and a short batch counts once.

An error while a rank reads its batches is announced in the same exchange, so every rank
raises at the same step instead of waiting for the one that failed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from . import require

__all__ = ["ENDED", "FAILED", "AccelerateRanks", "EvalLoader", "Ranks", "gather_rows",
           "keep_rows", "rows_of"]

ENDED = -1  # the value a rank sends when it has no batch left
FAILED = -2  # ... when reading its next batch raised


class Ranks(Protocol):
    """The collectives the eval loader needs, called by every rank at the same point."""

    rank: int

    def sizes(self, size: int) -> list[int]:
        """Every rank's `size`, indexed by rank."""
        ...

    def batch_from(self, batch: Any, source: int) -> Any:
        """Rank `source`'s `batch`, on every rank (the others pass None)."""
        ...


class AccelerateRanks:
    """`Ranks` through an `accelerate.Accelerator` (gloo, NCCL, or one process)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.rank = accelerator.process_index

    def sizes(self, size: int) -> list[int]:
        if self.accelerator.num_processes == 1:
            return [size]
        mine = torch.tensor([size], dtype=torch.int64, device=self.accelerator.device)
        return [int(value) for value in self.accelerator.gather(mine).tolist()]

    def batch_from(self, batch: Any, source: int) -> Any:
        box = [batch]
        require("accelerate.utils").broadcast_object_list(box, from_process=source)
        return box[0]


def rows_of(batch: Any) -> int:
    """Rows of a collated batch: the first dimension of its first tensor (a dict, a mapping such
    as transformers' BatchEncoding, a list or a tuple of them; a list of records: its length).
    Gathering concatenates along this dimension, so these are what counts."""
    if isinstance(batch, torch.Tensor):
        if batch.ndim == 0:
            raise ValueError("a 0-dimensional tensor as a batch has no rows to count")
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        values: list[Any] = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        values = []
    for value in values:
        if isinstance(value, (torch.Tensor, Mapping, list, tuple)):
            try:
                return rows_of(value)
            except ValueError:
                continue
    if isinstance(batch, list):
        return len(batch)
    raise ValueError(
        f"cannot count the rows of an eval batch of type {type(batch).__name__}: the collate "
        "must return tensors (or a dict, list or tuple holding them) whose first dimension is "
        "the batch")


@dataclass
class _Ahead:
    """The next batch of this rank: `size` rows, ENDED or FAILED (then `error`)."""

    batch: Any = None
    size: int = ENDED
    error: BaseException | None = None


def _fetch(source: Iterator[Any]) -> _Ahead:
    try:
        batch = next(source)
    except StopIteration:
        return _Ahead()
    except Exception as err:  # announced to every rank before it is raised here
        return _Ahead(size=FAILED, error=err)
    try:
        return _Ahead(batch, rows_of(batch))
    except ValueError as err:
        return _Ahead(size=FAILED, error=err)


class EvalLoader(DataLoader):
    """A DataLoader over a rank-aware eval dataset that makes as many steps on every rank.

    Yields this rank's batches, then (while another rank still has some) repeats of its last
    one. `rows` holds, during each step, the real rows of that step on every rank (0 for a
    repeat), which `gather_rows` keeps; `rows_kept` the real rows of every rank in the steps
    so far (an evaluation's samples, the same on every rank); `steps` the steps so far (the
    same on every rank: the batches of the rank with the most); `end_of_dataloader` is True
    during the last step (what accelerate's `GradientState` reads). Not meant for
    accelerator.prepare: the dataset splits by rank itself.
    """

    def __init__(self, dataset: Any, *, ranks: Ranks, **options: Any) -> None:
        super().__init__(dataset, **options)
        self.ranks = ranks
        self.rows: list[int] = []
        self.rows_kept = 0
        self.steps = 0
        self.end_of_dataloader = False
        self.remainder = -1  # accelerate's gather_for_metrics: cut nothing (gather_rows cuts)

    def _agree(self, ahead: _Ahead) -> list[int]:
        sizes = self.ranks.sizes(ahead.size)
        failed = [rank for rank, size in enumerate(sizes) if size == FAILED]
        if not failed:
            return sizes
        if ahead.error is not None:
            raise ahead.error
        raise RuntimeError(
            f"rank(s) {failed} failed while reading their eval batches (the error is in "
            f"their output); rank {self.ranks.rank} stops at the same step instead of waiting "
            "for them in the next gather")

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader = False
        self.rows_kept = 0
        self.steps = 0
        source = super().__iter__()
        ahead = _fetch(source)
        sizes = self._agree(ahead)
        repeat = None  # what this rank yields once it has run out: its last batch
        if ENDED in sizes and any(size > 0 for size in sizes):
            # a rank without a single eval record still makes the steps: it repeats the
            # first batch of the first rank that has one (every rank takes part in the send)
            first = next(rank for rank, size in enumerate(sizes) if size > 0)
            shared = self.ranks.batch_from(ahead.batch if self.ranks.rank == first else None,
                                           first)
            if ahead.size == ENDED:
                repeat = shared
        while any(size > 0 for size in sizes):
            if ahead.size > 0:
                batch = repeat = ahead.batch
                ahead = _fetch(source)
            else:
                batch = repeat
            self.rows = [max(size, 0) for size in sizes]
            self.rows_kept += sum(self.rows)
            self.steps += 1
            sizes = self._agree(ahead)
            self.end_of_dataloader = not any(size > 0 for size in sizes)
            yield batch
        self.rows = []


def keep_rows(gathered: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Of a tensor gathered from len(rows) ranks, each padded to the same number of rows
    (rank-major), the first rows[k] rows of rank k's part."""
    if gathered.ndim == 0:
        return gathered
    ranks = len(rows)
    if gathered.shape[0] % ranks:
        raise ValueError(f"a gathered tensor of {gathered.shape[0]} rows does not split into "
                         f"{ranks} ranks' equal parts")
    each = gathered.shape[0] // ranks
    return torch.cat([gathered[rank * each: rank * each + rows[rank]] for rank in range(ranks)])


def gather_rows(accelerator: Any, loader: EvalLoader, data: Any) -> Any:
    """Trainer's `gather_function` for an `EvalLoader`: the step's tensors (nested) of every
    rank, padded to equal rows, gathered, and cut to each rank's real rows."""
    recursively_apply = require("accelerate.utils").recursively_apply
    rows = loader.rows
    gathered = accelerator.gather(accelerator.pad_across_processes(data, dim=0))
    return recursively_apply(lambda tensor: keep_rows(tensor, rows), gathered)
