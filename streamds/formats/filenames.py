"""File names: which files hold records, in what format, and which tar members are records.

One rule for every place that looks at names: the reader's directory listing
(`streamds.storage.shards`), the converter's input walk (`preprocess.sources`), ``streamds verify``
(files a reader of the directory would read besides the manifest's), and the tar readers.
Imports only `streamds.formats.codecs`.
"""

from __future__ import annotations

import re

from .codecs import codec_of, strip_codec

__all__ = [
    "COLUMNAR_SUFFIXES",
    "FOREIGN_FORMATS",
    "MANIFEST_NAME",
    "RECORD_SUFFIXES",
    "TAR_LINES_MEMBERS",
    "TAR_RECORD_MEMBERS",
    "TAR_SUFFIXES",
    "copy_of",
    "foreign_format",
    "foreign_hint",
    "format_of",
    "is_hidden",
    "is_record_name",
    "left_out_reason",
    "sibling_key",
]

MANIFEST_NAME = "manifest.json"  # beside converted shards; never read as records
# before any codec suffix, matched in any case (A.JSONL, d.Jsonl, B.JSONL.GZ)
RECORD_SUFFIXES = (".json", ".jsonl", ".ndjson", ".jsonlines", ".ldjson", ".tar", ".tgz")
# columnar files streamds reads (`streamds.formats.parquet`, `.arrow`), never compressed
# on the outside (their pages are)
COLUMNAR_SUFFIXES = (".parquet", ".pq", ".arrow")
# data formats streamds does not read: suffix -> name in messages
FOREIGN_FORMATS = {
    ".feather": "Feather",
    ".avro": "Avro", ".orc": "ORC", ".csv": "CSV", ".tsv": "TSV",
}  # fmt: skip
_CONVERT_HINTS = {
    "Feather": "pandas.read_feather('x.feather').to_json('x.jsonl', orient='records', "
               "lines=True, force_ascii=False)",
    "CSV": "pandas.read_csv('x.csv').to_json('x.jsonl', orient='records', lines=True, "
           "force_ascii=False)",
}  # fmt: skip
TAR_SUFFIXES = (".tar", ".tgz")
TAR_RECORD_MEMBERS = (".json",)  # a tar member holding one record (webdataset layout)
TAR_LINES_MEMBERS = (".jsonl", ".ndjson")  # a tar member holding JSON lines


def is_hidden(name: str) -> bool:
    """Whether a listing skips `name` (a file or folder) unless it is spelled out.

    Hidden names start with a dot: ``.git``, ``.DS_Store``, and Colab's and Jupyter's
    ``.ipynb_checkpoints`` folders, whose ``*-checkpoint.*`` files are stale copies of the
    real ones. Directory listings skip them at any depth, and so do globs, whose wildcards
    match a hidden name only where the pattern spells the dot (``data/.ipynb_checkpoints/*``,
    ``data/.*.jsonl``), as in the shell.
    """
    return name.startswith(".")


def is_record_name(name: str) -> bool:
    """Whether a directory listing takes the file `name` (a base name) as records.

    Record suffixes, plain or compressed, in any case, count; hidden, ``_``-prefixed and
    ``.tmp`` files and the manifest do not (`left_out_reason` says why).

    >>> names = ["a.jsonl", "b.json.gz", "c.ndjson.zst", "d.tgz", "e.tar.xz", "notes.txt",
    ...          ".f.jsonl", "_g.jsonl", ".shard-1.jsonl.zst.tmp", "manifest.json", "H.JSONL.GZIP"]
    >>> [name for name in names if is_record_name(name)]
    ['a.jsonl', 'b.json.gz', 'c.ndjson.zst', 'd.tgz', 'e.tar.xz', 'H.JSONL.GZIP']
    """
    return left_out_reason(name) is None


def left_out_reason(name: str) -> str | None:
    """Why a directory listing does not take the file `name` (None: it takes it).

    >>> left_out_reason("A.JSONL.GZIP") is None, left_out_reason("notes.txt")[:25]
    (True, 'not a JSON lines name (.j')
    """
    lowered = name.lower()
    if is_hidden(name):
        return "hidden name (starts with '.'); name the file itself to read it"
    if name == MANIFEST_NAME:
        return "the shard manifest (read for shard sizes and record counts)"
    if name.startswith("_"):
        return "starts with '_' (a marker such as _SUCCESS); name the file itself to read it"
    if lowered.endswith(".tmp"):
        return "a temporary file (.tmp) of an unfinished copy or conversion"
    if lowered.endswith(RECORD_SUFFIXES) or strip_codec(lowered).endswith(RECORD_SUFFIXES):
        return None
    if lowered.endswith(COLUMNAR_SUFFIXES):
        return None
    kind = foreign_format(name)
    if kind is not None:
        return f"a {kind} file: {foreign_hint(kind)}"
    return (
        f"not a JSON lines name ({', '.join(RECORD_SUFFIXES)}, plain or .zst/.gz/.bz2/.xz, in "
        "any case); name the file itself to read it as JSON lines"
    )


def foreign_format(name: str) -> str | None:
    """The name of the data format streamds does not read that `name` says (Parquet, CSV ...).

    >>> foreign_format("part-0.ORC"), foreign_format("a.jsonl")
    ('ORC', None)
    """
    lowered = strip_codec(name).lower()
    for suffix, kind in FOREIGN_FORMATS.items():
        if lowered.endswith(suffix):
            return kind
    return None


def foreign_hint(kind: str) -> str:
    """What to do with a file in the data format `kind` (from `foreign_format`)."""
    how = _CONVERT_HINTS.get(kind)
    example = f", e.g. {how}" if how else ""
    return (
        f"streamds reads JSON lines, not {kind}; convert it to a .jsonl file first{example}, "
        "then read that (or `streamds convert` it into shards)"
    )


# Copies made by file managers and sync clients: Drive's "train (1).jsonl" and "Copy of
# train.jsonl", macOS's "train copy 2.jsonl", Windows's "train - Copy (2).jsonl", Dropbox's
# "train (conflicted copy 2024-01-01).jsonl", a browser's "train(1).jsonl".
_COPY_PREFIX = re.compile(r"^copy (?:\(\d+\) )?of ", re.IGNORECASE)
_COPY_SUFFIX = re.compile(
    r"(?: - copy(?: \(\d+\))?| copy(?: \d+)?| ?\(\d+\)| \([^()]*conflicted copy[^()]*\))$",
    re.IGNORECASE,
)


def _split_suffixes(name: str) -> tuple[str, str]:
    """(stem, record and codec suffixes): "a (1).jsonl.gz" -> ("a (1)", ".jsonl.gz")."""
    base = strip_codec(name)
    lowered = base.lower()
    for suffix in RECORD_SUFFIXES:
        if lowered.endswith(suffix):
            return base[: -len(suffix)], name[len(base) - len(suffix) :]
    return base, name[len(base) :]


def copy_of(name: str) -> str | None:
    """The name `name` was copied from, when it is spelled like a copy; else None.

    >>> copy_of("train (1).jsonl"), copy_of("Copy of train.jsonl.gz"), copy_of("train.jsonl")
    ('train.jsonl', 'train.jsonl.gz', None)
    """
    stem, suffixes = _split_suffixes(name)
    original = _COPY_SUFFIX.sub("", _COPY_PREFIX.sub("", stem))
    return f"{original}{suffixes}" if original and original != stem else None


def sibling_key(name: str) -> str:
    """What two names in one folder share when one may be a copy of the other: the name
    without codec suffix and copy marks, in lower case. ``a.jsonl``, ``a.jsonl.gz``,
    ``A (1).JSONL`` and ``Copy of a.jsonl`` share one key."""
    return strip_codec(copy_of(name) or name).lower()


def format_of(name: str) -> tuple[str, str | None]:
    """(format, codec) of a file name: format "tar" or "jsonl"; ``.tgz`` is a gzipped tar.

    >>> format_of("s.jsonl.zst"), format_of("s.tar.gz"), format_of("s.tgz"), format_of("s.txt")
    (('jsonl', 'zst'), ('tar', 'gz'), ('tar', 'gz'), ('jsonl', None))
    """
    if name.lower().endswith(".tgz"):
        return "tar", "gz"
    base = strip_codec(name).lower()
    return ("tar" if base.endswith(TAR_SUFFIXES) else "jsonl"), codec_of(name)
