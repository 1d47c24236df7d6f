"""Batching of a `Mix` or packed data: records -> whole batches, cut pool by pool.

`Batched` is what ``Mix.batch(...)`` and ``Packed.batch(...)`` return: the same
``.batch(n | LengthBuckets | TokenBudget, collate=..., drop_last=...)`` as
``StreamingJsonl.batch``, applied by a pool batcher around the dataset (a reader batches
inside its workers instead, as one stage of its pipeline).

It reads its source in pools of records (a buffer like the shuffle buffer), cuts each pool
into batches and yields them, for ``DataLoader(batched, batch_size=None)``. The cutting
rules are `streamds.LengthBuckets` (sort each pool by length, cut batches of n, shuffle their
order from the seed) and `streamds.TokenBudget` (as many records as fit in a budget of
padded tokens; a record longer than the budget comes alone). Every record of the source
lands in exactly one batch (`drop_last` drops the short batch at the end). Order depends on
(seed, epoch, rank, worker) only. `padding_of` measures the padding of batches.

State (for torchdata's StatefulDataLoader): the source's state where the current pool began,
the pool's number and how many of its batches were yielded: a few integers plus the source's
own state, never records. Resuming re-reads that pool and skips the batches already yielded.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..checks import check_bool, check_int
from ..seeds import derive_seed
from ..stages.batch import RecordBatch
from ..stages.buckets import RULES, Length, Rule, as_length
from ..stages.pools import PoolStage
from ..stages.state import check_epoch_change, check_state, sealed
from ..stages.transform import Step, apply_steps
from ..world import detect_world
from .base import StreamdsDataset

__all__ = ["Batched", "PaddingStats", "padding_of"]


@dataclass
class PaddingStats:
    """Real tokens vs padded tokens (longest x batch size) over the batches seen."""

    batches: int = 0
    records: int = 0
    real: int = 0  # tokens of the records themselves
    padded: int = 0  # tokens after padding every batch to its longest record

    def add(self, lengths: Sequence[int]) -> None:
        """Count one batch whose records have `lengths`."""
        if not lengths:
            return
        self.batches += 1
        self.records += len(lengths)
        self.real += sum(lengths)
        self.padded += max(lengths) * len(lengths)

    def __add__(self, other: PaddingStats) -> PaddingStats:
        return PaddingStats(
            self.batches + other.batches,
            self.records + other.records,
            self.real + other.real,
            self.padded + other.padded,
        )

    @property
    def pad_tokens(self) -> int:
        return self.padded - self.real

    @property
    def pad_fraction(self) -> float:
        """Share of the padded tensor that is padding (0.0 when nothing was counted)."""
        return self.pad_tokens / self.padded if self.padded else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pad_tokens": self.pad_tokens, "pad_fraction": self.pad_fraction}


def padding_of(batches: Iterable[Sequence[Any]], length: Length | str) -> PaddingStats:
    """The padding statistics of `batches` (lists of records) under `length`."""
    measure = as_length(length)
    stats = PaddingStats()
    for batch in batches:
        stats.add([measure(record) for record in batch])
    return stats


def _no_length(record: Any) -> int:
    """Fixed-size batches are cut by count: no record needs measuring."""
    return 0


def _seed_of(source: Any) -> int:
    """The seed of `source` or of the dataset it wraps (a packed dataset has none itself)."""
    while source is not None:
        seed = getattr(source, "seed", None)
        if isinstance(seed, int):
            return seed
        source = getattr(source, "source", None)
    return 0


class Batched(StreamdsDataset):
    """Whole batches of a `Mix` or a packed dataset: what their ``.batch(...)`` returns.

    `size` is the number of records per batch (`drop_last` drops the short last one) or a
    `streamds.LengthBuckets` / `streamds.TokenBudget` rule, as in ``StreamingJsonl.batch``;
    `collate` turns each list of records into the batch (None: a `streamds.RecordBatch`).
    Use it with ``DataLoader(batched, batch_size=None)``. The epoch is the source's; the
    state is the pool batcher's (`streamds.stages.pools.PoolStage`: the source's state where
    the current pool began, the pool's number, its batches yielded), so a state taken after
    any batch resumes exactly. `.map` / `.filter` apply to whole batches (a state between
    them stays exact: a batch a filter drops was counted before the next one is handed out);
    `.batch` batches the batches; `.pack` is refused.
    """

    KIND = "batched"

    def __init__(
        self, source: Any, size: int | Rule, *,
        collate: Callable[[list[Any]], Any] | None = None, drop_last: bool = False,
    ) -> None:
        super().__init__()
        if collate is not None and not callable(collate):
            raise ValueError(f"collate must be callable or None, got {collate!r}")
        check_bool("drop_last", drop_last)
        if isinstance(size, RULES):
            if drop_last:
                raise ValueError(
                    f"drop_last=True with {size!r}: pass drop_last to LengthBuckets instead "
                    "(a token budget drops nothing)"
                )
            self.rule: Rule | None = size
            length, pool_size = size.length, size.pool_size
        else:
            check_int("size", size, 1, "the number of records per batch, or a "
                      "streamds.LengthBuckets / TokenBudget rule")
            self.rule = None
            length, pool_size = _no_length, size
        self.source = source
        self.size = size
        self.length = as_length(length)
        self.pool_size = pool_size
        self.seed = _seed_of(source)
        self.drop_last = drop_last
        self.collate = RecordBatch if collate is None else collate
        self._steps: tuple[Step, ...] = ()  # map and filter of whole batches (.map/.filter)
        self._pending: PoolStage | None = None  # a loaded state, for the next iterator
        self._active: PoolStage | None = None
        self._stats = PaddingStats()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_active"] = None  # a live iterator stays in the process that made it
        return state

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (for the batch order and the source's own order).

        A loaded state in the middle of another epoch refuses: finish that epoch first.
        """
        check_int("epoch", epoch, 0, "epochs count from 0")
        check_epoch_change(self._pending, epoch)
        self.source.set_epoch(epoch)

    @property
    def stats(self) -> PaddingStats:
        """Padding of the batches this process's current iterator yielded so far."""
        return PaddingStats() if self._active is None else self._stats

    def _pool_rng(self, epoch: int, pool: int) -> random.Random:
        world = detect_world(self.rank, self.world_size)
        return random.Random(
            derive_seed("batches", self.seed, epoch, world.rank, world.worker, pool)
        )

    def _stage(self, epoch: int) -> PoolStage:
        return PoolStage(self.source, config=self._config(), pool_size=self.pool_size,
                         measure=self.length, cut=self._cut, rng=self._pool_rng,
                         collate=self.collate, epoch=epoch, on_batch=self._count)

    def _count(self, lengths: list[int]) -> None:
        self._stats.add(lengths)

    def __iter__(self) -> Iterator[Any]:
        resume, self._pending = self._pending, None
        if resume is not None and resume.finished and resume.epoch != self.epoch:
            resume = None  # that epoch is over and another was chosen: start it afresh
        self._stats = PaddingStats()
        self._active = resume if resume is not None else self._stage(self.epoch)
        # -> batches cut pool by pool (`streamds.stages.pools`)
        batches = iter(self._active)
        # -> its own map and filter, on whole batches
        return apply_steps(batches, self._steps, "these batches") if self._steps else batches

    def _with_step(self, step: Step) -> Batched:
        clone = copy.copy(self)
        clone._steps = (*self._steps, step)
        clone._active = clone._pending = None
        return clone

    def batch(
        self, size: int | Rule, *, collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> Batched:
        """These batches in batches of batches (`size` of them, or a rule)."""
        return Batched(self, size, collate=collate, drop_last=drop_last)

    def pack(self, packer: Any) -> Any:
        """Refused: a batch is no document; pack before batching."""
        raise ValueError(
            f"pack({packer!r}): these are whole batches, not tokenized documents; pack before "
            "batching: dataset.pack(PackTokens(...)).batch(n)"
        )

    def __repr__(self) -> str:
        return f"{self.source!r}.batch({self.size!r}, drop_last={self.drop_last})"

    # the epoch is the source's, so that set_epoch on either one moves both
    @property  # type: ignore[override]
    def epoch(self) -> int:
        return self.source.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if value != self.source.epoch:
            self.source.set_epoch(value)

    @property
    def rank(self) -> int | None:
        return self.source.rank

    @property
    def world_size(self) -> int | None:
        return self.source.world_size

    def _config(self) -> list[Any]:
        cut = ["size", self.size] if self.rule is None else self.rule.config()
        return [self.KIND, self.pool_size, self.seed, self.drop_last, cut]

    def _cut(self, lengths: list[int], rng: random.Random) -> list[list[int]]:
        if self.rule is not None:
            return self.rule.cut(lengths, rng)
        if self.drop_last and len(lengths) < self.pool_size:
            return []
        return [list(range(len(lengths)))]

    def resume_after_batches(self, consumed: int, **loader: Any) -> Batched:
        """Refused: a plain DataLoader's batch count does not tell where the pools of the
        readers stood; resume through `state_dict()` (torchdata's StatefulDataLoader)."""
        raise ValueError(
            f"resume_after_batches({consumed}): the batches of a Mix or packed dataset "
            "cannot be resumed from a plain DataLoader's batch count; use torchdata's "
            "StatefulDataLoader and checkpoint loader.state_dict() (a state taken after any "
            "batch resumes exactly)"
        )

    def with_resume(self, merged: dict[str, Any]) -> Batched:
        """The same batches of ``source.with_resume(merged)`` (`streamds.merge_states` of the
        states of every reader): a fresh pool batcher over the resumed source."""
        clone = Batched(self.source.with_resume(merged), self.size,
                        collate=self.collate, drop_last=self.drop_last)
        clone._steps = self._steps
        return clone

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Position of this process's iterator: O(1) integers plus the source's state."""
        stage = self._active or self._pending or self._stage(self.epoch)
        return sealed(stage.get_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` at the next `iter()`; refuses a state of another batcher."""
        check_state(state, PoolStage.STAGE, PoolStage.KEYS, "batcher")
        PoolStage.check(state, self._config())
        stage = self._stage(self.epoch)
        stage.reset(state)
        self._active = None
        self._pending = stage
        if not stage.finished:  # a finished state leaves the epoch to set_epoch
            self.epoch = stage.epoch
