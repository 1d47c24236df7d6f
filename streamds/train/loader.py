"""`Loader`: the fast, exactly resumable loader of a streamds dataset, built by one call.

``ds.loader(32, num_workers=2, collate=streamds.PadCollate(pad_id=0))`` is a torchdata
`StatefulDataLoader` whose workers hand over batches in few, large messages: torchdata takes
every worker's state after each message, a fixed cost per message that small records would pay
thousands of times a second. Two routes, chosen by the records' mean size where the dataset
says it (`record_bytes()`: a converted corpus's manifest, or lines sampled across JSONL files):

- small records (under SMALL_RECORD bytes): the workers hand over MESSAGE_RECORDS records at a
  time (``ds.batch(2048)``), or fewer where their JSON lines reach MESSAGE_BYTES (records
  that grow past the sampled ones), and the main process cuts the training batches from them
  and collates them (`Rebatch`), so a cheap collate (padding) runs in the main process;
- larger or unknown records: the workers make the training batches themselves
  (``ds.batch(batch_size, collate=...)``), so the collate runs where the records are. Without
  a collate a batch is a `RecordBatch`, which crosses in the worker's shared-memory ring (plain
  records as their JSON lines, parsed in the main process: `streamds.stages.parse_later`) and
  is handed on as its list. Big messages do not pay here: the loader's cost per message is
  small beside parsing a batch of large records, and the main process parses a message that
  stays in the CPU's caches faster than a big one (`benchmarks/workers_vs_none.py`).

Either way a state taken after any batch resumes exactly, and batches are handed on as the
collate made them (no torch conversion walks them). Where the workers only copy lines in order
and the main process parses them (no map, collate or shuffle), the workers keep off a CPU from
their start and the main process's thread takes each batch there (`OnMainCpu`). The collate
defaults to a list of records: torch's default collate fails on records of strings and lists
of unequal length (most text corpora), and a list never does.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..checks import check_bool, check_int
from ..stages.batch import Batch
from ..stages.cpus import main_cpus, move_threads, thread_on_cpus, threads
from .collate import as_list
from .loader_state import check_num_workers, stateful_loader_class
from .rebatch import Rebatch

__all__ = ["MESSAGE_BYTES", "MESSAGE_RECORDS", "SMALL_RECORD", "Loader", "auto_workers",
           "stateful_loader", "stop_workers", "torchdata_set_vital_ignored", "usable_cpus"]

SMALL_RECORD = 1024  # mean JSON bytes under which records cross in big messages
# (benchmarks/rebatch_bench.py measures both routes)
MESSAGE_RECORDS = 2048  # records of small size a worker hands over in one message
# ... or fewer, once their JSON lines hold this many bytes (twice MESSAGE_RECORDS records of
# SMALL_RECORD bytes): a corpus whose records grow after the sampled ones keeps its messages,
# and the memory they hold in flight, bounded (`BatchSettings.max_bytes`)
MESSAGE_BYTES = 2 * MESSAGE_RECORDS * SMALL_RECORD
MAX_AUTO_WORKERS = 8
# torchdata 0.11's StatefulDataLoader.__init__ calls torch.set_vital, which torch deprecated
# into a no-op that warns on each call: the user did not make that call and cannot fix it,
# so the constructor runs with exactly that warning ignored (any other warning still shows)
SET_VITAL = r"'set_vital' is deprecated"


@contextmanager
def torchdata_set_vital_ignored() -> Iterator[None]:
    """Ignore the SET_VITAL warning inside the block, and nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SET_VITAL, category=UserWarning)
        yield


def stateful_loader(dataset: Any, **options: Any) -> Any:
    """``torchdata.stateful_dataloader.StatefulDataLoader(dataset, **options)``, built without
    the warning torchdata's constructor triggers (torch's deprecated ``set_vital``), whose
    state after an epoch holds every worker's end (`loader_state.stateful_loader_class`); an
    ImportError naming the package where torchdata is missing.

    Example::

        loader = stateful_loader(ds.batch(16, collate=collate), batch_size=None,
                                 num_workers=2)
    """
    try:
        loader_class = stateful_loader_class()
    except ImportError as err:
        raise ImportError(
            "a StatefulDataLoader needs torchdata, a dependency of streamds that is missing "
            "here; pip install torchdata"
        ) from err
    with torchdata_set_vital_ignored():
        return loader_class(dataset, **options)


def stop_workers(loader: Any) -> None:
    """Stop the workers of `loader`'s current epoch now (a loader whose epoch raised).

    The error a worker raised keeps the epoch's iterator alive in a reference cycle (torch's
    re-raise holds the exception in its own frame), so only the garbage collector frees it,
    at some later moment, and torch's shutdown from there waits its 5 s join timeout per
    worker before killing it (10 s for two workers, in whatever code runs then). Stopped
    here, while the iterator is in use, they exit at once. The state (`state_dict()`) lives
    in the main process and stays readable. Persistent workers are left as they are: the
    user keeps them for the next epoch on purpose.
    """
    if getattr(loader, "persistent_workers", False):
        return
    iterator = getattr(loader, "_iterator", None)  # torchdata's loader keeps its epoch's
    shutdown = getattr(iterator, "_shutdown_workers", None)  # none without workers
    if shutdown is not None:
        shutdown()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def auto_workers() -> int:
    """Workers for ``num_workers="auto"``: one per usable CPU (none on one CPU: a worker
    there only takes turns with the main process), at most MAX_AUTO_WORKERS."""
    cpus = usable_cpus()
    return 0 if cpus < 2 else min(cpus, MAX_AUTO_WORKERS)


def _record_bytes(dataset: Any) -> float | None:
    """The mean bytes of `dataset`'s records where it says (None: not known)."""
    return getattr(dataset, "record_bytes", lambda: None)()


def _message_records(record_bytes: float | None, batch_size: int) -> int:
    """Records a worker's big message holds: MESSAGE_RECORDS, fewer where records of
    `record_bytes` would pass MESSAGE_BYTES (``small_records=True`` over large records:
    records parsed in the workers, by a map or under on_error='skip', are not measured as
    they go), and at least a training batch."""
    fit = MESSAGE_RECORDS if record_bytes is None else int(MESSAGE_BYTES // max(record_bytes, 1))
    return max(batch_size, min(MESSAGE_RECORDS, fit))


def _messages(dataset: Any, records: int) -> Any:
    """`dataset` in the big batches its workers hand over on the small-record route: of
    `records` records, a reader's ended early at MESSAGE_BYTES bytes of lines (its batches
    gathered from lists of `Batch.PIECE` records: `records` rounded up to a multiple)."""
    if getattr(dataset, "KIND", None) != "reader":  # a mix, packed data: as many records
        return dataset.batch(records)
    piece = Batch.PIECE
    return dataset.batch(-(-records // piece) * piece, max_bytes=MESSAGE_BYTES)


def _main_cpu_of(batches: Any, workers: int) -> tuple[Any, frozenset[int] | None]:
    """(`batches`, the CPU the main process takes them on): where its `workers` only copy
    lines in order for the main process to parse, a copy whose workers keep off that CPU
    from their start (`streamds.stages.cpus.main_cpus`); else `batches` and None."""
    if not getattr(batches, "wants_main_cpu", lambda: False)():
        return batches, None
    cpus = main_cpus(workers)
    return (batches, None) if cpus is None else (batches._taken_on_main_cpu(), cpus)


def _on(loader: Any, cpus: frozenset[int] | None) -> Any:
    return loader if cpus is None else OnMainCpu(loader, cpus)


class OnMainCpu:
    """A loader whose batches the calling thread takes on `cpus`, the CPU its workers keep
    off from their start (`streamds.stages.cpus.on_planned_cpus`): where the workers only
    copy lines and this process parses them, the parsing is the bottleneck, and each
    worker's message wakes this thread on the worker's CPU (a pipe's wake-up), behind the
    workers, unless the thread is bound to its own. It is bound while it waits for and
    parses each batch, and runs where it ran in between (the training step: the model's
    threads are left alone); the threads the loader starts in this process (its queues')
    are moved there for good. Everything else is the loader's."""

    def __init__(self, loader: Any, cpus: frozenset[int]) -> None:
        self.loader = loader
        self.cpus = cpus

    def __iter__(self) -> Iterator[Any]:
        before = threads()
        batches = iter(self.loader)  # (its workers start from this thread's CPUs: all of them)
        move_threads(threads() - before, self.cpus)  # the threads it started here (queues)
        return self._taken(batches)

    def _taken(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            with thread_on_cpus(self.cpus):
                batch = next(batches, _END)
            if batch is _END:
                return
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # num_workers, dataset, ...
        if name == "loader":  # (not set yet: unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)


_END = object()


class Loader:
    """Batches of `batch_size` records of `dataset`; iterate it once per epoch.
    `state_dict()` after any batch, loaded into a `Loader` made the same way, continues
    exactly; `set_epoch(n)` before an epoch's loop chooses its order.

    `collate`: a module-level function (spawned workers pickle it) from a list of records to
    what the model takes; None hands over the list. `num_workers`: "auto" is one per usable
    CPU (none on one CPU). `drop_last`: drop the epoch's short batches. `small_records`:
    whether records cross in big messages and are batched in the main process (see the
    module's doc); "auto" decides by their mean size. Other keywords (`pin_memory`,
    `prefetch_factor`, `multiprocessing_context`, ...) go to the `StatefulDataLoader`.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        num_workers: int | str = "auto",
        collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        small_records: bool | str = "auto",
        **loader_options: Any,
    ) -> None:
        check_int("batch_size", batch_size, 1, "pass the number of records a batch holds")
        check_bool("drop_last", drop_last)
        if num_workers == "auto":
            num_workers = auto_workers()
        check_int("num_workers", num_workers, 0, "'auto', or the DataLoader workers (0: none)")
        size = None
        if small_records == "auto":
            size = _record_bytes(dataset)
            small_records = size is not None and size < SMALL_RECORD
        check_bool("small_records", small_records)
        for taken in ("batch_size", "collate_fn", "dataset", "sampler", "batch_sampler"):
            if taken in loader_options:
                raise ValueError(
                    f"{taken}= is set by Loader itself; pass batch_size and collate to "
                    "ds.loader(...) instead"
                )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.small_records = small_records
        self._batches: Any
        if small_records:  # big messages; training batches cut and collated here
            if size is None:
                size = _record_bytes(dataset)
            batches, cpus = _main_cpu_of(_messages(dataset, _message_records(size, batch_size)),
                                         num_workers)
            self.loader = stateful_loader(batches, batch_size=None, num_workers=num_workers,
                                          **loader_options)
            self._batches = Rebatch(_on(self.loader, cpus), batch_size, collate=collate,
                                    drop_last=drop_last)
        else:  # training batches made and collated in the workers, handed on as made
            # no collate: a RecordBatch, which crosses from a worker in its shared-memory ring
            # (plain records as their lines, parsed here), handed on as its list; a list
            # would be pickled through the pipe
            batches, cpus = _main_cpu_of(
                dataset.batch(batch_size, collate=collate, drop_last=drop_last), num_workers)
            # collate_fn=as_list: not torch's default conversion, which copies every record
            # and walks every value of a batch (thousands of calls a batch of large records)
            self.loader = stateful_loader(batches, batch_size=None, collate_fn=as_list,
                                          num_workers=num_workers, **loader_options)
            self._batches = _on(self.loader, cpus)
        self._record_batches = not small_records and collate is None

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self._batches)
        if self._record_batches:  # RecordBatch -> the list it holds
            batches = (batch.records for batch in batches)
        return self._stopping_workers_on_error(batches)

    def _stopping_workers_on_error(self, batches: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from batches
        except Exception:
            stop_workers(self.loader)  # now, not seconds later in the garbage collector
            raise

    def __len__(self) -> int:
        """Batches per epoch for this rank, where the dataset knows its record counts."""
        per_worker_of = getattr(self.dataset, "worker_records", None)
        if per_worker_of is None:  # a mix or packed data: as its batches say
            return len(self.loader.dataset) if not self.small_records else -(
                -len(self.dataset) // self.batch_size)
        per_worker = per_worker_of(self.num_workers)
        if self.small_records:  # only the epoch's last batch is short
            per_worker = [sum(per_worker)]
        size, keep_short = self.batch_size, not self.drop_last
        return sum(n // size + (keep_short and n % size > 0) for n in per_worker)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration yields."""
        self.dataset.set_epoch(epoch)  # its .batch() copy shares the epoch

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch begins (cheap: small integers and positions, no records)."""
        return self._batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` (from `state_dict()` of a Loader made the same way); a state
        taken with another `num_workers` is refused naming `merge_states` (elastic resume)."""
        taken = Rebatch.loader_state_of(state) if self.small_records else state
        check_num_workers(taken, self.num_workers)
        self._batches.load_state_dict(state)
