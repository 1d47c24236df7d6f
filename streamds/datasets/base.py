"""`StreamdsDataset`: the methods every dataset type offers, one definition each.

A reader (`StreamingJsonl`), a mix (`Mix`), packed data (`Packed`) and batches of a mix or
packed data (`Batched`) are all thin, picklable descriptions that build their stages in each
reader, and all offer the same methods (`METHODS`), defined here once:

- `map`, `filter`: a copy with one more step (each type's `_with_step`: its copy rule);
- `batch`, `pack`: a `Batched` / `Packed` around this dataset (a reader batches inside its
  workers instead, and packed data refuses `pack`: each says so by overriding);
- `cache`: stored records (each type's `_with_cache`: a reader stores what its steps make; a
  mix, packed data and batches store their readers' records);
- `loader`: the one-call loader (`streamds.train.loader.Loader`);
- `len()`: the items of this rank's epoch, from each type's `_worker_items` (what every
  DataLoader worker yields), where they are known exactly; a TypeError saying why elsewhere;
- `epoch` / `set_epoch`: a reader and a mix own an epoch cell (`SharedEpoch`: shared by the
  copies derived from a reader), packed data and batches follow their source's;
- iteration: each type opens its stage (`_open`) and the base runs the type's own
  `.map`/`.filter` steps on what it yields (a reader runs them inside its pipeline instead);
- `state_dict`, `load_state_dict`, `with_resume`: the base refuses a state of another
  streamds version, then each type says where its stage stands (`_state`), loads a state
  into its next iterator (`_load`) and makes the copy that finishes a merged epoch
  (`_resumed`); `__getstate__` and copies leave out what iterates (`_live`).

The types know each other only through this base: each registers under its `KIND`
(`__init_subclass__`), and `batch` / `pack` build the registered type, so no module of a type
imports another type's module (`tests/test_import_cycles.py` counts type-only imports too).
`streamds.datasets` imports every type, so each is registered before any dataset exists.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, Self

from torch.utils.data import IterableDataset, get_worker_info

from ..checks import check_int, size_setting
from ..stages.batch import records_from_user_steps
from ..stages.buckets import Rule
from ..stages.packing import PackTokens
from ..stages.state import (
    Positioned,
    check_epoch_change,
    compacted,
    expanded,
    refuse_other_version,
)
from ..stages.transform import BatchedMap, Step, apply_steps
from ..train.loader import Loader
from .callers import loader_len_call
from .epoch import SharedEpoch

__all__ = ["METHODS", "StreamdsDataset", "batches_of"]

# what every dataset type offers (a test holds each type to it)
METHODS = ("map", "filter", "batch", "pack", "cache", "loader", "set_epoch", "state_dict",
           "load_state_dict", "with_resume")


# a worker's state_dict() is being taken: states taken inside it (of a mix's sources, of a
# batcher's source) stay trees and only the outermost comes compact
_taking = False


def batches_of(items: int, size: int, drop_last: bool) -> int:
    """Batches of `size` cut from `items` items (the short last one kept unless `drop_last`)."""
    return items // size if drop_last else -(-items // size)


class StreamdsDataset(IterableDataset):
    """Base of every streamds dataset type (see the module doc).

    A type supplies `KIND`, `_open` (its stage's iterator; or `__iter__` where the steps
    run inside), `_with_cache`, `_worker_items` (or leaves `len()` unknown), its epoch
    (`_epoch`, a `SharedEpoch`, or `_epoch_source`), its state (`_state`, `_load`,
    `_resumed`) and what must not be shared (`_live`, `_copy`).
    """

    KIND: ClassVar[str] = ""
    _ITEMS: ClassVar[str] = "this dataset"  # its items, in a step's error message
    _KINDS: ClassVar[dict[str, type[StreamdsDataset]]] = {}
    _epoch: SharedEpoch
    _steps: tuple[Step, ...]
    _active: Any

    def __init_subclass__(cls, **options: Any) -> None:
        super().__init_subclass__(**options)
        kind = cls.__dict__.get("KIND")
        if kind:
            known = StreamdsDataset._KINDS.get(kind)
            if known is not None and known.__qualname__ != cls.__qualname__:
                raise ValueError(f"two dataset types named {kind!r}: {known} and {cls}")
            StreamdsDataset._KINDS[kind] = cls

    @staticmethod
    def of_kind(kind: str) -> type[StreamdsDataset]:
        """The dataset type registered as `kind` ("reader", "mix", "packed", "batched")."""
        found = StreamdsDataset._KINDS.get(kind)
        if found is None:
            raise LookupError(f"no dataset type {kind!r} is registered; import streamds.datasets")
        return found

    # -- iteration and copies ------------------------------------------------------------

    def _open(self) -> Iterator[Any]:
        """This dataset's items before its own steps: its stage, started where it starts."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        items = self._open()
        if not self._steps:
            return items
        records_from_user_steps()  # what they make is checked before it is marshalled
        # -> the type's own map and filter, on what its stage yields; a state taken between
        # items stays exact (an item a step drops was counted before the next is handed out)
        return apply_steps(items, self._steps, self._ITEMS)

    def _live(self) -> dict[str, Any]:
        """Attributes that iterate, as a copy or a pickled dataset (a DataLoader worker's)
        starts them: they stay with the object and process that made them."""
        return {"_active": None}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **self._live()}

    def _copy(self) -> Self:
        """A copy that shares nothing that iterates (a type adds what else it must not
        share, e.g. a mix's sources)."""
        clone = copy.copy(self)
        clone.__dict__.update(self._live())
        return clone

    def _with_step(self, step: Step) -> Self:
        """A copy with `step` after this one's steps, sharing nothing that iterates."""
        clone = self._copy()
        clone._steps = (*self._steps, step)
        return clone

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

    # -- what stacks on a dataset --------------------------------------------------------

    def batch(
        self, size: int | Rule, *, collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> StreamdsDataset:
        """The items in whole batches: `size` items per batch or a ``streamds.LengthBuckets``
        / ``streamds.TokenBudget`` rule; `collate` makes the batch (None: a
        `streamds.RecordBatch`). Use it with ``DataLoader(ds.batch(n, collate=...),
        batch_size=None)``; a state taken after any batch resumes exactly. Batches are cut
        from pools of items by a pool batcher around this dataset (`Batched`); a reader
        batches inside its workers instead."""
        return self.of_kind("batched")(self, size, collate=collate, drop_last=drop_last)

    def pack(self, packer: PackTokens) -> StreamdsDataset:
        """Tokenized records packed into fixed-length sequences (`streamds.PackTokens`): a
        `Packed` over this dataset. Types whose items are no documents refuse it."""
        return self.of_kind("packed")(self, packer)

    def cache(self, directory: str | os.PathLike, *, key: str,
              limit: int | str | None = None) -> Self:
        """A new dataset that stores the records the readers' steps so far make (the parse
        and the `.map`/`.filter` steps added before it) in `directory` on local disk, in the
        first epoch that reads each block, and reads them back in later epochs and resumes
        instead of reading, parsing and mapping again: the same records in the same order,
        with the same states, as without it. Steps added after `.cache()` run on the stored
        records.

        `key` names what the steps compute (the tokenizer and its settings: steps are told
        apart by their names and their arguments' reprs where stable, never by their code;
        a step whose settings have no stable repr is logged): another key, a changed source
        file (name, size, manifest checksum, or modification time), another on_error or steps
        of other names never read records stored under the old one.
        `limit`: bytes the directory may hold (an int or a size such as "10GB"; None: no
        bound); least recently used blocks go first. The directory is shared by the workers
        and ranks of one machine (one writer per block). Each reader checks the shards it
        reads against their storage once per epoch (a stat; a HEAD request remotely), so a
        file rewritten under a long-lived dataset is read anew. Shards whose storage gives no
        modification time and no manifest checksum cannot be told stale: they are read as
        without a cache (logged once).
        What the steps make must be dicts of str, int, float, bool, None, lists, bytes,
        numpy arrays or torch tensors (`streamds.storage.record_store`). Counts (dropped,
        blank and skipped lines) are the same as without the cache.

        A mix, packed data and batches store the records of their readers (each source of
        a mix, in the one directory): what a reader yields is exact to store, block by
        block, while a mix's draws, a packed sequence or a batch depend on the world that
        read them; mixing, packing and batching run again on the stored records. Their own
        `.map`/`.filter` steps are not stored: `cache` after them is refused.

        ``ds.map(tokenize).cache("/content/cache", key="bpe-32k")``
        """
        if not isinstance(directory, (str, os.PathLike)) or "://" in os.fspath(directory):
            raise ValueError(f"cache directory must be a local path, got {directory!r}; "
                             "put the cache on the machine's own disk (e.g. /content/cache "
                             "on Colab), not on a remote or mounted source")
        directory = os.path.expanduser(os.fspath(directory))  # "~/cache": the home's
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"cache directory {directory!r} is a file; pass a directory "
                             "(made if missing)")
        if not isinstance(key, str) or not key:
            raise ValueError(f"cache key must be a non-empty str naming what the steps "
                             f"compute (e.g. the tokenizer and its settings), got {key!r}")
        limit = None if limit is None else size_setting(
            "limit", limit, "the bytes the cache directory may hold, or None for no bound")
        return self._with_cache(directory, key, limit)

    def _with_cache(self, directory: str, key: str, limit: int | None) -> Self:
        """A copy whose readers store their records (checked arguments of `cache`)."""
        raise NotImplementedError

    def _cache_refused_after_steps(self, steps: Iterable[Step], what: str) -> None:
        """Refuse `cache` after steps that run outside the readers (a mix's, packed data's,
        batches' own): the stored records would not be what they make."""
        if tuple(steps):
            raise ValueError(
                f"cache() after .map/.filter of {what}: those steps run on the {what}'s "
                "output, which the record cache does not store (it stores the records each "
                "reader's steps make); call .cache() before adding them, or map the sources")

    def loader(self, batch_size: int, **options: Any) -> Loader:
        """The fast, exactly resumable loader of this dataset: batches of `batch_size`
        records made in the workers, with `state_dict` / `load_state_dict` / `set_epoch`.

        ``for batch in ds.loader(32, num_workers=2, collate=PadCollate(pad_id=0)): ...``;
        the options (`num_workers`, `collate`, `drop_last`, `small_records`, `pin_memory`,
        ...) are `streamds.train.loader.Loader`'s.
        """
        return Loader(self, batch_size, **options)

    # -- length --------------------------------------------------------------------------

    def _worker_items(self, num_workers: int) -> list[int]:
        """Items (records, sequences or batches) each DataLoader worker of this rank yields
        in every epoch, for a loader with `num_workers` (0: one entry, the main process);
        a TypeError saying why where that is not known exactly."""
        raise TypeError(f"len() of a {type(self).__name__} is unknown")

    def __len__(self) -> int:
        """This rank's items per epoch (records, or batches after `.batch(n)`), where known.

        Seen from a DataLoader with workers and a batch_size, which divides len() by its
        batch_size while each worker's last batch is short, every worker's short batch counts
        as a whole one, so that `len(loader)` is the number of batches the loader yields (what
        Trainer and progress bars use it for).
        """
        call = loader_len_call()
        items = self._worker_items(0 if call is None else call.num_workers)
        if call is not None and call.batch_size is not None and len(items) > 1:
            return call.batch_size * sum(batches_of(count, call.batch_size, call.drop_last)
                                         for count in items)
        return sum(items)

    # -- epochs --------------------------------------------------------------------------

    def _epoch_source(self) -> StreamdsDataset | None:
        """The dataset whose epoch this one follows (None: its own `_epoch` cell)."""
        return None

    @property
    def epoch(self) -> int:
        source = self._epoch_source()
        return self._epoch.value if source is None else source.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        source = self._epoch_source()
        if source is None:
            self._epoch.value = value
        elif value != source.epoch:
            source.set_epoch(value)

    def _loaded_position(self) -> Positioned | None:
        """A state loaded into this dataset whose iterator has not started (None: none)."""
        return None

    def _check_epoch_call(self) -> None:
        """Refuse a set_epoch this dataset cannot follow (a reader: a framework's split)."""

    _EPOCH_FIX = ""  # another way out, named when a loaded state refuses set_epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch: it seeds the order (blocks, shuffle buffer, draws, batches).

        A reader and every copy derived from it (`map`, `filter`, `batch`, `pack`, `cache`,
        `with_resume`, `resume_after_batches`) share one epoch: ``base.set_epoch(e)`` reaches
        a loader over ``base.map(f)``. A `streamds.Mix` sets its sources' epochs itself: call
        ``mix.set_epoch(e)`` (a source's own call that the mix would ignore is refused).
        Packed data and batches set their source's epoch.

        A loaded state in the middle of another epoch refuses: finish that epoch first.
        Call it before each epoch's loop: DataLoader workers read the epoch when their
        iterator starts; forked persistent workers (Linux's default) follow it too
        (`streamds.datasets.epoch.SharedEpoch`), spawned ones keep the epoch they started
        with (a worker that starts the same shuffled epoch twice logs a warning).
        """
        check_int("epoch", epoch, 0, "epochs count from 0")
        check_epoch_change(self._loaded_position(), epoch, or_else=self._EPOCH_FIX)
        self._check_epoch_call()
        source = self._epoch_source()
        if source is None:
            self._epoch.value = epoch
        else:
            source.set_epoch(epoch)

    # -- state and start ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this process's iterator stands, for torchdata's StatefulDataLoader: one tree
        of its stages' nodes with the format version at the top, cheap to take after every
        item (small integers and positions, never records). Before the first `iter()`, where
        that iterator will start (a loaded state, a merged state, a fresh epoch): taking it
        reads no data and refuses nothing, and loading it starts the same way.

        In a DataLoader worker the state comes compact (`streamds.stages.state.compacted`):
        StatefulDataLoader takes it after every batch and walks every key of it, in the worker
        and in the main process. Every streamds function that reads states takes either
        form. A state taken inside another's (a mix's sources) stays a tree."""
        global _taking
        if _taking or get_worker_info() is None:
            return self._state()
        _taking = True  # the sources' states, taken inside this one, stay trees
        try:
            return compacted(self._state())
        finally:
            _taking = False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` at the next `iter()`; a state of another streamds version
        or of another dataset is refused, saying what to do. A state taken in the middle of
        an epoch sets the epoch to its own; one taken after its epoch ran out leaves the
        epoch to `set_epoch` (the next iterator of that epoch yields nothing)."""
        if isinstance(state, dict):
            refuse_other_version(state)
        self._load(expanded(state))

    def with_resume(self, merged: dict[str, Any]) -> Self:
        """A copy that finishes the epoch of `merged` (`streamds.merge_states` of the states
        of every reader of a world) under this dataset's world: elastic resume."""
        if isinstance(merged, dict):
            refuse_other_version(merged)
        return self._resumed(merged)

    def _state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _resumed(self, merged: dict[str, Any]) -> Self:
        raise NotImplementedError
