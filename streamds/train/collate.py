"""Collate: lists of records -> the batch a training step consumes.

`PadCollate` turns records holding token-id lists into right-padded int64 (or int32) tensors
plus masks and, on request, lengths; `as_list` hands the records over unchanged (for batches
built by `.batch(...)`, or for steps that do their own collation). Both pickle, so they work in
DataLoader workers under any start method.

Example::

    collate = PadCollate(pad_id=0, keys=("input_ids", "labels"), pad_ids={"labels": -100})
    batch = collate([{"input_ids": [5, 6, 7], "labels": [1]}, {"input_ids": [8], "labels": [2, 3]}])
    batch["input_ids"]       # tensor([[5, 6, 7], [8, 0, 0]])
    batch["attention_mask"]  # tensor([[1, 1, 1], [1, 0, 0]])
    batch["labels"]          # tensor([[1, -100], [2, 3]])
    batch["labels_mask"]     # tensor([[1, 0], [1, 1]])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checks import check_bool, check_optional_int, is_int

__all__ = ["PadCollate", "as_list"]


def as_list(batch: list[Any]) -> list[Any]:
    """The identity collate: the batch stays a list of records."""
    return batch


DTYPES = (torch.int32, torch.int64)


def _mask_name(key: str) -> str:
    return "attention_mask" if key == "input_ids" else f"{key}_mask"


def _lengths_name(key: str) -> str:
    return "lengths" if key == "input_ids" else f"{key}_lengths"


class PadCollate:
    """Pad the token-id lists under `keys` into ``(batch, longest)`` tensors of `dtype`.

    For each key `k` the batch holds `k` (padded with `pad_ids.get(k, pad_id)`) and a 0/1
    mask, named ``attention_mask`` for ``input_ids`` and ``f"{k}_mask"`` otherwise (rename
    with `mask_names`); with `lengths=True` also the ``(batch,)`` lengths after truncation,
    named ``lengths`` for ``input_ids`` and ``f"{k}_lengths"`` otherwise. `dtype` is
    ``torch.int64`` (what embedding layers and most losses take) or ``torch.int32`` (half the
    bytes through shared memory and to the GPU; ids below 2**31). `max_length` truncates
    longer sequences; `pad_to_multiple_of` rounds the padded width up (tensor cores like
    multiples of 8). Other fields are gathered into lists (ints and floats into tensors) unless
    `passthrough=False` drops them.

    Cost: one tensor allocation per key plus a copy of the ids; no Python loop per token.
    """

    def __init__(
        self,
        pad_id: int = 0,
        keys: Sequence[str] = ("input_ids", "labels"),
        *,
        pad_ids: Mapping[str, int] | None = None,
        mask_names: Mapping[str, str] | None = None,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        passthrough: bool = True,
        dtype: torch.dtype = torch.int64,
        lengths: bool = False,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(
                f"dtype must be torch.int32 or torch.int64, got {dtype!r}; token ids are integers"
            )
        check_bool("lengths", lengths)
        if not is_int(pad_id):
            raise ValueError(
                f"pad_id must be an int, got {pad_id!r}; pass the tokenizer's padding id"
            )
        if isinstance(keys, str) or not keys:
            raise ValueError(
                f"keys must be a non-empty sequence of field names, got {keys!r}; "
                "for one field write keys=('input_ids',)"
            )
        check_optional_int("max_length", max_length, 1, "use None to keep whole sequences")
        check_optional_int("pad_to_multiple_of", pad_to_multiple_of, 1,
                           "use None to pad to the longest sequence only")
        self.keys = tuple(keys)
        self.pad_ids = {key: pad_id for key in self.keys} | dict(pad_ids or {})
        unknown = sorted(set(self.pad_ids) - set(self.keys))
        if unknown:
            raise ValueError(f"pad_ids names fields {unknown} that are not in keys={self.keys}")
        limit = torch.iinfo(dtype)
        for key, pad in self.pad_ids.items():
            if not limit.min <= pad <= limit.max:
                raise ValueError(f"the pad id {pad} of {key!r} does not fit in {dtype}")
        self.mask_names = {key: _mask_name(key) for key in self.keys} | dict(mask_names or {})
        self.dtype = dtype
        self.lengths = lengths
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.passthrough = passthrough

    def __repr__(self) -> str:
        return f"PadCollate(keys={self.keys}, pad_ids={self.pad_ids}, dtype={self.dtype})"

    def _width(self, longest: int) -> int:
        multiple = self.pad_to_multiple_of
        if multiple is None:
            return longest
        return -(-longest // multiple) * multiple

    def _pad(
        self, key: str, sequences: list[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(padded ids, mask, lengths) of one key."""
        if self.max_length is not None:
            sequences = [seq[: self.max_length] for seq in sequences]
        dtype = self.dtype
        lengths = torch.tensor([len(seq) for seq in sequences], dtype=dtype)
        width = self._width(int(lengths.max()) if len(sequences) else 0)
        # mask[i, j] = j < len(seq_i); the ids land where the mask is set, in row order
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        out = torch.full((len(sequences), width), self.pad_ids[key], dtype=dtype)
        flat = [token for seq in sequences for token in seq]
        if flat:
            out[mask] = torch.tensor(flat, dtype=dtype)
        return out, mask.to(dtype), lengths

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not records:
            raise ValueError("cannot collate an empty batch")
        batch: dict[str, Any] = {}
        for key in self.keys:
            try:
                sequences = [record[key] for record in records]
            except KeyError:
                raise KeyError(
                    f"a record has no field {key!r} to pad (it has {sorted(records[0])}); "
                    "set keys= to the token-id fields your transform produces"
                ) from None
            batch[key], batch[self.mask_names[key]], lengths = self._pad(key, sequences)
            if self.lengths:
                batch[_lengths_name(key)] = lengths
        if self.passthrough:
            for key in records[0]:
                if key not in batch:
                    batch[key] = _gather([record.get(key) for record in records])
        return batch


def _gather(values: list[Any]) -> Any:
    """Numbers become a tensor; anything else stays a list."""
    if all(map(is_int, values)):
        return torch.tensor(values, dtype=torch.long)
    if all(isinstance(v, float) for v in values):
        return torch.tensor(values, dtype=torch.float32)
    return values
