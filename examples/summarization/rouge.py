"""ROUGE-N and ROUGE-L (Lin, 2004), small and dependency-free.

Tokenisation follows the ``rouge_score`` package without stemming: lower-case, every run of
characters other than ``a-z0-9`` is a separator. Scores are F1 (precision and recall weighed
equally), reported x100 by `corpus_rouge`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

_SEPARATORS = re.compile(r"[^a-z0-9]+")

__all__ = ["corpus_rouge", "lcs_length", "rouge_l", "rouge_n", "score", "tokenize"]


def tokenize(text: str) -> list[str]:
    return [token for token in _SEPARATORS.split(text.lower()) if token]


def _f1(overlap: float, candidate: int, reference: int) -> tuple[float, float, float]:
    precision = overlap / candidate if candidate else 0.0
    recall = overlap / reference if reference else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def _ngrams(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def rouge_n(
    candidate: Sequence[str], reference: Sequence[str], n: int
) -> tuple[float, float, float]:
    """(precision, recall, F1) of the n-grams the candidate shares with the reference."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    cand, ref = _ngrams(candidate, n), _ngrams(reference, n)
    overlap = sum((cand & ref).values())
    return _f1(overlap, sum(cand.values()), sum(ref.values()))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence; O(len(a) * len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, 1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l(candidate: Sequence[str], reference: Sequence[str]) -> tuple[float, float, float]:
    """(precision, recall, F1) of the longest common subsequence."""
    return _f1(lcs_length(candidate, reference), len(candidate), len(reference))


def score(candidate: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F1 of one candidate against one reference, in [0, 1]."""
    cand, ref = tokenize(candidate), tokenize(reference)
    return {
        "rouge1": rouge_n(cand, ref, 1)[2],
        "rouge2": rouge_n(cand, ref, 2)[2],
        "rougeL": rouge_l(cand, ref)[2],
    }


def corpus_rouge(pairs: Iterable[tuple[str, str]]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 x100 over (candidate, reference) pairs."""
    totals: Counter[str] = Counter()
    count = 0
    for candidate, reference in pairs:
        totals.update(score(candidate, reference))
        count += 1
    return {name: 100 * totals[name] / count if count else 0.0
            for name in ("rouge1", "rouge2", "rougeL")}
