"""Dicts of tensors out of a DataLoader worker through its shared-memory ring.

torch sends a tensor from a worker by moving its storage into a new /dev/shm file and passing
the file descriptor: for each tensor the main process connects to a socket in the worker and a
thread there hands the descriptor over, once it wins the worker's interpreter lock from the
thread that is tokenizing. For the few tensors of a padded batch (tens to hundreds of KB) that
costs more than copying their bytes. So in a worker, a dict a `.batch(n, collate=...)` collate
returns leaves as a `TensorBatch`: its top-level CPU tensors are copied into the worker's ring
(`streamds.train.shm_ring`), everything else is pickled as before, and the main process gets a
plain dict with tensors of its own (copied out of the ring, whose space is then reused).

Only tensors that own their whole storage are copied (plain `torch.Tensor`, CPU, strided,
contiguous, no autograd, no lazy conjugate or negation bit), and only when no two tensors of
the batch share memory (torch's pickling keeps that sharing); any other value, a batch too big
for the ring, or no shared memory takes torch's own way, so the main process receives the
same either way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import get_worker_info

from . import shm_ring

__all__ = ["TensorBatch", "leave_as_tensor_batches"]

# (key, dtype, shape, start of its bytes in the entry's payload, bytes)
Layout = list[tuple[Any, torch.dtype, tuple[int, ...], int, int]]


class TensorBatch(dict):
    """A collate's dict on its way out of a DataLoader worker: pickled there, its tensors
    cross in shared memory; unpickled, it is a plain dict."""

    __slots__ = ()

    def __copy__(self) -> TensorBatch:  # torch's default_convert copies mappings
        return TensorBatch(self)

    def __reduce__(self) -> tuple[Any, ...]:
        if get_worker_info() is None:  # not on the way from a DataLoader worker
            return (dict, (dict(self),))
        return _reduce_in_worker(self)


def leave_as_tensor_batches(collate: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """`collate`, whose dicts become `TensorBatch`es (for a pipeline in a DataLoader worker)."""

    def collate_for_the_main_process(records: list[Any]) -> Any:
        batch = collate(records)
        return TensorBatch(batch) if type(batch) is dict else batch

    return collate_for_the_main_process


def _owns_its_bytes(value: Any) -> bool:
    return (
        type(value) is torch.Tensor
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and not value.requires_grad
        and not value.is_quantized
        and not value.is_conj()
        and not value.is_neg()
        and value.is_contiguous()
        and value.storage_offset() == 0
        and value.untyped_storage().nbytes() == value.nbytes
    )


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory, as bytes (valid while the tensor lives)."""
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()))


def _aliased(batch: TensorBatch) -> bool:
    """Whether two tensors of the batch share memory (torch's pickling keeps that)."""
    storages = [value.untyped_storage().data_ptr() for value in batch.values()
                if isinstance(value, torch.Tensor) and value.nbytes]
    return len(set(storages)) < len(storages)


def _reduce_in_worker(batch: TensorBatch) -> tuple[Any, ...]:
    layout: Layout = []
    pieces: list[memoryview] = []
    others: dict[Any, Any] = {}
    at = 0
    for key, value in batch.items():
        if _owns_its_bytes(value):
            pieces.append(_bytes_of(value))
            layout.append((key, value.dtype, tuple(value.shape), at, value.nbytes))
            at += value.nbytes
        else:
            others[key] = value
    entry = shm_ring.put(*pieces) if layout and not _aliased(batch) else None
    if entry is None:
        return (dict, (dict(batch),))
    return (_from_ring, (entry, layout, others, list(batch)))


def _from_ring(
    entry: shm_ring.Entry, layout: Layout, others: dict[Any, Any], keys: list[Any]
) -> dict[Any, Any]:
    tensors = shm_ring.take(entry, lambda payload: _copy_out(payload, layout))
    return {key: tensors[key] if key in tensors else others[key] for key in keys}


def _copy_out(payload: memoryview, layout: Layout) -> dict[Any, torch.Tensor]:
    tensors = {}
    for key, dtype, shape, start, nbytes in layout:
        tensor = torch.empty(shape, dtype=dtype)
        if nbytes:
            _bytes_of(tensor).cast("B")[:] = payload[start : start + nbytes]
        tensors[key] = tensor
    return tensors
