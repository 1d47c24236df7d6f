"""Prefetch: copy the next batch to the GPU while the current training step runs.

`DevicePrefetcher(loader, device)` wraps any iterable of batches (tensors nested in dicts,
lists, tuples and namedtuples; anything else passes through). On CUDA it keeps one batch in
flight: while the caller works on batch k, batch k+1 is copied host -> device on a side
stream, from pinned memory, with ``non_blocking=True``. Before handing a batch over it makes
the caller's stream wait for the copy (`wait_stream`) and tells the caching allocator that
the caller's stream uses the tensors (`record_stream`), so their memory is not reused while
the step still reads them. On CPU, batches pass through unchanged and nothing is looked
ahead; on other devices they are moved with a plain ``.to(device)``.

Use ``DataLoader(..., pin_memory=True)`` so pinning happens in the loader's pin thread; a
tensor that arrives unpinned is pinned here, on the training thread.

Because it reads one batch ahead, the loader's own ``state_dict()`` would be one batch past
what the caller has seen; `DevicePrefetcher.state_dict()` returns the loader's state as of
the batch most recently handed over, so checkpoints resume exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["DevicePrefetcher", "move_to"]


def _apply(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`batch` with `fn` applied to every tensor, containers rebuilt with their own type."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {key: _apply(value, fn) for key, value in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_apply(value, fn) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_apply(value, fn) for value in batch)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def move_to(batch: Any, device: torch.device | str, *, non_blocking: bool = False) -> Any:
    """`batch` with every nested tensor on `device` (a copy only where it lives elsewhere)."""
    device = torch.device(device)
    return _apply(batch, lambda t: t.to(device, non_blocking=non_blocking))


def _resolve(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} but CUDA is not available; pass device='cpu' or None"
            )
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


class DevicePrefetcher:
    """Batches of `loader` on `device`, the next one copied while the caller uses this one.

    Example::

        loader = DataLoader(ds, batch_size=32, pin_memory=True, num_workers=4)
        for batch in DevicePrefetcher(loader, "cuda"):
            loss = model(**batch).loss  # batch["input_ids"] is already on the GPU

    Holds at most two batches on the device (the caller's and the one in flight). Each
    ``iter()`` starts a new pass over `loader`.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str | int | None = None):
        if not isinstance(loader, Iterable):
            raise ValueError(f"loader must be iterable, got {loader!r}")
        self.loader = loader
        self.device = _resolve(device)
        self._state: Any = None  # loader state as of the batch last handed over
        self._lookahead = False

    def __repr__(self) -> str:
        return f"DevicePrefetcher(device={self.device}, loader={self.loader!r})"

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self._state = None
        if self.device.type == "cpu":
            self._lookahead = False
            return iter(self.loader)
        if self.device.type != "cuda":
            self._lookahead = False
            return (move_to(batch, self.device) for batch in self.loader)
        self._lookahead = True
        return self._cuda_batches()

    def _loader_state(self) -> Any:
        state_dict = getattr(self.loader, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def _cuda_batches(self) -> Iterator[Any]:
        device = self.device
        copy_stream = torch.cuda.Stream(device)
        pending = iter(self.loader)

        def to_device(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type == "cpu" and not tensor.is_pinned():
                tensor = tensor.pin_memory()  # non_blocking copies need page-locked memory
            return tensor.to(device, non_blocking=True)

        def issue() -> tuple[bool, Any, Any]:
            """Start copying the next batch on the side stream; (found, batch, state)."""
            try:
                batch = next(pending)
            except StopIteration:
                return False, None, None
            state = self._loader_state()
            with torch.cuda.stream(copy_stream):
                batch = _apply(batch, to_device)
            return True, batch, state

        found, batch, state = issue()
        while found:
            compute_stream = torch.cuda.current_stream(device)
            # the caller's kernels must not start before the copy has landed
            compute_stream.wait_stream(copy_stream)
            for tensor in _tensors(batch):
                if tensor.device.type == "cuda":
                    # allocated on copy_stream, used on compute_stream: keep its memory
                    # reserved until the work queued there at free time is done
                    tensor.record_stream(compute_stream)
            current, before, self._state = batch, self._state, state
            try:
                found, batch, state = issue()  # overlaps with the caller's step on `current`
            except Exception:
                # the state already counts `current` as handed over: hand it over, then raise
                yield current
                raise
            except BaseException:
                # an interrupt leaves at once: `current` was never handed over, so neither is
                # it counted
                self._state = before
                raise
            yield current

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> Any:
        """The loader's state as of the last batch handed over (not the one in flight)."""
        if self._lookahead and self._state is not None:
            return self._state
        return self._loader_state()

    def load_state_dict(self, state: Any) -> None:
        load = getattr(self.loader, "load_state_dict", None)
        if not callable(load):
            raise TypeError(f"the loader {self.loader!r} has no load_state_dict()")
        self._state = None
        load(state)
