"""The data side of the example: find or generate the corpus, clean text, train a tokenizer,
and turn raw PubMed/arXiv records into token ids inside the DataLoader workers.

Records come in the layout of the released PubMed/arXiv sets (Cohan et al. 2018):
``article_text`` is a list of sentences, ``abstract_text`` a list of ``"<S> ... </S>"``
strings. Everything here is a plain function of the record, so the streamed pipeline stays
deterministic and resumes exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from streamds import StreamingJsonl

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
SPECIALS = [PAD, UNK, BOS, EOS]  # ids 0, 1, 2, 3
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(4)

_MARKUP = re.compile(r"</?S>|@x(?:math|cite)\d*|\[\s*(?:\d+\s*[,-]?\s*)+\]")
_SPACES = re.compile(r"\s+")


def clean(text: str) -> str:
    """Drop sentence tags, ``@xmath``/``@xcite`` placeholders and citation brackets."""
    return _SPACES.sub(" ", _MARKUP.sub(" ", text)).strip()


def article_text(record: dict[str, Any]) -> str:
    return clean(" ".join(record["article_text"]))


def abstract_text(record: dict[str, Any]) -> str:
    return clean(" ".join(record["abstract_text"]))


def lead(record: dict[str, Any], sentences: int = 3) -> str:
    """The first `sentences` sentences of the article: the lead-3 baseline."""
    return clean(" ".join(record["article_text"][:sentences]))


# -- where the data comes from ------------------------------------------------------------


def find_splits(data: str | Path) -> dict[str, str]:
    """Map split -> source for a directory of ``train.txt``/``val.txt``/``test.txt`` files
    (the released layout) or of ``train/``, ``val/``, ``test/`` shard directories
    (``streamds convert`` output). ``validation`` is accepted for ``val``."""
    root = Path(data)
    if not root.is_dir():
        raise FileNotFoundError(f"--data {data!r} is not a directory")
    splits: dict[str, str] = {}
    for split, names in {"train": ["train"], "val": ["val", "validation", "valid"],
                         "test": ["test"]}.items():
        for name in names:
            for candidate in (root / f"{name}.txt", root / f"{name}.jsonl", root / name):
                if candidate.exists():
                    splits[split] = str(candidate)
                    break
            if split in splits:
                break
    if "train" not in splits:
        raise FileNotFoundError(
            f"{data}: no train.txt, train.jsonl or train/ found; point --data at the folder "
            "holding the PubMed/arXiv splits"
        )
    if "val" not in splits and "test" not in splits:
        raise FileNotFoundError(f"{data}: no val or test split found for evaluation")
    return splits


LAYOUTS = ("pubmed", "arxiv")  # the synthetic generator's layouts (streamds.tools.synthetic)


def generate_splits(directory: Path, *, train: int, val: int, test: int, seed: int,
                    record_chars: int, layout: str = "pubmed") -> dict[str, str]:
    """Write a synthetic corpus in the PubMed or arXiv layout (streamds.tools.synthetic), or reuse
    it."""
    from streamds.tools.synthetic import write_arxiv_splits, write_pubmed_splits

    write = write_arxiv_splits if layout == "arxiv" else write_pubmed_splits
    marker = directory / "corpus.txt"
    spec = f"train={train} val={val} test={test} seed={seed} chars={record_chars}\n"
    if layout != "pubmed":
        spec = f"layout={layout} {spec}"
    if not (marker.exists() and marker.read_text() == spec):
        write(directory, train_records=train, val_records=val, test_records=test, seed=seed,
              record_chars=record_chars)
        marker.write_text(spec)
    return {split: str(directory / f"{split}.txt") for split in ("train", "val", "test")}


def parse_mix(text: str) -> list[list[Any]]:
    """``"pubmed:0.7,arxiv:0.3"`` -> ``[["pubmed", 0.7], ["arxiv", 0.3]]`` (for ``--mix``)."""
    parts: list[list[Any]] = []
    for item in text.split(","):
        name, sep, weight = item.strip().partition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not sep or not name or not value > 0:
            raise ValueError(
                f"--mix {text!r}: {item!r} is not NAME:WEIGHT with a weight > 0; e.g. "
                "--mix pubmed:0.7,arxiv:0.3"
            )
        parts.append([name, value])
    names = [name for name, _ in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"--mix {text!r}: a corpus is named twice")
    return parts


# -- tokenizer ------------------------------------------------------------------------------


class TrainingText:
    """Record -> the text a tokenizer learns from (article and abstract)."""

    def __call__(self, record: dict[str, Any]) -> str:
        return article_text(record) + "\n" + abstract_text(record)


def train_tokenizer(source: str | list[str], path: Path, *, vocab_size: int,
                    records: int) -> Tokenizer:
    """A WordPiece tokenizer learned from the first `records` records, streamed (no download)."""
    tokenizer = Tokenizer(models.WordPiece(unk_token=UNK, max_input_chars_per_word=40))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                        min_frequency=2, show_progress=False)
    texts: Iterator[str] = iter(StreamingJsonl(source).map(TrainingText()))
    tokenizer.train_from_iterator(islice(texts, records), trainer=trainer, length=records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


class Featurize:
    """Record -> ``{"article_id", "input_ids", "labels"}``; runs in the DataLoader workers.

    The source is the cleaned article cut to `max_source` tokens; the labels are the abstract
    cut to `max_target - 1` tokens plus ``[EOS]``. With ``keep_text=True`` the reference
    abstract and the lead-3 baseline ride along, for evaluation; with `corpus` set, its name
    does (``"corpus"``: which corpus of a mix the record came from). The tokenizer loads lazily,
    once per worker, so the object pickles as a path and two integers.
    """

    def __init__(self, tokenizer_path: str | Path, *, max_source: int, max_target: int,
                 keep_text: bool = False, corpus: str | None = None) -> None:
        self.tokenizer_path = str(tokenizer_path)
        self.corpus = corpus
        self.max_source = max_source
        self.max_target = max_target
        self.keep_text = keep_text
        self._tokenizer: Tokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_file(self.tokenizer_path)
        return self._tokenizer

    def __call__(self, record: dict[str, Any]) -> dict[str, Any] | None:
        source, target = article_text(record), abstract_text(record)
        if not source or not target:
            return None  # dropped (and counted) by the stream
        ids = self.tokenizer.encode(source).ids[: self.max_source]
        labels = [*self.tokenizer.encode(target).ids[: self.max_target - 1], EOS_ID]
        out: dict[str, Any] = {"article_id": record["article_id"], "input_ids": ids,
                               "labels": labels}
        if self.corpus is not None:
            out["corpus"] = self.corpus
        if self.keep_text:
            out["reference"] = target
            out["lead3"] = lead(record)
        return out
