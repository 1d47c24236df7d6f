"""`StreamdsDataset`: the methods every dataset type offers, one definition each.

A reader (`StreamingJsonl`), a mix (`Mix`) and packed data (`Packed`) are all thin,
picklable descriptions that build their stages in each reader, and all offer the same
methods: `map`, `filter`, `batch`, `pack`, `loader` (the one-call loader,
`streamds.train.loader`), `set_epoch`, `state_dict`, `load_state_dict`, `with_resume`.
`map` and `filter` add a step (`_with_step`, each type's own copy rule); `batch` and `pack`
are each type's own: a mix and packed data batch with a pool batcher
(`streamds.datasets.batching.Batched`, itself a dataset of this kind), a reader inside its
workers; packed data refuses `pack`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

from torch.utils.data import IterableDataset

from ..stages.transform import BatchedMap, Step
from ..train.loader import Loader

if TYPE_CHECKING:
    from ..stages.buckets import Rule
    from ..stages.packing import PackTokens
    from .pack import Packed

__all__ = ["METHODS", "StreamdsDataset"]

# what every dataset type offers (a test holds each type to it)
METHODS = ("map", "filter", "batch", "pack", "loader", "set_epoch", "state_dict",
           "load_state_dict", "with_resume")


class StreamdsDataset(IterableDataset):
    """Base of every streamds dataset type: `map`, `filter`, `batch` and `pack` here, the
    rest (`set_epoch`, `state_dict`, `load_state_dict`, `with_resume`, `_with_step`) in
    each type."""

    def _with_step(self, step: Step) -> Self:
        """A copy with `step` after this one's steps, sharing nothing that iterates."""
        raise NotImplementedError

    def map(self, fn: Callable[[Any], Any], *, batch_size: int | None = None) -> Self:
        """A new dataset of the same type whose items are `fn(item)`; None drops the item.
        The original is unchanged. It runs in the reader (the DataLoader worker).

        With `batch_size=n`, `fn` takes a list of at most n items and returns a list of as
        many results, in order (None drops an item), so a fast tokenizer runs once per list
        (``tokenizer.encode_batch(texts)``, Rust threads, no per-item Python call). A reader
        calls it on the records of one chunk at a time (a list never spans two chunks) and
        then runs its steps before the shuffle buffer; each result must depend on its item
        alone (not on the list it came in), as resumes map some records again in other
        lists. A mix or packed data calls it on lists of one."""
        if not callable(fn):
            raise ValueError(f"map needs a callable, got {fn!r}")
        if batch_size is not None and (
                isinstance(batch_size, bool) or not isinstance(batch_size, int)
                or batch_size < 1):
            raise ValueError(f"map's batch_size must be a positive integer, got {batch_size!r}")
        if batch_size is None:
            return self._with_step(Step("map", fn))
        return self._with_step(BatchedMap("map", fn, batch_size))  # type: ignore[arg-type]

    def filter(self, predicate: Callable[[Any], bool]) -> Self:
        """A new dataset of the same type keeping the items for which `predicate(item)` is
        true. The original is unchanged."""
        if not callable(predicate):
            raise ValueError(f"filter needs a callable, got {predicate!r}")
        return self._with_step(Step("filter", predicate))

    def batch(
        self, size: int | Rule, *, collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> StreamdsDataset:
        """The items in whole batches: `size` items per batch or a ``streamds.LengthBuckets``
        / ``streamds.TokenBudget`` rule; `collate` makes the batch (None: a
        `streamds.RecordBatch`). Use it with ``DataLoader(ds.batch(n, collate=...),
        batch_size=None)``; a state taken after any batch resumes exactly. Each type makes
        its own (`Batched` for a mix or packed data; a reader batches in its workers)."""
        raise NotImplementedError

    def pack(self, packer: PackTokens) -> Packed:
        """Tokenized records packed into fixed-length sequences (`streamds.PackTokens`); each
        type makes its `Packed` (this module sits below `pack` and `batching`, which build on
        it), or refuses where packing makes no sense."""
        raise NotImplementedError

    def loader(self, batch_size: int, **options: Any) -> Loader:
        """The fast, exactly resumable loader of this dataset: batches of `batch_size`
        records made in the workers, with `state_dict` / `load_state_dict` / `set_epoch`.

        ``for batch in ds.loader(32, num_workers=2, collate=PadCollate(pad_id=0)): ...``;
        the options (`num_workers`, `collate`, `drop_last`, `small_records`, `pin_memory`,
        ...) are `streamds.train.loader.Loader`'s.
        """
        return Loader(self, batch_size, **options)

    def set_epoch(self, epoch: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def with_resume(self, merged: dict[str, Any]) -> Self:
        raise NotImplementedError
