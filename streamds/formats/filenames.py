"""File names: which files hold records, in what format, and which tar members are records.

One rule for every place that looks at names: the reader's directory listing
(`streamds.shards`), the converter's input walk (`preprocess.sources`), ``streamds verify``
(files a reader of the directory would read besides the manifest's), and the tar readers.
Imports only `streamds.formats.codecs`.
"""

from __future__ import annotations

from .codecs import codec_of, strip_codec

__all__ = [
    "MANIFEST_NAME",
    "RECORD_SUFFIXES",
    "TAR_LINES_MEMBERS",
    "TAR_RECORD_MEMBERS",
    "TAR_SUFFIXES",
    "format_of",
    "is_hidden",
    "is_record_name",
]

MANIFEST_NAME = "manifest.json"  # beside converted shards; never read as records
RECORD_SUFFIXES = (".json", ".jsonl", ".ndjson", ".tar", ".tgz")  # before any codec suffix
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

    Record suffixes, plain or compressed, count; hidden, ``_``-prefixed and ``.tmp`` files
    and the manifest do not.

    >>> names = ["a.jsonl", "b.json.gz", "c.ndjson.zst", "d.tgz", "e.tar.xz", "notes.txt",
    ...          ".f.jsonl", "_g.jsonl", ".shard-1.jsonl.zst.tmp", "manifest.json"]
    >>> [name for name in names if is_record_name(name)]
    ['a.jsonl', 'b.json.gz', 'c.ndjson.zst', 'd.tgz', 'e.tar.xz']
    """
    if is_hidden(name) or name.startswith("_") or name == MANIFEST_NAME or name.endswith(".tmp"):
        return False
    return name.endswith(RECORD_SUFFIXES) or strip_codec(name).endswith(RECORD_SUFFIXES)


def format_of(name: str) -> tuple[str, str | None]:
    """(format, codec) of a file name: format "tar" or "jsonl"; ``.tgz`` is a gzipped tar.

    >>> format_of("s.jsonl.zst"), format_of("s.tar.gz"), format_of("s.tgz"), format_of("s.txt")
    (('jsonl', 'zst'), ('tar', 'gz'), ('tar', 'gz'), ('jsonl', None))
    """
    if name.endswith(".tgz"):
        return "tar", "gz"
    base = strip_codec(name)
    return ("tar" if base.endswith(TAR_SUFFIXES) else "jsonl"), codec_of(name)
