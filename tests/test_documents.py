"""JSON documents and JSON lines, decided per file by one rule (issue 9, part 2).

The rule (`streamds.formats.documents`): a ``.json`` file whose first line does not hold a
whole JSON value (a pretty-printed document), or whose first line is all it holds, is one
document, and an array document is its elements; any other file is JSON lines, whatever its
name. The reader and the converter share the rule, so they read the same records; the reader
keeps every guarantee on documents (exactly once over any world, exact resume).
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from resume_contract import run_test_save_load_state
from torch.utils.data import DataLoader

from streamds import CorruptRecordError, StreamingJsonl
from streamds.formats.manifest import read_manifest
from streamds.preprocess.convert import convert
from streamds.preprocess.sources import Inputs, Position

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def pretty(path: Path, value: Any) -> Path:
    """`json.dump(value, f, indent=2)`: how the summarisation seed writes one file per article."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        json.dump(value, f, indent=2)
    return path


def lines(path: Path, values: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(value) + b"\n" for value in values))
    return path


def converted(source: list[Any], out: Path, **options: Any) -> list[Any]:
    convert(source, out, shard_size=1 << 20, **options)
    import zstandard

    records = []
    for entry in read_manifest(out).shards:
        data = zstandard.ZstdDecompressor().stream_reader(
            (out / entry.name).read_bytes(), read_across_frames=True
        ).read()
        records += [orjson.loads(line) for line in data.splitlines() if line]
    return records


# -- the rule -------------------------------------------------------------------------------

LAYOUTS = {
    "pretty object": (b'{\n  "a": 1\n}\n', "document"),
    "pretty array": (b'[\n  {"a": 1},\n  {"a": 2}\n]\n', "document"),
    "one-line array": (b'[{"a": 1}, {"a": 2}]', "document"),
    "one-line object": (b'{"a": 1}\n', "document"),
    "object split after a key": (b'{"a": 1,\n "b": 2}\n', "document"),
    "lines": (b'{"a": 1}\n{"a": 2}\n', "lines"),
    "lines of arrays": (b"[1, 2]\n[3]\n", "lines"),
    "lines with CRLF": (b'{"a": 1}\r\n{"a": 2}\r\n', "lines"),
    "lines after blank lines": (b'\n\n{"a": 1}\n\n{"a": 2}', "lines"),
    "bom then pretty": (b'\xef\xbb\xbf{\n "a": 1\n}', "document"),
    "empty": (b"", "lines"),
    "blank": (b" \n\t\n", "lines"),
    "garbage first line": (b'oops\n{"a": 1}\n', "lines"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_rule(name):
    from streamds.formats.documents import layout, probe

    head, expected = LAYOUTS[name]
    assert layout(head, at_end=True) == expected
    pieces = iter([head[i : i + 3] for i in range(0, len(head), 3)])  # decided read by read
    assert probe(lambda size: next(pieces, b""))[0] == expected


# -- the reader -------------------------------------------------------------------------------


@pytest.fixture
def articles(tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    """A folder of one pretty-printed article per file, in nested folders."""
    records = [{"article_id": i, "abstract": f"abstract {i}", "sections": [["s", i]]}
               for i in range(12)]
    for record in records:
        pretty(tmp_path / "data" / f"part_{record['article_id'] // 5}" /
               f"{record['article_id']:04d}.json", record)
    return tmp_path / "data", records


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_folder_of_pretty_printed_files_reads_one_record_per_file(articles, on_error):
    folder, records = articles
    ds = StreamingJsonl(folder, on_error=on_error)
    assert list(ds) == records  # under skip: every record, not 0
    assert ds.counts.get("bad", 0) == 0


def test_array_document_is_its_elements(tmp_path):
    elements = [{"id": i, "text": "x" * i} for i in range(7)]
    pretty(tmp_path / "array.json", elements)
    (tmp_path / "compact.json").write_bytes(orjson.dumps(elements[:2]))
    assert list(StreamingJsonl(tmp_path / "array.json")) == elements
    assert list(StreamingJsonl(tmp_path / "compact.json")) == elements[:2]
    (tmp_path / "empty-array.json").write_text("[]")
    assert list(StreamingJsonl(tmp_path / "empty-array.json")) == []


def test_json_lines_in_a_json_file_are_lines(tmp_path):
    values = [{"id": i} for i in range(5)]
    lines(tmp_path / "train.json", values)  # what datasets.Dataset.to_json writes
    assert list(StreamingJsonl(tmp_path / "train.json")) == values


def test_large_json_lines_file_splits_across_readers(tmp_path):
    values = [{"id": i, "pad": "p" * 100} for i in range(3000)]  # ~350 KB
    path = lines(tmp_path / "train.json", values)
    ds = StreamingJsonl(path)
    assert ds.shards[0].format.name == "jsonl"  # decided when resolved: byte-range blocks
    from streamds.storage.plan import make_blocks

    assert len(make_blocks(ds.shards)) > 1
    got = Counter()
    for rank in range(3):
        got.update(r["id"] for r in StreamingJsonl(path, rank=rank, world_size=3))
    assert got == Counter(range(3000))
    per_rank = [len(list(StreamingJsonl(path, rank=r, world_size=3))) for r in range(3)]
    assert all(per_rank)  # every rank gets data from the one file


def test_large_pretty_document_is_one_block(tmp_path):
    elements = [{"id": i, "pad": "p" * 100} for i in range(1500)]
    path = pretty(tmp_path / "big.json", elements)
    assert path.stat().st_size > 64 << 10
    ds = StreamingJsonl(path)
    assert ds.shards[0].format.name == "json"
    assert [r["id"] for r in ds] == list(range(1500))


def test_compressed_documents_and_lines(tmp_path):
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(json.dumps({"a": [1, 2]}, indent=2)
                                                       .encode(), mtime=0))
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(b'{"b": 1}\n{"b": 2}\n', mtime=0))
    assert list(StreamingJsonl(tmp_path)) == [{"a": [1, 2]}, {"b": 1}, {"b": 2}]


def test_byte_order_mark_before_a_document(tmp_path):
    (tmp_path / "x.json").write_bytes(b'\xef\xbb\xbf[\n {"a": 1},\n {"a": 2}\n]\n')
    (tmp_path / "y.json").write_bytes(b'\xef\xbb\xbf{\n "b": 1\n}\n')
    assert list(StreamingJsonl(tmp_path)) == [{"a": 1}, {"a": 2}, {"b": 1}]


def test_empty_json_file_has_no_records(tmp_path):
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "blank.json").write_bytes(b"\n  \n")
    lines(tmp_path / "one.jsonl", [{"id": 1}])
    assert list(StreamingJsonl(tmp_path)) == [{"id": 1}]


def test_malformed_document_names_the_file_and_is_counted_under_skip(tmp_path):
    pretty(tmp_path / "a.json", {"ok": 1})
    (tmp_path / "b.json").write_text('{\n  "broken": [1, 2\n}\n')
    pretty(tmp_path / "c.json", {"ok": 3})
    with pytest.raises(CorruptRecordError) as raised:
        list(StreamingJsonl(tmp_path))
    message = str(raised.value)
    assert "b.json" in message and "the JSON document (record 1)" in message
    ds = StreamingJsonl(tmp_path, on_error="skip")
    assert list(ds) == [{"ok": 1}, {"ok": 3}]
    assert ds.counts["bad"] == 1


def mixed_corpus(root: Path) -> list[int]:
    """Documents, arrays, lines in .json files and ordinary JSONL; returns ids in order."""
    pretty(root / "a.json", {"id": 0})
    pretty(root / "b.json", [{"id": i} for i in range(1, 40)])
    lines(root / "c.json", [{"id": i} for i in range(40, 60)])
    lines(root / "d.jsonl", [{"id": i} for i in range(60, 100)])
    (root / "e.json").write_bytes(orjson.dumps([{"id": i} for i in range(100, 105)]))
    pretty(root / "f" / "g.json", {"id": 105})
    return list(range(106))


def ids_of(batch: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in batch]


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_documents_exactly_once_for_any_world(tmp_path, num_workers, world_size):
    expected = mixed_corpus(tmp_path)
    got: Counter[int] = Counter()
    for rank in range(world_size):
        ds = StreamingJsonl(tmp_path, shuffle=True, seed=3, buffer_size=8, rank=rank,
                            world_size=world_size)
        loader = DataLoader(ds, batch_size=4, num_workers=num_workers, collate_fn=ids_of)
        got.update(i for batch in loader for i in batch)
    assert got == Counter(expected)


@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_resume_inside_an_array_document(tmp_path, shuffle):
    mixed_corpus(tmp_path)

    def make() -> StreamingJsonl:
        return StreamingJsonl(tmp_path, shuffle=shuffle, seed=1, buffer_size=5)

    run_test_save_load_state(make, [0, 1, 3, 17, 39, 41, 70, 105, 106])


# -- the converter agrees -------------------------------------------------------------------


def test_converter_reads_what_the_reader_reads(tmp_path, articles):
    folder, _ = articles
    mixed_corpus(tmp_path / "mixed")
    for source in (folder, tmp_path / "mixed"):
        expected = list(StreamingJsonl(source))
        for workers in (1, 3):
            out = tmp_path / f"out-{source.name}-{workers}"
            assert converted([source], out, workers=workers) == expected


def test_converter_resumes_inside_an_array_document(tmp_path):
    pretty(tmp_path / "a.json", [{"id": i} for i in range(10)])
    lines(tmp_path / "b.json", [{"id": i} for i in range(10, 15)])
    inputs = Inputs([tmp_path])
    every = list(inputs.records())
    assert [orjson.loads(raw.data)["id"] for raw in every] == list(range(15))
    assert "element 3 of the JSON array" in every[3].where
    for cut in (3, 9, 10, 12):
        start = Position.from_json(every[cut].position.to_json())
        rest = [orjson.loads(raw.data)["id"] for raw in inputs.records(start)]
        assert rest == list(range(cut, 15))


def test_converter_counts_a_malformed_document_once(tmp_path):
    pretty(tmp_path / "a.json", {"ok": 1})
    (tmp_path / "b.json").write_text('{\n  "broken": \n}\n')
    result = convert([tmp_path], tmp_path.parent / "out-bad", on_error="skip")
    assert result.manifest.counts["bad"] == 1
    assert result.manifest.counts["records_out"] == 1


def test_pretty_printed_jsonl_is_lines_by_its_name_and_fails_at_line_1(tmp_path):
    path = pretty(tmp_path / "record.jsonl", {"a": 1})  # the name says JSON lines
    with pytest.raises(CorruptRecordError) as raised:
        list(StreamingJsonl(path))
    assert raised.value.line == 1 and "record.jsonl: line 1" in str(raised.value)
    ds = StreamingJsonl(path, on_error="skip")
    assert list(ds) == []
    assert ds.counts["bad"] == 3  # "{", '"a": 1' and "}": each a malformed line, counted
