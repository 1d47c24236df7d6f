"""streamds.formats.filenames: one rule for which files hold records, shared by reader and
converter."""

from __future__ import annotations

import doctest
import os
from pathlib import Path

import pytest

from streamds.formats import codecs, filenames
from streamds.formats.filenames import format_of, is_record_name
from streamds.formats.manifest import Manifest, write_manifest
from streamds.preprocess.sources import Inputs
from streamds.storage.shards import resolve_shards
from streamds.tools.cli import main

NAMES = [
    "a.jsonl", "b.json", "c.ndjson", "d.tar", "e.tgz",  # records, plain
    "f.jsonl.zst", "g.json.gz", "h.ndjson.bz2", "i.tar.xz", "j.jsonl.zstd",  # compressed
    "A.JSONL", "B.Json.GZIP", "c.NDJSON.ZSTD", "m.jsonlines.bzip2", "n.LDJSON", "O.TGZ",  # cases
    "train.txt", "notes.md", "k.zst", "l.tgz.tmp", "p.orc", "q.CSV",  # not record names
    "p.parquet", "r.arrow",  # columnar: records
    ".hidden.jsonl", "_SUCCESS", "_meta.jsonl", ".shard-000001.jsonl.zst.tmp", "manifest.json",
]  # fmt: skip
RECORDS = {"a.jsonl", "b.json", "c.ndjson", "d.tar", "e.tgz", "f.jsonl.zst", "g.json.gz",
           "h.ndjson.bz2", "i.tar.xz", "j.jsonl.zstd", "A.JSONL", "B.Json.GZIP", "c.NDJSON.ZSTD",
           "m.jsonlines.bzip2", "n.LDJSON", "O.TGZ", "p.parquet", "r.arrow"}  # fmt: skip


def test_record_names():
    assert {name for name in NAMES if is_record_name(name)} == RECORDS


@pytest.mark.parametrize(
    ("name", "expected"),
    [("a.jsonl", ("jsonl", None)), ("train.txt", ("jsonl", None)),
     ("f.jsonl.zst", ("jsonl", "zst")), ("j.jsonl.zstd", ("jsonl", "zst")),
     ("d.tar", ("tar", None)), ("e.tgz", ("tar", "gz")), ("i.tar.xz", ("tar", "xz")),
     ("x.tgz.gz", ("tar", "gz")), ("g.json.gz", ("jsonl", "gz")),
     ("A.JSONL.GZ", ("jsonl", "gz")), ("b.jsonl.gzip", ("jsonl", "gz")),
     ("c.ndjson.bzip2", ("jsonl", "bz2")), ("D.TAR.XZ", ("tar", "xz")), ("e.TGZ", ("tar", "gz"))],
)  # fmt: skip
def test_format_and_codec(name, expected):
    assert format_of(name) == expected


def test_reader_converter_and_verify_agree_on_a_directory(tmp_path: Path, capsys):
    """The reader lists, the converter walks and verify flags exactly the record names."""
    root = tmp_path / "tree"
    root.mkdir()
    for name in NAMES:  # contents are never read: listing only
        (root / name).write_bytes(b"")
    listed = {os.path.basename(shard.path) for shard in _listing(root)}
    walked = {leaf.rel[-1] for leaf in Inputs([root]).leaves() if leaf.rel}
    assert listed == walked == RECORDS

    write_manifest(root, Manifest(shard_format="jsonl.zst", shards=(), counts={}, options={},
                                  inputs=()))
    assert main(["verify", str(root), "--quiet"]) == 1
    out = capsys.readouterr().out
    flagged = {line.split()[1].rstrip(":") for line in out.splitlines()
               if line.startswith("UNLISTED")}
    assert flagged == RECORDS


def _listing(root: Path):
    from unittest import mock

    # the listing decides by name; skip opening files (empty .zst have no seek table)
    from streamds.formats.columnar import Layout

    # Parquet and Arrow footers are read when resolving: these empty files have none
    with mock.patch("streamds.formats.jsonl_zst.read_seek_table", return_value=None), \
            mock.patch("streamds.formats.parquet.layout", return_value=Layout((), ())), \
            mock.patch("streamds.formats.arrow.layout", return_value=Layout((), ())):
        return resolve_shards(str(root))


def test_docstring_examples():
    results = [doctest.testmod(filenames), doctest.testmod(codecs)]
    assert sum(r.attempted for r in results) >= 4 and sum(r.failed for r in results) == 0
