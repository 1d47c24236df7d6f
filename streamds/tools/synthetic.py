"""Synthetic corpora in the layout of the PubMed / arXiv summarisation sets (Cohan et al. 2018).

Each line of a ``train.txt`` is one JSON object, in this key order::

    {"article_id": "PMC0000042",
     "article_text": ["sentence", ...],             # every body sentence, in order
     "abstract_text": ["<S> sentence . </S>", ...],
     "labels": null,                                 # null, as in the released files
     "section_names": ["INTRODUCTION", ...],
     "sections": [["sentence", ...], ...]}           # article_text split by section

Text is lower-cased and tokenised with spaces around punctuation, as in the released files.
Every article has a topic (four made-up medical terms) that its sentences keep mentioning; a
few salient sentences (the aim at the end of the introduction, findings in the results and
discussion, the conclusion) carry only topic terms, and the abstract is a shortened rewrite
of exactly those sentences. Lead-3 therefore overlaps the abstract but misses most of it, and
copying words from the article pays off. The vocabulary is fixed (about 2,800 word types),
so a tokenizer trained on one split covers every other. Being template text, it compresses
far better than real papers (about 13x with zstd level 3), which matters when benchmarking
compressed shards.

Output depends only on the arguments: randomness comes from ``random.Random(seed)``, and
nothing iterates a set or a hash-ordered container. Generation runs at about 100 MB/s on one
core: sentences are built from pre-combined templates with one ``str.format`` call each.

Command line::

    streamds synthetic pubmed train.jsonl.zst --bytes 1GB
    streamds synthetic small-lines lines.jsonl --bytes 256MB
    streamds synthetic splits pubmed-dataset --train 2000 --val 200 --test 200
    streamds synthetic splits arxiv-dataset --layout arxiv --train 2000 --val 20 --test 20
    streamds synthetic small-files many-files --records 100000
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import orjson
import zstandard

from ..units import size_argument

__all__ = [
    "arxiv_record",
    "main",
    "pubmed_record",
    "write_arxiv_splits",
    "write_pubmed",
    "write_pubmed_splits",
    "write_small_files",
    "write_small_lines",
]

# --- vocabulary (fixed: the same for every seed) -------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_PREFIXES = _words(
    "adren angi arthr bronch cardi cerebr chondr col cyt derm encephal endocrin fibr gastr glyc "
    "hem hepat hyal immun kerat leuk lip lymph mening my nephr neur onc oste pancreat path prot "
    "pulmon retin scler ser thromb thyr tox vas"
)
_LINKS = ("o", "a", "i", "e", "")
_SUFFIXES = _words(
    "algia ase blast cept cillin cyte dine dronate ectomy emia gen genesis inib ine itis kinase "
    "lukast lysin lytic mab mycin ol oma omab osis parin pathy phage philia plasty pril sartan "
    "statin tide trophin tropin vir xaban zole zumab"
)


def _make_terms() -> tuple[str, ...]:
    """1,800 made-up medical words plus 200 gene-like names, in a fixed order."""
    rng = random.Random(20180601)
    words = sorted({p + link + s for p in _PREFIXES for link in _LINKS for s in _SUFFIXES})
    terms = dict.fromkeys(rng.sample(words, 1800))
    letters = "bcdfghjklmnprstvwxz"
    genes: dict[str, None] = {}
    while len(genes) < 200:
        stem = "".join(rng.choice(letters) for _ in range(rng.randint(2, 3)))
        genes[f"{stem}{rng.randint(1, 9)}"] = None
    return tuple(terms) + tuple(g for g in genes if g not in terms)


_TERMS = _make_terms()
_NOUNS = _words(
    "patients participants subjects children adults women men mice rats cells samples cases "
    "controls infants volunteers individuals donors recipients survivors smokers athletes "
    "students residents outpatients inpatients neonates adolescents nurses veterans pregnancies"
)
_ADJECTIVES = _words(
    "significant marked modest substantial moderate slight consistent notable pronounced "
    "considerable critical central key major minor potential novel protective detrimental "
    "robust transient sustained limited strong weak clinical relevant important early late"
)
_NUMBERS = tuple(str(i) for i in range(2, 200))

# --- sentence templates --------------------------------------------------------------------
# Slots: {0} {1} {2} terms, {3} a plural noun, {4} a number, {5} an adjective. A template may
# leave slots out; str.format ignores unused positional arguments.

_OPENERS = (
    "", "", "", "", "in addition , ", "moreover , ", "however , ", "notably , ",
    "interestingly , ", "as expected , ", "furthermore , ", "importantly , ", "in particular , ",
)  # fmt: skip
_CLOSERS = (
    "", "", "", "", " [ {4} ]", " ( table 2 )", " ( figure 3 )", " ( p < 0.05 )",
    " in this cohort", " in our series",
)  # fmt: skip

_CLAUSES = {
    "introduction": (
        "{0} is a common {5} disorder that affects millions of {3} worldwide",
        "{0} remains a major cause of morbidity and mortality among {3}",
        "the pathophysiology of {0} is not fully understood",
        "previous studies have linked {0} to {1} and {2}",
        "several mechanisms have been proposed to explain the association between {0} and {1}",
        "{0} has been implicated in the regulation of {1} signaling",
        "the prevalence of {0} has increased over the past {4} years",
        "current guidelines recommend {0} as first - line therapy for {1}",
        "little is known about the role of {0} in {3} with {1}",
        "recent evidence suggests that {1} may contribute to the development of {0}",
        "{0} is characterized by {5} {1} and progressive {2}",
        "the incidence of {0} varies widely across regions and populations",
        "early diagnosis of {0} is essential to prevent {1}",
        "{0} and {1} share several common risk factors",
        "despite advances in treatment , outcomes for {3} with {0} remain poor",
    ),
    "methods": (
        "a total of {4} {3} were enrolled in this study",
        "{3} were randomly assigned to receive {0} or placebo",
        "the study was approved by the local ethics committee",
        "written informed consent was obtained from all {3}",
        "serum levels of {0} were measured using a commercial elisa kit",
        "{1} was assessed at baseline and after {4} weeks",
        "samples were stored at -80 c until analysis",
        "statistical analysis was performed using spss version {4}",
        "data are expressed as mean and standard deviation",
        "{3} with a history of {1} or {2} were excluded",
        "the primary outcome was the change in {0} from baseline",
        "{0} expression was quantified by real - time pcr",
        "western blot analysis was performed with antibodies against {0} and {1}",
        "a p value of less than 0.05 was considered statistically significant",
        "{3} received {4} mg of {0} daily",
        "the diagnosis of {1} was based on clinical and radiological criteria",
        "tissue sections were stained with {0} and examined under a light microscope",
        "follow - up visits were scheduled every {4} months",
    ),
    "results": (
        "the mean age of the {3} was {4} years",
        "{0} levels were higher in the {1} group than in controls",
        "no significant difference in {1} was observed between the groups",
        "{4} {3} developed {1} during follow - up",
        "{0} was detected in {4} % of the samples",
        "the incidence of {1} was lower in {3} treated with {0}",
        "{0} treatment led to a {5} decrease in {1}",
        "there was a {5} correlation between {0} and {2}",
        "the median duration of {1} was {4} days",
        "adverse events were mild and resolved without {0}",
        "{1} scores improved from baseline in both groups",
        "{0} and {1} were positively correlated in {3} with {2}",
        "expression of {2} did not differ between {3} with and without {1}",
        "the overall response rate was {4} %",
        "{3} in the {0} group showed {5} changes in {1}",
    ),
    "discussion": (
        "the present study examined the relationship between {0} and {1}",
        "our results are consistent with previous reports on {1}",
        "one possible explanation is that {0} modulates {1} through {2}",
        "these findings should be interpreted with caution",
        "this study has several limitations",
        "first , the sample size was relatively small",
        "second , we did not measure {2} in all {3}",
        "{0} may exert a {5} effect on {1} by inhibiting {2}",
        "further studies are needed to clarify the role of {1} in {2}",
        "similar observations have been reported in {3} with {2}",
        "the mechanism underlying the effect of {0} on {1} remains unclear",
        "in contrast to earlier studies , we found no association between {1} and {2}",
        "{2} is known to interact with {1} in several tissues",
    ),
    "conclusion": (
        "larger prospective studies are warranted",
        "these data support the use of {0} in clinical practice",
        "{0} should be considered in {3} with {1}",
        "the long - term effects of {0} on {1} deserve further study",
    ),
    "case": (
        "a {4} - year - old woman presented with {1} and {2}",
        "physical examination revealed {5} {1}",
        "laboratory tests showed elevated {0}",
        "the patient was treated with {0} and recovered uneventfully",
        "biopsy confirmed the diagnosis of {1}",
        "at {4} months of follow - up , there was no recurrence of {1}",
    ),
}


def _combine(clauses: Sequence[str]) -> tuple[str, ...]:
    """Every opener x clause x closer, each ending in " ."."""
    return tuple(o + c + e + " ." for o in _OPENERS for c in clauses for e in _CLOSERS)


_TEMPLATES = {kind: _combine(clauses) for kind, clauses in _CLAUSES.items()}
_ALL_TEMPLATES = tuple(itertools.chain.from_iterable(_TEMPLATES.values()))

# Salient sentences: (as written in the article, as rewritten in the abstract). Slots {0}-{2}
# always hold topic terms, so these are the sentences densest in the topic.
_AIM = (
    "the aim of this study was to evaluate the effect of {0} on {1} in {3} with {2} .",
    "we evaluated the effect of {0} on {1} in {3} with {2} .",
)
_FINDINGS = (
    (
        "treatment with {0} resulted in a {5} reduction of {1} levels in {3} with {2} .",
        "{0} reduced {1} levels in {3} with {2} .",
    ),
    (
        "we found that {0} is a {5} predictor of {1} in {3} with {2} .",
        "{0} predicts {1} in {3} with {2} .",
    ),
    (
        "the expression of {0} was higher in {3} with {1} than in those without {1} .",
        "{0} expression was higher in {3} with {1} .",
    ),
    (
        "these results suggest that {0} plays a {5} role in the pathogenesis of {1} and {2} .",
        "{0} plays a {5} role in {1} and {2} .",
    ),
    (
        "overall , {4} {3} with {1} received {0} and {2} during the follow - up period .",
        "{4} {3} with {1} received {0} and {2} .",
    ),
    (
        "inhibition of {0} attenuated {1} - induced {2} in a dose - dependent manner .",
        "inhibition of {0} attenuated {1} - induced {2} .",
    ),
    (
        "{0} was associated with a {5} improvement in {1} scores among {3} with {2} .",
        "{0} improved {1} scores in {3} with {2} .",
    ),
    (
        "levels of {0} correlated with {1} severity ( r = 0.{4} , p < 0.001 ) .",
        "{0} levels correlated with {1} severity .",
    ),
    (
        "in multivariate analysis , {0} and {1} remained independent risk factors for {2} .",
        "{0} and {1} were independent risk factors for {2} .",
    ),
    (
        "compared with placebo , {0} lowered the incidence of {1} among {3} at risk of {2} .",
        "{0} lowered the incidence of {1} in {3} at risk of {2} .",
    ),
)
_CONCLUSIONS = (
    (
        "in conclusion , our findings indicate that {0} may be a {5} therapeutic target for {1} .",
        "{0} may be a therapeutic target for {1} .",
    ),
    (
        "in conclusion , {0} appears to be safe and effective in the management of {1} .",
        "{0} is safe and effective for {1} .",
    ),
)

# Section layouts, as (kind, share of the article). Names are styled per article.
_LAYOUTS = (
    (("introduction", 0.15), ("materials and methods", 0.25), ("results", 0.30),
     ("discussion", 0.25), ("conclusion", 0.05)),
    (("background", 0.15), ("methods", 0.25), ("results", 0.30), ("discussion", 0.30)),
    (("introduction", 0.20), ("methods", 0.25), ("results", 0.30), ("discussion", 0.25)),
    (("introduction", 0.25), ("case report", 0.35), ("discussion", 0.35), ("conclusion", 0.05)),
)  # fmt: skip
# arXiv papers: lower-case section names, as in the released arXiv set
_ARXIV_LAYOUTS = (
    (("introduction", 0.20), ("the model", 0.30), ("results", 0.30), ("conclusions", 0.20)),
    (("introduction", 0.25), ("numerical results", 0.45), ("discussion", 0.20),
     ("summary", 0.10)),
    (("introduction", 0.15), ("method", 0.35), ("results", 0.35), ("conclusions", 0.15)),
)  # fmt: skip
_KIND = {
    "the model": "methods",
    "method": "methods",
    "numerical results": "results",
    "conclusions": "conclusion",
    "summary": "conclusion",
    "introduction": "introduction",
    "background": "introduction",
    "materials and methods": "methods",
    "methods": "methods",
    "results": "results",
    "discussion": "discussion",
    "conclusion": "conclusion",
    "case report": "case",
}
_ABSTRACT_LABELS = ("background : ", "results : ", "conclusions : ")
_AVG_TERM = sum(map(len, _TERMS)) / len(_TERMS)
_EST_LEN = {  # rough characters per sentence, to size the first batch
    kind: sum(map(len, t)) / len(t) + 2 * _AVG_TERM for kind, t in _TEMPLATES.items()
}


def _fill(rng: random.Random, templates: Sequence[str], terms: Sequence[str], n: int) -> list[str]:
    """``n`` sentences: random templates, term slots drawn from ``terms``."""
    it = iter(rng.choices(terms, k=3 * n))
    return [
        t.format(a, b, c, d, e, f)
        for t, a, b, c, d, e, f in zip(
            rng.choices(templates, k=n),
            it,
            it,
            it,
            rng.choices(_NOUNS, k=n),
            rng.choices(_NUMBERS, k=n),
            rng.choices(_ADJECTIVES, k=n),
            strict=True,
        )
    ]


def _section(rng: random.Random, kind: str, terms: Sequence[str], quota: int) -> list[str]:
    """Filler sentences of one section kind, totalling ``quota`` characters or a little more."""
    templates = _TEMPLATES[kind]
    out: list[str] = []
    total = 0
    while total < quota:
        batch = _fill(rng, templates, terms, int((quota - total) / _EST_LEN[kind]) + 1)
        for i, s in enumerate(batch):
            total += len(s)
            if total >= quota:
                del batch[i + 1 :]
                break
        out += batch
    return out


def _salient(rng: random.Random, pair: tuple[str, str], topic: Sequence[str]) -> tuple[str, str]:
    """One salient sentence and its abstract rewrite, both filled with the same topic terms."""
    a, b, c = rng.sample(topic, 3)
    slots = (a, b, c, rng.choice(_NOUNS), rng.choice(_NUMBERS), rng.choice(_ADJECTIVES))
    return pair[0].format(*slots), pair[1].format(*slots)


def pubmed_record(
    rng: random.Random, index: int, *, target_chars: int = 20_000, id_prefix: str = "PMC"
) -> dict:
    """One article whose ``article_text`` totals about ``target_chars`` characters.

    The id is ``f"{id_prefix}{index:07d}"``. Consumes ``rng``; the record depends only on
    the rng's state, ``index`` and the keywords. About 2.1 x ``target_chars`` bytes as JSON.
    Every section gets at least one sentence, so articles stay above ~400 characters even for
    smaller targets. The abstract has 3 to 8 sentences (more for longer articles).
    """
    if target_chars < 100:
        raise ValueError(f"target_chars must be >= 100, got {target_chars}")
    section_names, sections, abstract = _article(rng, target_chars, _LAYOUTS, styled=True)
    if rng.random() < 0.5:  # structured abstract, as in about half of PubMed
        abstract[0] = _ABSTRACT_LABELS[0] + abstract[0]
        abstract[len(abstract) // 2] = _ABSTRACT_LABELS[1] + abstract[len(abstract) // 2]
        abstract[-1] = _ABSTRACT_LABELS[2] + abstract[-1]
    return {
        "article_id": f"{id_prefix}{index:07d}",
        "article_text": list(itertools.chain.from_iterable(sections)),
        "abstract_text": [f"<S> {s} </S>" for s in abstract],
        "labels": None,
        "section_names": section_names,
        "sections": sections,
    }


def arxiv_record(rng: random.Random, index: int, *, target_chars: int = 20_000) -> dict:
    """One paper in the layout of the arXiv summarisation set: the PubMed keys, lower-case
    section names of a physics paper, numbers as ``@xmath<k>`` placeholders and ``@xcite``
    citation marks as in the released files, and ids like ``"1001.0042"``.

    Consumes ``rng``; depends only on its state, ``index`` and ``target_chars``.
    """
    if target_chars < 100:
        raise ValueError(f"target_chars must be >= 100, got {target_chars}")
    section_names, sections, abstract = _article(rng, target_chars, _ARXIV_LAYOUTS,
                                                 styled=False)
    math = itertools.count()
    sections = [[_arxiv_sentence(rng, sentence, math) for sentence in section]
                for section in sections]
    abstract = [_arxiv_sentence(rng, sentence, math, cite=False) for sentence in abstract]
    return {
        "article_id": f"{1001 + index // 10_000:04d}.{index % 10_000:04d}",
        "article_text": list(itertools.chain.from_iterable(sections)),
        "abstract_text": [f"<S> {s} </S>" for s in abstract],
        "labels": None,
        "section_names": section_names,
        "sections": sections,
    }


def _arxiv_sentence(rng: random.Random, sentence: str, math: Iterator[int], *,
                    cite: bool = True) -> str:
    """Numbers -> ``@xmath<k>`` (k counts up through the paper); some sentences cite."""
    words = [f"@xmath{next(math)}" if word.isdigit() else word for word in sentence.split(" ")]
    if cite and rng.random() < 0.2 and words[-1] == ".":
        words.insert(len(words) - 1, "@xcite")
    return " ".join(words)


def _article(
    rng: random.Random, target_chars: int, layouts: Sequence[tuple[tuple[str, float], ...]], *,
    styled: bool,
) -> tuple[list[str], list[list[str]], list[str]]:
    """(section names, sections of sentences, abstract sentences) of one article; `styled`:
    section names styled per article (PubMed), else as they are (arXiv)."""
    topic = rng.sample(_TERMS, 4)
    background = rng.sample(_TERMS, 24)
    pool = topic * 2 + background  # a quarter of term slots name the topic
    layout = rng.choice(layouts)
    style = rng.randrange(4) if styled else 3
    n_findings = min(6, max(1, target_chars // 4000))
    findings = [_salient(rng, p, topic) for p in rng.sample(_FINDINGS, n_findings)]
    conclusion = _salient(rng, rng.choice(_CONCLUSIONS), topic)
    aim = _salient(rng, _AIM, topic)

    section_names: list[str] = []
    sections: list[list[str]] = []
    abstract: list[str] = []
    # Findings are dealt round-robin to the results and discussion sections.
    hosts = [i for i, (name, _) in enumerate(layout) if _KIND[name] in ("results", "discussion")]
    hosted: list[list[tuple[str, str]]] = [[] for _ in layout]
    for k, pair in enumerate(findings):
        hosted[hosts[k % len(hosts)]].append(pair)
    written = 0
    cumulative = 0.0
    for i, (name, share) in enumerate(layout):
        kind = _KIND[name]
        salient = hosted[i] + [aim] * (i == 0) + [conclusion] * (i == len(layout) - 1)
        # Quotas are cumulative, so a section absorbs the overshoot of the ones before it.
        cumulative += share
        quota = int(target_chars * cumulative) - written - sum(len(long) for long, _ in salient)
        sents = _section(rng, kind, pool, quota)
        if not sents and (i == 0 or not salient):
            sents = _fill(rng, _TEMPLATES[kind], pool, 1)
        for pair in hosted[i]:
            sents.insert(rng.randrange(len(sents) + 1), pair[0])
        if i == 0:
            # lead sentence about the topic, aims at the end of the introduction
            sents[0] = (rng.choice(_CLAUSES["introduction"]) + " .").format(
                *topic[:3], rng.choice(_NOUNS), rng.choice(_NUMBERS), rng.choice(_ADJECTIVES)
            )
            sents.append(aim[0])
        if i == len(layout) - 1:
            sents.insert(0 if kind == "conclusion" else len(sents), conclusion[0])
        written += sum(map(len, sents))
        order = {s: k for k, s in enumerate(sents)}
        abstract += [short for long, short in sorted(salient, key=lambda p: order[p[0]])]
        section_names.append(_style_name(name, i, style))
        sections.append(sents)
    return section_names, sections, abstract


def _style_name(name: str, position: int, style: int) -> str:
    if style == 0:
        return name.upper()
    if style == 1:
        return name.capitalize()
    if style == 2:
        return f"{position + 1}. {name.title()}"
    return name


# --- writers -------------------------------------------------------------------------------


@contextlib.contextmanager
def _output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary writer for ``path``: zstd level 3 for .zst, gzip level 6 for .gz, else plain.

    Writes to ``path + ".tmp"`` and renames on success, so an interrupted run never leaves a
    truncated file under the final name. The gzip header carries no name and mtime 0, so
    equal content gives equal bytes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as raw:
            if path.suffix == ".zst":
                with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as w:
                    yield w
            elif path.suffix == ".gz":
                with gzip.GzipFile(
                    filename="", mode="wb", compresslevel=6, fileobj=raw, mtime=0
                ) as w:
                    yield w
            else:
                yield raw
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_min(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _write_records(
    out: BinaryIO,
    rng: random.Random,
    start: int,
    *,
    target_bytes: int | None,
    records: int | None,
    record_chars: int,
    id_prefix: str,
    kind: str = "pubmed",
) -> int:
    """Write records until ``target_bytes`` (uncompressed) or ``records`` is reached."""
    written = 0
    size = 0
    buf: list[bytes] = []
    buffered = 0
    while (target_bytes is None or size < target_bytes) and (records is None or written < records):
        if kind == "arxiv":
            record = arxiv_record(rng, start + written, target_chars=record_chars)
        else:
            record = pubmed_record(rng, start + written, target_chars=record_chars,
                                   id_prefix=id_prefix)
        line = orjson.dumps(record)
        buf.append(line)
        buffered += len(line) + 1
        size += len(line) + 1
        written += 1
        if buffered >= 1 << 22:
            buf.append(b"")
            out.write(b"\n".join(buf))
            buf, buffered = [], 0
    if buf:
        buf.append(b"")
        out.write(b"\n".join(buf))
    return written


def write_pubmed(
    path: str | os.PathLike,
    *,
    target_bytes: int,
    seed: int = 0,
    record_chars: int = 20_000,
    id_prefix: str = "PMC",
) -> int:
    """Write PubMed-layout JSONL to ``path`` until it holds >= ``target_bytes``; return records.

    ``target_bytes`` counts uncompressed bytes, so the file stops within one record (about
    2.1 x ``record_chars`` bytes) past it. A ``.zst`` path is zstd level 3, ``.gz`` gzip level
    6; both decompress to the plain file's exact bytes, and both are byte-identical per seed.
    """
    _check_min("target_bytes", target_bytes, 0)
    _check_min("record_chars", record_chars, 100)
    with _output(path) as out:
        return _write_records(
            out,
            random.Random(seed),
            0,
            target_bytes=target_bytes,
            records=None,
            record_chars=record_chars,
            id_prefix=id_prefix,
        )


def write_pubmed_splits(
    directory: str | os.PathLike,
    *,
    train_records: int,
    val_records: int,
    test_records: int,
    seed: int = 0,
    record_chars: int = 4000,
) -> dict[str, Path]:
    """Write ``train.txt``, ``val.txt`` and ``test.txt`` under ``directory``, like the real sets.

    Each split has its own rng (seeded from ``seed`` and the split name) and its own id range
    (train first, then val, then test), so no id repeats across splits. Returns split -> path.
    """
    return _write_splits(directory, "pubmed", train_records=train_records,
                         val_records=val_records, test_records=test_records, seed=seed,
                         record_chars=record_chars)


def write_arxiv_splits(
    directory: str | os.PathLike,
    *,
    train_records: int,
    val_records: int,
    test_records: int,
    seed: int = 0,
    record_chars: int = 4000,
) -> dict[str, Path]:
    """`write_pubmed_splits` for the arXiv layout (`arxiv_record`); the rngs are seeded
    apart from PubMed's, so the two corpora differ for one seed."""
    return _write_splits(directory, "arxiv", train_records=train_records,
                         val_records=val_records, test_records=test_records, seed=seed,
                         record_chars=record_chars)


def _write_splits(
    directory: str | os.PathLike, kind: str, *, train_records: int, val_records: int,
    test_records: int, seed: int, record_chars: int,
) -> dict[str, Path]:
    counts = {"train": train_records, "val": val_records, "test": test_records}
    for split, n in counts.items():
        _check_min(f"{split}_records", n, 0)
    _check_min("record_chars", record_chars, 100)
    paths: dict[str, Path] = {}
    start = 0
    for split, n in counts.items():
        paths[split] = Path(directory) / f"{split}.txt"
        with _output(paths[split]) as out:
            _write_records(
                out,
                random.Random(f"{seed}/{split}" if kind == "pubmed" else f"{kind}/{seed}/{split}"),
                start,
                target_bytes=None,
                records=n,
                record_chars=record_chars,
                id_prefix="PMC",
                kind=kind,
            )
        start += n
    return paths


def write_small_files(
    directory: str | os.PathLike,
    *,
    records: int,
    per_folder: int = 3000,
    seed: int = 0,
    record_chars: int = 2000,
) -> int:
    """Write one PubMed-layout record per file: ``directory/part_000/00000000.json``, ...

    The layout many users start from (e.g. 100,000 files in folders of 3,000). File ``i`` is
    ``part_{i // per_folder:03d}/{i:08d}.json`` and holds one JSON line. Returns files written.
    """
    _check_min("records", records, 0)
    _check_min("per_folder", per_folder)
    _check_min("record_chars", record_chars, 100)
    rng = random.Random(seed)
    root = Path(directory)
    folder = root
    for i in range(records):
        if i % per_folder == 0:
            folder = root / f"part_{i // per_folder:03d}"
            folder.mkdir(parents=True, exist_ok=True)
        line = orjson.dumps(pubmed_record(rng, i, target_chars=record_chars))
        (folder / f"{i:08d}.json").write_bytes(line + b"\n")
    return records


_N_CLASSES = 8
_CLASS_TERMS = tuple(_TERMS[k * 32 : (k + 1) * 32] for k in range(_N_CLASSES))


def write_small_lines(
    path: str | os.PathLike, *, target_bytes: int, seed: int = 0, line_bytes: int = 300
) -> int:
    """Write ``{"id": int, "text": str, "label": int}`` lines of at most ``line_bytes`` bytes.

    Lines run a word or so short of ``line_bytes`` (text is cut at a space). ``label`` is one
    of 8 classes and the text's terms come from that class's own 32 terms, so a bag-of-words
    classifier can learn it. Stops once >= ``target_bytes`` (uncompressed); returns lines.
    Compression by suffix as in :func:`write_pubmed`.
    """
    _check_min("target_bytes", target_bytes, 0)
    _check_min("line_bytes", line_bytes, 64)
    rng = random.Random(seed)
    # One running text per class; each line takes the next sentences of its class's text, cut
    # at a space, and the rest of the cut sentence is skipped so every line starts a sentence.
    streams = [""] * _N_CLASSES
    offsets = [0] * _N_CLASSES
    written = size = 0
    with _output(path) as out:
        buf: list[bytes] = []
        while size < target_bytes:
            label = rng.randrange(_N_CLASSES)
            head = f'{{"id":{written},"text":"'
            tail = f'","label":{label}}}'
            budget = line_bytes - 1 - len(head) - len(tail)
            stream, off = streams[label], offsets[label]
            if off + 2 * budget + 200 > len(stream):
                more = _fill(rng, _ALL_TEMPLATES, _CLASS_TERMS[label], 64 + budget // 20)
                stream, off = " ".join([stream[off:], *more]).lstrip(), 0
                streams[label] = stream
            cut = stream.rfind(" ", off, off + budget + 1)
            if cut <= off:  # no space within budget: cut mid-word
                cut = off + budget
            text = stream[off:cut]
            nxt = stream.find(" . ", cut - 2)
            offsets[label] = nxt + 3 if nxt >= 0 else len(stream)
            line = (head + text + tail).encode()
            buf.append(line)
            size += len(line) + 1
            written += 1
            if len(buf) >= 16384:
                buf.append(b"")
                out.write(b"\n".join(buf))
                buf = []
        if buf:
            buf.append(b"")
            out.write(b"\n".join(buf))
    return written


# --- command line --------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """``streamds synthetic {pubmed,small-lines,splits,small-files} OUT ...``."""
    parser = argparse.ArgumentParser(
        prog="streamds synthetic", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pubmed", help="one JSONL file of PubMed-layout records (.zst/.gz ok)")
    p.add_argument("out")
    p.add_argument("--bytes", type=size_argument, required=True, help="e.g. 1GB, 256MB, 10KB")
    p.add_argument("--record-chars", type=int, default=20_000)
    p.add_argument("--id-prefix", default="PMC")
    s = sub.add_parser("small-lines", help='one JSONL file of ~300-byte {"id","text","label"}')
    s.add_argument("out")
    s.add_argument("--bytes", type=size_argument, required=True)
    s.add_argument("--line-bytes", type=int, default=300)
    t = sub.add_parser("splits", help="train.txt, val.txt, test.txt like the released sets")
    t.add_argument("out")
    t.add_argument("--train", type=int, required=True)
    t.add_argument("--val", type=int, required=True)
    t.add_argument("--test", type=int, required=True)
    t.add_argument("--record-chars", type=int, default=4000)
    t.add_argument("--layout", choices=("pubmed", "arxiv"), default="pubmed",
                   help="the PubMed or the arXiv summarisation set's records")
    f = sub.add_parser("small-files", help="one JSON file per record, in folders")
    f.add_argument("out")
    f.add_argument("--records", type=int, required=True)
    f.add_argument("--per-folder", type=int, default=3000)
    f.add_argument("--record-chars", type=int, default=2000)
    for command in (p, s, t, f):
        command.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        if args.command == "pubmed":
            n = write_pubmed(
                args.out,
                target_bytes=args.bytes,
                seed=args.seed,
                record_chars=args.record_chars,
                id_prefix=args.id_prefix,
            )
            what = f"{n} records"
        elif args.command == "small-lines":
            n = write_small_lines(
                args.out, target_bytes=args.bytes, seed=args.seed, line_bytes=args.line_bytes
            )
            what = f"{n} lines"
        elif args.command == "splits":
            write_splits = write_arxiv_splits if args.layout == "arxiv" else write_pubmed_splits
            paths = write_splits(
                args.out,
                train_records=args.train,
                val_records=args.val,
                test_records=args.test,
                seed=args.seed,
                record_chars=args.record_chars,
            )
            what = ", ".join(str(p) for p in paths.values())
        else:
            n = write_small_files(
                args.out,
                records=args.records,
                per_folder=args.per_folder,
                seed=args.seed,
                record_chars=args.record_chars,
            )
            what = f"{n} files"
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {what} to {args.out} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
