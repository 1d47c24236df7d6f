"""PadCollate and as_list: shapes, values, masks, options, errors, pickling, DataLoader use."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from streamds.train.collate import PadCollate, as_list


def test_pads_right_and_masks_real_tokens():
    collate = PadCollate(pad_id=0, keys=("input_ids", "labels"), pad_ids={"labels": -100})
    batch = collate([
        {"input_ids": [5, 6, 7], "labels": [1]},
        {"input_ids": [8], "labels": [2, 3]},
    ])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[1, -100], [2, 3]]
    assert batch["labels_mask"].tolist() == [[1, 0], [1, 1]]
    assert batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].dtype == torch.long


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 10_000), max_size=20), min_size=1, max_size=12),
       st.integers(-5, 5))
def test_every_row_is_the_sequence_then_padding(sequences, pad):
    batch = PadCollate(pad_id=pad, keys=("input_ids",))([{"input_ids": s} for s in sequences])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    width = max(map(len, sequences))
    assert ids.shape == mask.shape == (len(sequences), width)
    for row, seq in enumerate(sequences):
        assert ids[row, : len(seq)].tolist() == seq
        assert ids[row, len(seq) :].tolist() == [pad] * (width - len(seq))
        assert mask[row].tolist() == [1] * len(seq) + [0] * (width - len(seq))


def test_other_fields_are_gathered():
    batch = PadCollate(keys=("input_ids",))([
        {"input_ids": [1], "id": "a", "n": 3, "w": 0.5},
        {"input_ids": [2, 3], "id": "b", "n": 4, "w": 1.5},
    ])
    assert batch["id"] == ["a", "b"]
    assert batch["n"].tolist() == [3, 4]
    assert batch["w"].tolist() == [0.5, 1.5]
    dropped = PadCollate(keys=("input_ids",), passthrough=False)([{"input_ids": [1], "id": "a"}])
    assert set(dropped) == {"input_ids", "attention_mask"}


def test_max_length_and_multiple():
    collate = PadCollate(keys=("input_ids",), max_length=3, pad_to_multiple_of=4)
    batch = collate([{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [6, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_empty_sequences_and_mask_names():
    collate = PadCollate(keys=("input_ids", "labels"), mask_names={"labels": "decoder_mask"})
    batch = collate([{"input_ids": [], "labels": []}, {"input_ids": [], "labels": [4]}])
    assert batch["input_ids"].shape == (2, 0)
    assert batch["decoder_mask"].tolist() == [[0], [1]]


def test_errors_name_the_problem():
    with pytest.raises(KeyError, match=r"'labels'.*keys="):
        PadCollate()([{"input_ids": [1]}])
    with pytest.raises(ValueError, match="empty batch"):
        PadCollate()([])
    with pytest.raises(ValueError, match="keys must be a non-empty sequence"):
        PadCollate(keys="input_ids")
    with pytest.raises(ValueError, match="pad_ids names fields"):
        PadCollate(keys=("input_ids",), pad_ids={"labels": -100})
    with pytest.raises(ValueError, match="max_length"):
        PadCollate(max_length=0)


def test_pickles_and_works_in_worker_processes():
    collate = pickle.loads(pickle.dumps(PadCollate(pad_id=9, keys=("input_ids",))))
    assert collate([{"input_ids": [1, 2]}, {"input_ids": [3]}])["input_ids"].tolist() == [
        [1, 2], [3, 9]]
    data = [[{"input_ids": list(range(n))} for n in (1, 2, 3)], [{"input_ids": [7]}]]
    loader = DataLoader(data, batch_size=None, num_workers=1, collate_fn=collate)
    widths = [batch["input_ids"].shape[1] for batch in loader]
    assert widths == [3, 1]


def test_as_list_is_the_identity():
    batch = [{"a": 1}, {"a": 2}]
    assert as_list(batch) is batch
    assert pickle.loads(pickle.dumps(as_list)) is as_list


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dtype_and_lengths(dtype):
    collate = PadCollate(pad_id=0, keys=("input_ids", "labels"), pad_ids={"labels": -100},
                         dtype=dtype, lengths=True, max_length=3)
    batch = collate([
        {"input_ids": [5, 6, 7, 9], "labels": [1]},
        {"input_ids": [8], "labels": [2, 3]},
    ])
    for name in ("input_ids", "attention_mask", "lengths", "labels", "labels_mask",
                 "labels_lengths"):
        assert batch[name].dtype == dtype, name
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["lengths"].tolist() == [3, 1]  # after truncation to max_length
    assert batch["labels"].tolist() == [[1, -100], [2, 3]]
    assert batch["labels_lengths"].tolist() == [1, 2]
    assert batch["attention_mask"].sum(dim=1).tolist() == batch["lengths"].tolist()
    assert "lengths" not in PadCollate(keys=("input_ids",))([{"input_ids": [1]}])


def test_dtype_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"dtype must be torch\.int32 or torch\.int64"):
        PadCollate(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"does not fit in torch\.int32"):
        PadCollate(pad_id=2**40, dtype=torch.int32)
    with pytest.raises(ValueError, match="lengths must be True or False"):
        PadCollate(lengths=1)
