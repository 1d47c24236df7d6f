"""Text preprocessing for summarisation corpora in the PubMed / arXiv layout (Cohan et al. 2018).

A record there holds ``article_text`` (a list of body sentences), ``abstract_text`` (a list
of ``"<S> sentence . </S>"`` strings), ``article_id`` and section fields. Everything here is
a pure function of one record, usable in two places:

- at conversion: ``streamds convert ... --transform streamds.preprocess.text:to_summarisation`` or,
  configured, ``--transform 'streamds.preprocess.text:summarisation(max_words=512, lower=True)'``;
- in the stream: ``StreamingJsonl(path, transform=summarisation(max_words=512))`` or
  ``ds.map(select("article_id", rename={"article_id": "id"}))``.

Configurable transforms are frozen dataclasses with ``__call__``, made by small factories that
check their arguments: they pickle, so they run in DataLoader worker processes. A transform
returns the new record, or None to drop it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamds.checks import check_bool, check_choice, check_int, check_optional_int

__all__ = [
    "DropShort",
    "Select",
    "Summarisation",
    "drop_short",
    "join_sentences",
    "select",
    "strip_tags",
    "summarisation",
    "to_summarisation",
    "truncate_sentences",
    "truncate_words",
    "word_count",
]

_TAGS = ("<S>", "</S>")
_MISSING = ("raise", "drop", "null")
_NO_LIMIT = "use None for no limit"
_KEEP_ALL = "use 0 to keep every record"


def strip_tags(sentence: str) -> str:
    """``sentence`` without the ``<S>`` / ``</S>`` sentence markers and outer spaces.

    >>> strip_tags("<S> we evaluated the effect of x on y . </S>")
    'we evaluated the effect of x on y .'
    """
    for tag in _TAGS:
        sentence = sentence.replace(tag, "")
    return sentence.strip()


def join_sentences(sentences: Sequence[str] | str, sep: str = " ") -> str:
    """One string from a list of sentences (stripped, empty ones left out); a string passes.

    >>> join_sentences(["the first .", "  ", "the second ."])
    'the first . the second .'
    """
    if isinstance(sentences, str):
        return sentences.strip()
    return sep.join(s for s in (sentence.strip() for sentence in sentences) if s)


def word_count(text: str) -> int:
    """Whitespace-separated words in ``text``.

    >>> word_count("a b  c")
    3
    """
    return len(text.split())


def truncate_words(text: str, max_words: int) -> str:
    """The first ``max_words`` words of ``text``, joined by single spaces.

    >>> truncate_words("one two three four", 2)
    'one two'
    """
    words = text.split(maxsplit=max_words)
    return " ".join(words[:max_words])


def truncate_sentences(sentences: Sequence[str], max_sentences: int) -> list[str]:
    """The first ``max_sentences`` sentences.

    >>> truncate_sentences(["a .", "b .", "c ."], 2)
    ['a .', 'b .']
    """
    return list(sentences[:max_sentences])


def _field(record: Any, name: str) -> Any:
    if not isinstance(record, dict):
        raise TypeError(f"expected a JSON object (dict) record, got {type(record).__name__}")
    try:
        return record[name]
    except KeyError:
        raise KeyError(
            f"record has no {name!r} field (it has {sorted(record)[:8]}); name the field "
            "that holds it in the transform's arguments"
        ) from None


@dataclass(frozen=True)
class Summarisation:
    """A PubMed/arXiv record -> ``{"id": ..., "text": article, "summary": abstract}`` or None.

    The article's sentences (after ``max_sentences``) are joined; the abstract's ``<S>``
    tags are stripped; both are optionally lower-cased and cut to ``max_words`` /
    ``max_summary_words`` words. Records whose text or summary has fewer than
    ``min_words`` / ``min_summary_words`` words are dropped (None). Build it with
    `summarisation`.
    """

    lower: bool = False
    max_sentences: int | None = None
    max_words: int | None = None
    max_summary_words: int | None = None
    min_words: int = 1
    min_summary_words: int = 1
    article_field: str = "article_text"
    abstract_field: str = "abstract_text"
    id_field: str | None = "article_id"

    def __call__(self, record: dict[str, Any]) -> dict[str, Any] | None:
        sentences = _field(record, self.article_field)
        if self.max_sentences is not None and not isinstance(sentences, str):
            sentences = truncate_sentences(sentences, self.max_sentences)
        text = join_sentences(sentences)
        abstract = _field(record, self.abstract_field)
        if isinstance(abstract, str):
            summary = strip_tags(abstract)
        else:
            summary = join_sentences([strip_tags(s) for s in abstract])
        if self.lower:
            text, summary = text.lower(), summary.lower()
        if self.max_words is not None:
            text = truncate_words(text, self.max_words)
        if self.max_summary_words is not None:
            summary = truncate_words(summary, self.max_summary_words)
        if word_count(text) < self.min_words or word_count(summary) < self.min_summary_words:
            return None
        out: dict[str, Any] = {}
        if self.id_field is not None:
            out["id"] = _field(record, self.id_field)
        out["text"] = text
        out["summary"] = summary
        return out


def summarisation(
    *,
    lower: bool = False,
    max_sentences: int | None = None,
    max_words: int | None = None,
    max_summary_words: int | None = None,
    min_words: int = 1,
    min_summary_words: int = 1,
    article_field: str = "article_text",
    abstract_field: str = "abstract_text",
    id_field: str | None = "article_id",
) -> Summarisation:
    """A checked `Summarisation` transform; ``id_field=None`` leaves the id out.

    >>> to_pair = summarisation(max_words=4, lower=True)
    >>> to_pair({"article_id": "PMC1", "article_text": ["Aspirin lowers fever .", "It is old ."],
    ...          "abstract_text": ["<S> aspirin works . </S>"]})
    {'id': 'PMC1', 'text': 'aspirin lowers fever .', 'summary': 'aspirin works .'}
    >>> to_pair({"article_id": "PMC2", "article_text": [], "abstract_text": ["<S> x </S>"]})
    """
    check_bool("lower", lower)
    check_optional_int("max_sentences", max_sentences, 1, _NO_LIMIT)
    check_optional_int("max_words", max_words, 1, _NO_LIMIT)
    check_optional_int("max_summary_words", max_summary_words, 1, _NO_LIMIT)
    check_int("min_words", min_words, 0, _KEEP_ALL)
    check_int("min_summary_words", min_summary_words, 0, _KEEP_ALL)
    return Summarisation(lower, max_sentences, max_words, max_summary_words, min_words,
                         min_summary_words, article_field, abstract_field, id_field)


to_summarisation = Summarisation()
"""The default `Summarisation`: ``--transform streamds.preprocess.text:to_summarisation``."""


@dataclass(frozen=True)
class Select:
    """Keep `fields` (in that order), renamed by `rename`; see `select`."""

    fields: tuple[str, ...]
    rename: tuple[tuple[str, str], ...] = ()
    missing: str = "raise"

    def __call__(self, record: dict[str, Any]) -> dict[str, Any] | None:
        names = dict(self.rename)
        out: dict[str, Any] = {}
        for name in self.fields:
            if name in record:
                out[names.get(name, name)] = record[name]
            elif self.missing == "drop":
                return None
            elif self.missing == "null":
                out[names.get(name, name)] = None
            else:
                _field(record, name)
        return out


def select(
    *fields: str, rename: Mapping[str, str] | None = None, missing: str = "raise"
) -> Select:
    """Keep only `fields` (plus the keys of `rename`), renaming per `rename`.

    `missing` says what a record lacking a field gets: "raise" (KeyError naming the field),
    "drop" (the record is dropped) or "null" (the field is None).

    >>> pick = select("abstract_text", rename={"article_id": "id"})
    >>> pick({"article_id": "PMC1", "abstract_text": ["<S> a . </S>"], "labels": None})
    {'abstract_text': ['<S> a . </S>'], 'id': 'PMC1'}
    """
    rename = dict(rename or {})
    keep = tuple(fields) + tuple(name for name in rename if name not in fields)
    if not keep:
        raise ValueError("select needs at least one field name, e.g. select('text')")
    check_choice("missing", missing, _MISSING)
    targets = [rename.get(name, name) for name in keep]
    if len(set(targets)) != len(targets):
        raise ValueError(f"rename maps two fields to one name: {targets}")
    return Select(keep, tuple(rename.items()), missing)


@dataclass(frozen=True)
class DropShort:
    """Drop records whose `field` has fewer than `min_words` words; see `drop_short`."""

    field: str
    min_words: int

    def __call__(self, record: dict[str, Any]) -> dict[str, Any] | None:
        value = _field(record, self.field)
        text = value if isinstance(value, str) else join_sentences(value or [])
        return record if word_count(text) >= self.min_words else None


def drop_short(field: str = "text", min_words: int = 1) -> DropShort:
    """A filter: the record when `field` (a string or a list of sentences) is long enough.

    >>> keep = drop_short("text", min_words=3)
    >>> keep({"text": "too short"}) is None, keep({"text": "long enough now"})
    (True, {'text': 'long enough now'})
    """
    check_int("min_words", min_words, 0, _KEEP_ALL)
    return DropShort(field, min_words)
