"""`streamds.PackTokens`: fixed-length sequences that lose and repeat no token, and resume
exactly (mid-document) and elastically.

The arithmetic is checked with hypothesis over an in-memory stateful source; the pipeline
over `StreamingJsonl` and `Mix` sources with StatefulDataLoader and 0-3 workers. Token ids are
unique over the corpus (document d holds d * 1000 + 0, 1, ...), so a lost or repeated token
shows by its id.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import corpus
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resume_contract import run_test_save_load_state
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streamds import (
    Mix,
    PackTokens,
    StateMismatchError,
    StreamingJsonl,
    document_mask,
    merge_states,
    token_counts,
)
from streamds.datasets.pack import Packed

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

EOS = 7  # no document token is below 1000, so the separator is unambiguous
PAD = 3


class Documents:
    """An in-memory stateful source of token-id lists (state: the next index, and the epoch
    and finished flag that `Packed` reads, as in a StreamingJsonl or Mix state)."""

    rank = world_size = None
    epoch = 0

    def __init__(self, documents: list[list[int]]) -> None:
        self.documents = documents
        self.next = 0
        self._start = 0

    def __iter__(self) -> Iterator[list[int]]:
        self.next = self._start
        self._start = 0
        while self.next < len(self.documents):
            self.next += 1
            yield self.documents[self.next - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next, "epoch": 0, "finished": self.next == len(self.documents)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start = state["next"]

    def set_epoch(self, epoch: int) -> None:
        pass


def document(number: int, length: int) -> list[int]:
    return [number * 1000 + 1000 + k for k in range(length)]


def split_documents(sequences: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    """Concatenate the sequences, drop padding, split at the separators."""
    tokens = [t for seq in sequences
              for t, d in zip(seq["input_ids"].tolist(), seq["document_ids"].tolist(),
                              strict=True) if d >= 0]
    out, current = [], []
    for token in tokens:
        if token == EOS:
            out.append(current)
            current = []
        else:
            current.append(token)
    return out + ([current] if current else [])


lengths = st.lists(st.integers(0, 40), min_size=0, max_size=25)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths, seq_len=st.integers(1, 24), drop_last=st.booleans())
def test_packing_loses_and_repeats_no_token(lengths: list[int], seq_len: int,
                                            drop_last: bool) -> None:
    docs = [document(n, length) for n, length in enumerate(lengths)]
    packed = Packed(Documents(docs), PackTokens(seq_len, EOS, key=None, pad_id=PAD,
                                                drop_last=drop_last))
    sequences = list(packed)
    counts = packed.counts
    total = sum(lengths) + len(lengths)  # with one separator per document
    assert all(seq["input_ids"].shape == (seq_len,) for seq in sequences)
    assert counts["tokens"] == total and counts["documents"] == len(lengths)
    assert counts["packed"] + counts["dropped"] == total
    assert counts["sequences"] == len(sequences)
    assert counts["padded"] == len(sequences) * seq_len - counts["packed"]
    if drop_last:
        assert counts["padded"] == 0 and counts["dropped"] < seq_len
        kept = [t for seq in sequences for t in seq["input_ids"].tolist()]
        assert kept == [t for doc in docs for t in [*doc, EOS]][: total - counts["dropped"]]
    else:
        assert counts["dropped"] == 0 and counts["padded"] < max(seq_len, 1)
        assert split_documents(sequences) == docs
    for seq in sequences:  # positions restart with every document (piece) in a sequence
        positions, owners = seq["position_ids"].tolist(), seq["document_ids"].tolist()
        for k, (position, owner) in enumerate(zip(positions, owners, strict=True)):
            if owner < 0:
                assert seq["input_ids"][k] == PAD and position == 0
            elif k == 0 or owners[k - 1] != owner:
                assert position == 0 and owner == (owners[k - 1] + 1 if k else 0)
            else:
                assert position == positions[k - 1] + 1


def as_lists(sequences: list[dict[str, torch.Tensor]]) -> list[tuple[list[int], ...]]:
    return [tuple(seq[key].tolist() for key in ("input_ids", "position_ids", "document_ids"))
            for seq in sequences]


@settings(max_examples=40, deadline=None)
@given(lengths=lengths, seq_len=st.integers(1, 12), data=st.data())
def test_resume_mid_document_at_any_cut(lengths: list[int], seq_len: int,
                                        data: st.DataObject) -> None:
    docs = [document(n, length) for n, length in enumerate(lengths)]

    def make() -> Any:
        return _Lists(Packed(Documents(docs), PackTokens(seq_len, EOS, key=None)))

    reference = list(make())
    cuts = data.draw(st.lists(st.integers(0, len(reference)), max_size=4))
    run_test_save_load_state(make, cuts, after=lambda ds: ds.packed.counts)


class _Lists:
    """A packed dataset whose items compare with == (tensors do not)."""

    def __init__(self, packed: Packed) -> None:
        self.packed = packed

    def __iter__(self) -> Iterator[Any]:
        return iter(as_lists([seq])[0] for seq in self.packed)

    def state_dict(self) -> dict[str, Any]:
        return self.packed.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.packed.load_state_dict(state)


def test_document_mask_keeps_attention_within_documents() -> None:
    documents = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = document_mask(documents)[0]
    assert mask.shape == (6, 6)
    assert mask[1].tolist() == [True, True, False, False, False, False]
    assert mask[4].tolist() == [False, False, True, True, True, False]
    assert not mask[5].any()  # padding attends to nothing


# -- the pipeline: StreamingJsonl and Mix sources --------------------------------------------


def tokens_of(record: dict[str, Any]) -> dict[str, Any]:
    """A stand-in tokenizer: unique ids per record, lengths from 1 to 23."""
    return {"input_ids": document(record["id"], 1 + record["id"] * 7 % 23)}


def write_corpus(directory: Path, files: int, per_file: int, first: int) -> list[list[int]]:
    directory.mkdir(parents=True)
    for number in range(files):
        start = first + number * per_file
        corpus.write_plain(directory / f"part-{number}.jsonl",
                           corpus.jsonl(corpus.make_records(per_file, start=start)))
    ids = range(first, first + files * per_file)
    return [tokens_of({"id": i})["input_ids"] for i in ids]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[list[int]]]]:
    root = tmp_path_factory.mktemp("pack")
    return {"a": (str(root / "a"), write_corpus(root / "a", 4, 25, 0)),
            "b": (str(root / "b"), write_corpus(root / "b", 2, 20, 5000))}


def tokenized(path: str, **world: Any) -> StreamingJsonl:
    return StreamingJsonl(path, shuffle=True, seed=2, buffer_size=8, **world).map(tokens_of)


def packed(corpora, *, mixed: bool = False, **world: Any) -> Packed:
    packer = PackTokens(16, EOS, pad_id=PAD)
    if not mixed:
        return tokenized(corpora["a"][0], **world).pack(packer)
    sources = [tokenized(path, **world) for path, _ in corpora.values()]
    return Mix(sources, [0.6, 0.4], seed=4).pack(packer)


def input_ids(batch: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    """Collate to plain lists (module level, so workers can pickle it)."""
    return [seq["input_ids"].tolist() for seq in batch]


def every_token(docs: list[list[int]]) -> Counter[int]:
    return Counter(t for doc in docs for t in doc)


def real_tokens(batches: list[list[list[int]]]) -> Counter[int]:
    return Counter(t for batch in batches for seq in batch for t in seq if t >= 1000)


@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mix"])
def test_resume_at_every_batch_boundary(corpora, mixed: bool) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(packed(corpora, mixed=mixed), batch_size=3, collate_fn=input_ids)

    reference = list(make())
    run_test_save_load_state(make, range(len(reference) + 1), expected=reference)
    docs = corpora["a"][1] + (corpora["b"][1] if mixed else [])
    assert real_tokens(reference) == every_token(docs)  # Mix(stop="all"): every token once


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_resume_with_workers(corpora, workers: int) -> None:
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(packed(corpora, mixed=True), batch_size=3,
                                  num_workers=workers, collate_fn=input_ids)

    reference = run_test_save_load_state(make, [1, 4])
    assert real_tokens(reference) == every_token(corpora["a"][1] + corpora["b"][1])


def test_token_counts_of_a_loader_state(corpora) -> None:
    loader = StatefulDataLoader(packed(corpora), batch_size=4, num_workers=2,
                                collate_fn=input_ids)
    batches = list(loader)
    counts = token_counts(loader.state_dict())
    docs = corpora["a"][1]
    assert counts["documents"] == len(docs)
    assert counts["tokens"] == counts["packed"] == sum(len(d) + 1 for d in docs)
    assert counts["sequences"] == sum(len(batch) for batch in batches)
    assert counts["padded"] == 16 * counts["sequences"] - counts["packed"]
    assert counts["padded"] < 2 * 16  # one short sequence per worker at most


@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mix"])
def test_elastic_resume_packs_every_token_once(corpora, mixed: bool) -> None:
    consumed, states = [], []
    for rank in range(2):  # 2 ranks x 2 workers, stopped part-way
        loader = StatefulDataLoader(packed(corpora, mixed=mixed, rank=rank, world_size=2),
                                    batch_size=2, num_workers=2, collate_fn=input_ids)
        iterator = iter(loader)
        consumed += [next(iterator) for _ in range(2 + 3 * rank)]
        states.append(pickle.loads(pickle.dumps(loader.state_dict())))
        del iterator, loader
    merged = pickle.loads(pickle.dumps(merge_states(states)))
    assert merged["leftovers"]  # documents cut at a sequence's end carry over
    rest = []
    for rank in range(3):
        resumed = packed(corpora, mixed=mixed, rank=rank, world_size=3).with_resume(merged)
        rest += list(DataLoader(resumed, batch_size=2, num_workers=1, collate_fn=input_ids))
    docs = corpora["a"][1] + (corpora["b"][1] if mixed else [])
    assert real_tokens(consumed + rest) == every_token(docs)


@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mix"])
def test_exact_resume_after_an_elastic_resume(corpora, mixed: bool) -> None:
    """A checkpoint taken after an elastic resume, loaded where the script rebuilds the
    dataset the same way (with_resume(merged) again): the dealt leftovers come once, from the
    loaded state, not a second time from the merged one; a state taken before iterating holds
    them too."""
    consumed, states = [], []
    for rank in range(2):
        source = packed(corpora, mixed=mixed, rank=rank, world_size=2)
        iterator = iter(source)
        consumed += [next(iterator) for _ in range(3 + 2 * rank)]
        states.append(source.state_dict())
    merged = merge_states(states)
    assert merged["leftovers"]

    def make() -> Packed:
        return packed(corpora, mixed=mixed, rank=0, world_size=1).with_resume(merged)

    reference = as_lists(list(make()))
    docs = corpora["a"][1] + (corpora["b"][1] if mixed else [])
    assert real_tokens([[seq[0] for seq in as_lists(consumed)],
                        [seq[0] for seq in reference]]) == every_token(docs)
    cuts = range(0, len(reference) + 1, 4)
    run_test_save_load_state(lambda: _Lists(make()), cuts, expected=reference)
    before = make().state_dict()  # nothing read yet: the state still holds the deal
    plain = packed(corpora, mixed=mixed, rank=0, world_size=1)
    plain.load_state_dict(pickle.loads(pickle.dumps(before)))
    assert as_lists(list(plain)) == reference


def test_a_finished_state_starts_the_next_epoch_afresh(corpora) -> None:
    first = packed(corpora)
    list(first)
    state = first.state_dict()
    resumed = packed(corpora)
    resumed.load_state_dict(state)
    assert list(resumed) == []  # the same epoch: nothing left
    again = packed(corpora)
    again.load_state_dict(state)
    again.set_epoch(1)
    fresh = packed(corpora)
    fresh.set_epoch(1)
    assert as_lists(list(again)) == as_lists(list(fresh))
    assert again.counts == fresh.counts


def test_states_of_another_packing_are_refused(corpora) -> None:
    first = packed(corpora)
    next(iter(first))
    state = first.state_dict()
    other = tokenized(corpora["a"][0]).pack(PackTokens(32, EOS, pad_id=PAD))
    with pytest.raises(StateMismatchError, match="PackTokens settings"):
        other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="not a streamds packed dataset state"):
        packed(corpora).load_state_dict(state["source"])
    with pytest.raises(ValueError, match="with_resume needs"):
        packed(corpora).with_resume(state)


def test_bad_arguments_name_the_fix(corpora) -> None:
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1"):
        PackTokens(0, EOS)
    with pytest.raises(ValueError, match="eos_id must be an integer"):
        PackTokens(8, -1)
    with pytest.raises(ValueError, match=r"pack needs a streamds\.PackTokens"):
        tokenized(corpora["a"][0]).pack(16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="StatefulDataLoader"):
        packed(corpora).resume_after_batches(3, batch_size=4, num_workers=0)
    raw = StreamingJsonl(corpora["a"][0]).pack(PackTokens(8, EOS))
    with pytest.raises(ValueError, match=r"record\['input_ids'\] is not a list of token ids"):
        next(iter(raw))
