"""Dicts of tensors out of a DataLoader worker through its shared-memory ring.

torch sends a tensor from a worker by moving its storage into a new /dev/shm file and passing
the file descriptor: for each tensor the main process connects to a socket in the worker and a
thread there hands the descriptor over, once it wins the worker's interpreter lock from the
thread that is tokenizing. For the few tensors of a padded batch (tens to hundreds of KB) that
costs more than copying their bytes. So in a worker, a dict a `.batch(n, collate=...)` collate
returns leaves as a `TensorBatch`: when the DataLoader's queue pickles it (multiprocessing's
`ForkingPickler`; any other pickling sees a plain dict), its top-level tensors are copied into
the worker's ring (`streamds.handover.shm_ring`) as one entry, the other values are pickled as
before, and the main process gets a plain dict with CPU tensors of its own.

The ring is used only when that delivers exactly what torch's own pickling would: every tensor
at the top level is a plain `torch.Tensor` on the CPU, dense and contiguous, owning its whole
storage, with no autograd and no lazy conjugate or negation bit; no two of them share memory;
and the other values are plain data (numbers, strings, bytes, None, and lists, tuples and dicts
of them) with no tensor inside. Anything else, a batch too big for the ring, or no shared
memory, takes torch's way.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.utils.data import get_worker_info

from . import shm_ring

__all__ = ["TensorBatch", "leave_as_tensor_batches"]

log = logging.getLogger(__name__)

# (key, dtype, shape, strides, start of its bytes in the entry's payload, bytes)
Layout = list[tuple[Any, torch.dtype, tuple[int, ...], tuple[int, ...], int, int]]
PLAIN = (str, bytes, int, float, bool, type(None))
DEPTH = 16  # plain data nested deeper than this takes torch's way


class TensorBatch(dict):
    """A collate's dict on its way out of a DataLoader worker; pickled by the worker's queue,
    its tensors cross in shared memory. Unpickled, it is a plain dict."""

    __slots__ = ()

    def __copy__(self) -> TensorBatch:  # torch's default_convert copies mappings
        return TensorBatch(self)

    def __reduce__(self) -> tuple[Any, ...]:  # pickle, torch.save, deepcopy: a plain dict
        return (dict, (dict(self),))


def _reduce_for_queue(batch: TensorBatch) -> tuple[Any, ...]:
    """How multiprocessing's pickler (the DataLoader's queues) sends a `TensorBatch`."""
    if get_worker_info() is None:  # not on the way from a DataLoader worker
        return (dict, (dict(batch),))
    return _reduce_in_worker(batch)


ForkingPickler.register(TensorBatch, _reduce_for_queue)


def leave_as_tensor_batches(collate: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """`collate`, whose dicts become `TensorBatch`es (for a pipeline in a DataLoader worker)."""

    def collate_for_the_main_process(records: list[Any]) -> Any:
        batch = collate(records)
        return TensorBatch(batch) if type(batch) is dict else batch

    return collate_for_the_main_process


def _owns_its_bytes(value: torch.Tensor) -> bool:
    return (
        type(value) is torch.Tensor
        and value.layout == torch.strided
        and not value.is_nested
        and value.device.type == "cpu"
        and not value.requires_grad
        and not value.is_quantized
        and not value.is_conj()
        and not value.is_neg()
        and value.is_contiguous()
        and value.storage_offset() == 0
        and value.untyped_storage().nbytes() == value.nbytes
    )


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether `value` is plain data with no tensor (or anything else) inside."""
    if isinstance(value, PLAIN):
        return True
    if depth >= DEPTH:
        return False
    if type(value) in (list, tuple):
        return all(_plain(item, depth + 1) for item in value)
    if type(value) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's memory, as bytes (valid while the tensor lives)."""
    assert tensor.device.type == "cpu", tensor.device
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()))


def _split(batch: TensorBatch) -> tuple[Layout, list[memoryview], dict[Any, Any]] | None:
    """(layout, bytes, the other values) of a batch the ring carries exactly, else None."""
    layout: Layout = []
    pieces: list[memoryview] = []
    others: dict[Any, Any] = {}
    storages: set[int] = set()
    at = 0
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            if not _plain(value):
                return None
            others[key] = value
            continue
        if not _owns_its_bytes(value):
            return None
        if value.nbytes:  # empty tensors hold no memory to share
            storage = value.untyped_storage().data_ptr()
            if storage in storages:
                return None
            storages.add(storage)
            pieces.append(_bytes_of(value))
        layout.append((key, value.dtype, tuple(value.shape), value.stride(), at, value.nbytes))
        at += value.nbytes
    return (layout, pieces, others) if layout else None


def _reduce_in_worker(batch: TensorBatch) -> tuple[Any, ...]:
    try:
        parts = _split(batch)
    except Exception:  # a kind of tensor not foreseen here: torch's way is always right
        log.debug("a batch takes torch's way out of the worker", exc_info=True)
        parts = None
    entry = None if parts is None else shm_ring.put(*parts[1])
    if parts is None or entry is None:
        return (dict, (dict(batch),))
    layout, _, others = parts
    return (_from_ring, (entry, layout, others, list(batch)))


def _from_ring(
    entry: shm_ring.Entry, layout: Layout, others: dict[Any, Any], keys: list[Any]
) -> dict[Any, Any]:
    tensors = shm_ring.take(entry, lambda payload: _copy_out(payload, layout))
    return {key: tensors[key] if key in tensors else others[key] for key in keys}


def _copy_out(payload: memoryview, layout: Layout) -> dict[Any, torch.Tensor]:
    tensors = {}
    for key, dtype, shape, strides, start, nbytes in layout:
        # on the CPU whatever torch.set_default_device says, as torch's own pickling does
        tensor = torch.empty_strided(shape, strides, dtype=dtype, device="cpu")
        if nbytes:
            _bytes_of(tensor).cast("B")[:] = payload[start : start + nbytes]
        tensors[key] = tensor
    return tensors
