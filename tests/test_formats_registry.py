"""The format registry: every registered format keeps the protocol, the registry refuses
collisions, and no module outside `streamds/formats/` compares a format by name.

`test_formats.py` runs the user-level suite (a dataset over each format); this file holds a
format to its protocol directly (`streamds.formats.registry`): settle, blocks that tile the
file, reading every record once with positions a resume restarts at, listed counts, places.
A new format registers with one line and gets a sample writer in SAMPLES here.
"""

from __future__ import annotations

import ast
import doctest
import itertools
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import corpus
import orjson
import pytest
from test_import_cycles import REPO

from streamds.formats import registry
from streamds.formats.protocol import Format
from streamds.storage.plan import MIN_BLOCK_SIZE, make_blocks
from streamds.storage.read import read_lines
from streamds.storage.shards import resolve_shards

RECORDS = corpus.make_records(3000)  # ~170 KB of JSON lines: several 64 KiB blocks


def write_document(path: Path, data: bytes) -> Path:
    """An indented JSON array of the records: a document, read whole."""
    values = [orjson.loads(line) for line in data.splitlines() if line.strip()]
    path.write_text(json.dumps(values, indent=2))
    return path


def write_converted(path: Path, data: bytes) -> Path:
    """One shard `streamds convert` wrote, with its manifest (records per frame listed)."""
    from streamds.preprocess.convert import convert

    source = path.with_name("source.jsonl")
    source.write_bytes(data)
    out = path.with_name("converted")
    convert([source], out, shard_size=len(data) * 2, frame_size=8 << 10)
    (shard,) = out.glob("*.jsonl.zst")
    return shard


def write_parquet(path: Path, data: bytes) -> Path:
    """The records as a Parquet file of several row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = [orjson.loads(line) for line in data.splitlines() if line.strip()]
    pq.write_table(pa.Table.from_pylist(values), path, row_group_size=700)
    return path


def write_arrow(path: Path, data: bytes) -> Path:
    """The records as an Arrow IPC stream (what `datasets`' save_to_disk writes)."""
    import pyarrow as pa

    values = pa.Table.from_pylist([orjson.loads(line) for line in data.splitlines()
                                   if line.strip()])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, values.schema) as writer:
        for batch in values.to_batches(max_chunksize=900):
            writer.write_batch(batch)
    return path


# the format a sample settles into -> (file suffix, writer of decoded JSON lines) per sample
SAMPLES: dict[str, list[tuple[str, Callable[[Path, bytes], Path]]]] = {
    "jsonl": [(".jsonl", corpus.write_plain), (".jsonl.gz", corpus.write_gz),
              (".jsonl.zst", corpus.write_foreign_zst),
              (".json", corpus.write_plain)],  # a large plain .json of lines: JSON lines
    "jsonl.zst": [(".jsonl.zst", corpus.write_seekable_zst), (".jsonl.zst", write_converted)],
    "json": [(".json", write_document), (".json.gz", corpus.write_gz)],
    "tar": [(".tar", corpus.write_tar_json), (".tar", corpus.write_tar_jsonl)],
    "parquet": [(".parquet", write_parquet)],
    "arrow": [(".arrow", write_arrow)],
}
CASES = [pytest.param(name, suffix, writer, id=f"{name}:{writer.__name__}:{suffix}")
         for name, samples in SAMPLES.items() for suffix, writer in samples]


def test_every_registered_format_has_a_sample():
    assert set(SAMPLES) == {fmt.name for fmt in registry.formats()}


@pytest.mark.parametrize("fmt", registry.formats(), ids=lambda fmt: fmt.name)
def test_a_format_states_its_protocol(fmt: Format):
    assert isinstance(fmt.name, str) and fmt.name and registry.named(fmt.name) is fmt
    assert pickle.loads(pickle.dumps(fmt)) is fmt  # one object per process, by its module
    assert all(suffix.startswith(".") and suffix == suffix.lower() for suffix in fmt.suffixes)
    assert fmt.codec is None or isinstance(fmt.codec, str)
    assert isinstance(fmt.summary, str) and fmt.summary
    for flag in (fmt.parses, fmt.splits, fmt.line_positions):
        assert isinstance(flag, bool)
    for name in ("settle", "blocks", "read_block", "place"):  # what makes a format
        assert callable(getattr(fmt, name))


def _values(fmt: Format, items: list[Any]) -> list[Any]:
    """The records of a chunk's items: parsed JSON text (blank lines: none), or the values."""
    if not fmt.parses:
        return list(items)
    return [orjson.loads(item) for item in items if item.strip()]


def resume_points(count: int) -> list[int]:
    """Which of a block's `count` records a resume starts at: the first, the last, and every
    97th between, at most 6 in all. Each resume reads its block again from the start (a tar
    skips the records before it header by header): every 97th of the tar of 6000 members
    took 30 s, and any one position between the ends takes the path of every other."""
    step = max(97, -(-count // 5))
    return sorted({*range(0, count, step), count - 1}) if count else []


@pytest.mark.parametrize(("name", "suffix", "writer"), CASES)
def test_a_registered_format_reads_every_record_once_and_resumes_at_its_positions(
    tmp_path, name, suffix, writer
):
    data = corpus.jsonl(RECORDS)
    path = writer(tmp_path / f"sample{suffix}", data)
    (shard,) = resolve_shards(str(path))
    fmt = shard.format
    assert fmt is registry.named(name)  # settled as expected
    assert pickle.loads(pickle.dumps(shard)).format is fmt
    fmt.check(shard)

    blocks = make_blocks([shard], block_size=MIN_BLOCK_SIZE)
    # blocks tile the file in the format's units: from 0, each where the last ended
    assert blocks[0].start == 0 and blocks[-1].end is None
    assert all(a.end == b.start for a, b in itertools.pairwise(blocks))
    assert len(blocks) > 1 if fmt.split_size(shard) > 0 else len(blocks) == 1
    assert fmt.splits or fmt.split_size(shard) == 0

    seen: list[Any] = []
    listed_blocks = 0
    for block_id, block in enumerate(blocks):
        chunks = list(read_lines(shard, block, block_id))
        items = [(pos, item) for chunk in chunks
                 for pos, item in zip(chunk.offsets, chunk.lines, strict=False)]
        for chunk in chunks:
            assert chunk.block == block_id and len(chunk.offsets) == len(chunk.lines) + 1
            assert chunk.offsets == sorted(set(chunk.offsets))  # positions go forward
        in_block = _values(fmt, [item for _, item in items])
        listed = fmt.listed_records(shard, block)
        assert listed is None or listed == len(in_block)
        listed_blocks += listed is not None
        if fmt.line_positions and shard.codec is None:  # positions are the lines' offsets
            assert all(data[pos : pos + len(item)] == item for pos, item in items)
        # a resume at any record's position reads exactly the rest of the block
        for index in resume_points(len(items)):
            pos = items[index][0]
            rest = [item for chunk in read_lines(shard, block, block_id, resume_at=pos)
                    for item in chunk.lines]
            assert rest == [item for _, item in items[index:]]
            said = fmt.place(shard.url, pos)
            assert (said is None) == fmt.line_positions and (said is None or shard.url in said)
        first, end = fmt.read_range(shard, block.start, block.end, at_line=False)
        assert first >= 0 and (end is None or first <= end)
        seen.extend(in_block)
    assert seen == RECORDS
    assert listed_blocks in (0, len(blocks))
    assert listed_blocks or writer is not write_converted  # a manifest lists its counts


def test_the_registry_refuses_a_second_format_of_a_name_or_a_claimed_suffix():
    class Again(Format):
        name = "jsonl"

    class Claims(Format):
        name = "claims-tar"
        suffixes = (".tar",)

    for fmt in (Again(), Claims()):
        with pytest.raises(ValueError, match="Duplicate format registration"):
            registry.register(fmt)
    assert [fmt.name for fmt in registry.formats()] == list(SAMPLES)  # nothing was added
    with pytest.raises(ValueError, match=r"unknown shard format 'parq'.*'jsonl'"):
        registry.named("parq")


def test_a_shard_refuses_fields_its_format_contradicts():
    from streamds.formats.seekable import Frame
    from streamds.storage.shards import Shard

    frames = (Frame(0, 10, 0, 20),)
    with pytest.raises(ValueError, match=r"'jsonl\.zst'"):
        Shard(url="a.jsonl.zst", path="a", size=10, format="jsonl", codec="zst", frames=frames)
    with pytest.raises(ValueError, match="needs its frames"):
        Shard(url="a.jsonl.zst", path="a", size=10, format="jsonl.zst", codec="zst")
    shard = Shard(url="a.jsonl.zst", path="a", size=10, format="jsonl.zst", codec="zst",
                  frames=frames)
    assert shard.format is registry.named("jsonl.zst")


def test_file_names_map_to_formats():
    results = doctest.testmod(registry)
    assert results.attempted >= 1 and results.failed == 0
    cases = {"a.JSONL.GZ": ("jsonl", "gz"), "b.ndjson.zst": ("jsonl.zst", "zst"),
             "c.tar.xz": ("tar", "xz"), "d.json.bz2": ("json", "bz2"), "e.txt": ("jsonl", None),
             "f.txt.zst": ("jsonl.zst", "zst")}
    assert {name: (fmt.name, codec) for name, (fmt, codec) in
            ((name, registry.of_file(name)) for name in cases)} == cases


# -- no format compared by name outside formats/ -----------------------------------------

FORMAT_NAMES = {fmt.name for fmt in registry.formats()}
FORMAT_FIELDS = {"format", "shard_format"}  # a shard's format, a manifest's format name


def _names_a_format(node: ast.AST) -> bool:
    """Whether an operand of a comparison is a format (`x.format`, `x.shard_format`,
    `x.format.name`) or a format's name spelled out ("tar", ("tar", "json"))."""
    if isinstance(node, ast.Attribute):
        if node.attr in FORMAT_FIELDS:
            return True
        return node.attr == "name" and isinstance(node.value, ast.Attribute) and (
            node.value.attr in FORMAT_FIELDS)
    if isinstance(node, ast.Constant):
        return node.value in FORMAT_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_format(element) for element in node.elts)
    return False


def format_comparisons(source: str) -> list[int]:
    """Lines of `source` that compare a format by name or by identity."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare)
            and any(map(_names_a_format, [node.left, *node.comparators]))]


def test_the_check_catches_the_comparisons_it_forbids():
    caught = ['shard.format == "jsonl"', 'kind == "tar"', 'manifest.shard_format != "jsonl.zst"',
              'shard.format in ("tar", "json")', 'shard.format.name == x', "a.format is b"]
    allowed = ["shard.format.line_positions", "fmt.splits and x", 'codec == "zst"',
               "len(x) == 2"]
    assert [bool(format_comparisons(text)) for text in caught] == [True] * len(caught)
    assert [bool(format_comparisons(text)) for text in allowed] == [False] * len(allowed)


def test_no_module_outside_formats_compares_a_format_by_name():
    package = REPO / "streamds"
    found = []
    for path in sorted(package.rglob("*.py")):
        if (package / "formats") in path.parents:
            continue
        for line in format_comparisons(path.read_text()):
            found.append(f"{path.relative_to(REPO)}:{line}")
    assert found == [], (
        "ask the format object (`shard.format.splits`, `.read_block`, ...; "
        f"streamds/formats/registry.py) instead of comparing its name: {found}")
