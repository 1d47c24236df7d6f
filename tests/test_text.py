"""Tests for preprocess.text: summarisation transforms, usable at conversion and in-stream."""

from __future__ import annotations

import doctest
import pickle

import orjson
import pytest

import streamds.preprocess.text as text
from streamds import Storage
from streamds.preprocess.text import drop_short, select, strip_tags, summarisation, to_summarisation
from streamds.tools.synthetic import write_pubmed

RECORD = {
    "article_id": "PMC7",
    "article_text": ["Aspirin lowers fever .", "  ", "It is cheap .", "It is old ."],
    "abstract_text": ["<S> aspirin works . </S>", "<S> it is cheap . </S>"],
    "labels": None,
}


def test_docstring_examples():
    result = doctest.testmod(text)
    assert result.attempted >= 10 and result.failed == 0


def test_default_summarisation_joins_and_strips_tags():
    assert to_summarisation(RECORD) == {
        "id": "PMC7",
        "text": "Aspirin lowers fever . It is cheap . It is old .",
        "summary": "aspirin works . it is cheap .",
    }
    assert RECORD["abstract_text"][0] == "<S> aspirin works . </S>"  # input untouched


def test_truncation_lowercasing_and_minimums():
    by_sentences = summarisation(max_sentences=2, lower=True)(RECORD)
    assert by_sentences["text"] == "aspirin lowers fever ."  # the blank sentence is dropped
    assert summarisation(max_words=5)(RECORD)["text"] == "Aspirin lowers fever . It"
    assert summarisation(max_summary_words=2)(RECORD)["summary"] == "aspirin works"
    assert summarisation(min_words=13)(RECORD) is None
    assert summarisation(min_words=12)(RECORD) is not None  # 12 words, punctuation included
    assert summarisation(min_summary_words=8)(RECORD) is None
    assert "id" not in summarisation(id_field=None)(RECORD)
    empty = dict(RECORD, article_text=[])
    assert to_summarisation(empty) is None


def test_other_layouts_by_field_names():
    arxiv_like = {"paper": "one two three", "abstract": "<S> short </S>", "pid": 3}
    pair = summarisation(article_field="paper", abstract_field="abstract", id_field="pid")
    assert pair(arxiv_like) == {"id": 3, "text": "one two three", "summary": "short"}
    with pytest.raises(KeyError, match=r"'article_text'.*name the field"):
        to_summarisation(arxiv_like)


def test_factories_check_their_arguments():
    for kwargs, name in [({"max_words": 0}, "max_words"), ({"lower": "yes"}, "lower"),
                         ({"max_sentences": 1.5}, "max_sentences"),
                         ({"min_words": -1}, "min_words")]:
        with pytest.raises(ValueError, match=name):
            summarisation(**kwargs)
    with pytest.raises(ValueError, match="missing"):
        select("a", missing="ignore")
    with pytest.raises(ValueError, match="two fields to one name"):
        select("a", "b", rename={"a": "b"})
    with pytest.raises(ValueError, match="at least one"):
        select()


def test_select_renames_and_handles_missing_fields():
    assert select("labels", rename={"article_id": "id"})(RECORD) == {"labels": None, "id": "PMC7"}
    assert select("nope", missing="drop")(RECORD) is None
    assert select("nope", "labels", missing="null")(RECORD) == {"nope": None, "labels": None}
    with pytest.raises(KeyError, match="'nope'"):
        select("nope")(RECORD)


def test_drop_short_takes_strings_and_sentence_lists():
    assert drop_short("article_text", min_words=9)(RECORD) is RECORD
    assert drop_short("article_text", min_words=99)(RECORD) is None
    assert drop_short("x", min_words=2)({"x": "one"}) is None


def test_strip_tags_only_removes_markers():
    assert strip_tags("<S> a </S> <S> b </S>") == "a   b"
    assert strip_tags("x<y") == "x<y"


@pytest.mark.parametrize(
    "transform",
    [to_summarisation, summarisation(max_words=3, lower=True), select("article_id"),
     drop_short("article_text", 2)],
)
def test_transforms_pickle_for_dataloader_workers(transform):
    clone = pickle.loads(pickle.dumps(transform))
    assert clone == transform
    assert clone(RECORD) == transform(RECORD)


def test_in_stream_with_two_dataloader_workers(tmp_path):
    from torch.utils.data import DataLoader

    from streamds import StreamingJsonl

    path = tmp_path / "train.jsonl"
    write_pubmed(path, target_bytes=200_000, record_chars=1500)
    records = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    transform = summarisation(max_words=30, lower=True)
    ds = StreamingJsonl(path, storage=Storage(block_size=64 << 10)).map(transform)
    got = list(DataLoader(ds, batch_size=None, num_workers=2))
    expected = [transform(r) for r in records]
    assert sorted(got, key=lambda r: r["id"]) == sorted(expected, key=lambda r: r["id"])
    assert all(len(r["text"].split()) <= 30 and r["text"] == r["text"].lower() for r in got)
