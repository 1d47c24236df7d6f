"""`Loader`: the fast, exactly resumable loader of a streamds dataset, built by one call.

``ds.loader(32, num_workers=2, collate=streamds.PadCollate(pad_id=0))`` is a torchdata
`StatefulDataLoader` over ``ds.batch(32, collate=...)``: the workers make whole training
batches (the collate runs where the records are, in the workers), and hand several of them
over in one message, so that the loader's per-message cost (torchdata takes every worker's
state after each message) is paid once per `batches_per_message` batches. The main process
unpacks the messages (`Rebatch` with one batch per step), and its state says which message and
how many of its batches were handed out, so a state taken after any batch resumes exactly.

The collate defaults to a list of records: torch's default collate fails on records of
strings and lists of unequal length (most text corpora), and a list never does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset

from ..checks import check_bool, check_int
from .collate import as_list
from .rebatch import Rebatch

__all__ = ["MESSAGE_RECORDS", "Loader", "usable_cpus"]

MESSAGE_RECORDS = 512  # records per worker message at least: torchdata's per-message state
# bookkeeping is paid once for these (benchmarks/loader_bench.py measures the choice)
MAX_AUTO_WORKERS = 8


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


def _only(batches: list[Any]) -> Any:
    return batches[0]


class _Messages(IterableDataset):
    """`batches` grouped `per_message` at a time, in a worker: one list per message. Its state
    is the batched dataset's, taken after the message's last batch."""

    def __init__(self, batches: Any, per_message: int) -> None:
        self.batches = batches
        self.per_message = per_message

    def __iter__(self) -> Iterator[list[Any]]:
        message: list[Any] = []
        for batch in self.batches:
            message.append(batch)
            if len(message) == self.per_message:
                yield message
                message = []
        if message:
            yield message

    def state_dict(self) -> dict[str, Any]:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches.load_state_dict(state)


class Loader:
    """Batches of `batch_size` records of `dataset`, made in `num_workers` workers; iterate it
    once per epoch. `state_dict()` after any batch, loaded into a `Loader` made the same way,
    continues exactly; `set_epoch(n)` before an epoch's loop (the order of epoch n).

    `collate`: a module-level function (spawned workers pickle it) from a list of records to
    what the model takes; None hands over the list. `num_workers`: "auto" is one per usable
    CPU (none on one CPU). `batches_per_message`: batches a worker hands over in one message
    ("auto": enough for MESSAGE_RECORDS records). Other keywords (`pin_memory`,
    `prefetch_factor`, `persistent_workers`, `multiprocessing_context`, ...) go to the
    `StatefulDataLoader`.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        num_workers: int | str = "auto",
        collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        batches_per_message: int | str = "auto",
        **loader_options: Any,
    ) -> None:
        check_int("batch_size", batch_size, 1, "pass the number of records a batch holds")
        check_bool("drop_last", drop_last)
        if num_workers == "auto":
            num_workers = auto_workers()
        check_int("num_workers", num_workers, 0, "'auto', or the DataLoader workers (0: none)")
        if batches_per_message == "auto":
            batches_per_message = max(1, -(-MESSAGE_RECORDS // batch_size))
        check_int("batches_per_message", batches_per_message, 1,
                  "'auto', or the batches a worker hands over in one message")
        for taken in ("batch_size", "collate_fn", "dataset", "sampler", "batch_sampler"):
            if taken in loader_options:
                raise ValueError(
                    f"{taken}= is set by Loader itself; pass batch_size and collate to "
                    "ds.loader(...) instead"
                )
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError as err:
            raise ImportError(
                "ds.loader() builds a torchdata StatefulDataLoader, and torchdata is not "
                "installed; pip install torchdata (or pip install 'streamds[frameworks]')"
            ) from err
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        batches = dataset.batch(batch_size, collate=collate or as_list, drop_last=drop_last)
        # one batch per message where a worker sends nothing (no workers) or enough already
        self.per_message = batches_per_message if num_workers else 1
        self.batches = batches
        source = batches if self.per_message == 1 else _Messages(batches, self.per_message)
        self.loader = StatefulDataLoader(source, batch_size=None, num_workers=num_workers,
                                         collate_fn=as_list if self.per_message > 1 else None,
                                         **loader_options)
        self._batches: Any = (self.loader if self.per_message == 1 else
                              Rebatch(self.loader, 1, collate_fn=_only))

    def __iter__(self) -> Iterator[Any]:
        return iter(self._batches)

    def __len__(self) -> int:
        """Batches per epoch for this rank, where the dataset knows its length (each
        worker's last batch may be short, and counts as one)."""
        per_worker = getattr(self.dataset, "worker_records", None)
        if per_worker is None:
            return len(self.batches)
        size, keep_short = self.batch_size, not self.drop_last
        return sum(n // size + (keep_short and n % size > 0)
                   for n in per_worker(self.num_workers))

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration yields."""
        self.dataset.set_epoch(epoch)  # its .batch() copy shares the epoch

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch begins (cheap: small integers and positions, no records)."""
        return self._batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` (from `state_dict()` of a Loader made the same way)."""
        self._batches.load_state_dict(state)
