"""What every test module shares: the corpora several modules read, and the release of a
failed loader's workers at the end of the test that failed it.

The corpus writers themselves are in `corpus.py` (every shard format) and
`resume_contract.py` (`write_mixed`); a fixture here is a corpus written once per session
that more than one module reads and none changes.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from collections.abc import Iterator
from pathlib import Path

# torch's OpenMP threads wait for work by spinning; on 2 shared cores a spinning thread takes
# the CPU from the other thread of the same op (and from DataLoader workers and subprocesses):
# a tiny model's step then costs 20x. Passive waiting sleeps instead. Read once, when torch
# loads its OpenMP library: so here, before any test module imports torch; subprocesses
# inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from resume_contract import write_mixed


@pytest.fixture(scope="session")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """Every shard format in one directory (`write_mixed`: 322 records, 9 blocks or more of
    64 KiB) and its ids in file order. Read-only: a test that changes files copies it."""
    directory = tmp_path_factory.mktemp("shared") / "mixed"
    return directory, write_mixed(directory)


# -- a failed loader's workers ------------------------------------------------------------------

# the DataLoader iterators that own worker processes (torch's, and torchdata's own class)
_ITERATOR_CLASSES = (("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter"),
                     ("torchdata.stateful_dataloader.stateful_dataloader",
                      "_StatefulMultiProcessingDataLoaderIter"))


def _worker_iterator_classes() -> tuple[type, ...]:
    return tuple(getattr(sys.modules[module], name) for module, name in _ITERATOR_CLASSES
                 if module in sys.modules)


def stop_leftover_workers() -> None:
    """Stop the workers of every DataLoader iterator still alive.

    An epoch that raised in a worker leaves its iterator in a reference cycle (torch's
    re-raise keeps the exception in its own frame, and the exception's traceback holds the
    iterator); only the garbage collector frees it, in some later test, where torch then
    waits its 5 s join timeout per worker: 10 s charged to an innocent test. Stopped at the
    end of the test that failed it, while the iterator is intact, the workers exit at once.
    """
    if not multiprocessing.active_children():  # no worker anywhere: nothing to look for
        return
    classes = _worker_iterator_classes()
    for thing in gc.get_objects():
        if issubclass(type(thing), classes):  # type(): some objects warn on __class__
            thing._shutdown_workers()  # once per iterator: a stopped one returns at once


@pytest.fixture(autouse=True)
def leftover_workers_stopped() -> Iterator[None]:
    yield
    stop_leftover_workers()
