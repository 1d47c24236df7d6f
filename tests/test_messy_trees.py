"""Exactly once over messy trees: a property test (issue 9, part 4; DESIGN.md guarantee 1).

Hypothesis builds the folders people really have: nested directories, Jupyter's
``.ipynb_checkpoints`` with ``*-checkpoint.*`` copies of real files, dotfiles and hidden
folders, empty files, plain, gzip and zstd files, pretty-printed ``.json`` documents, JSON
arrays and JSON lines in ``.json`` files, symbolic links to files and folders (aliases of
files already in the tree, folders elsewhere, loops), and source lists that name a file
again under another spelling. A simple reference reader, written here without streamds (walk
with `os.scandir`, decode with `gzip` and `zstandard`, parse with `json`), says which records
the source names, or that it names one file twice. Then every rank (1-3, simulated with
``rank=``/``world_size=``) of a `StreamingJsonl` under a DataLoader with 0-3 workers must
together yield each of those records exactly once, and the converter must write each once;
or both must refuse the source with an error that says so.
"""

from __future__ import annotations

import atexit
import fnmatch
import gzip
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from streamds import StreamingJsonl
from streamds.formats.manifest import MissingShardError, read_manifest
from streamds.preprocess.convert import convert

pytestmark = [
    pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges there"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

FOLDERS = ["", "a", "a/b", "part_2", "part_10", ".ipynb_checkpoints", "a/.ipynb_checkpoints",
           ".hidden", "a/.git"]
LAYOUTS = ["lines", "pretty", "array", "compact-array", "json-lines", "empty", "big-lines"]
CODECS = ["", ".gz", ".zst"]
RECORD_NAMES = tuple(f"{suffix}{codec}" for suffix in (".json", ".jsonl", ".ndjson")
                     for codec in ("", ".gz", ".zst"))


# -- building a tree ----------------------------------------------------------------------------


def encode(layout: str, ids: list[int]) -> bytes:
    records = [{"id": i, "text": f"record {i}"} for i in ids]
    if layout == "pretty":  # one document per file: the record, pretty-printed
        return json.dumps(records[0], indent=2).encode()
    if layout == "array":
        return json.dumps(records, indent=2).encode()
    if layout == "compact-array":
        return json.dumps(records).encode()
    if layout == "empty":
        return b""
    if layout == "big-lines":  # > 64 KiB: split into byte-range blocks
        records = [{**record, "pad": "p" * 30_000} for record in records]
    return b"".join(json.dumps(record).encode() + b"\n" for record in records)


def compress(codec: str, data: bytes) -> bytes:
    if codec == ".gz":
        return gzip.compress(data, mtime=0)
    if codec == ".zst":
        return zstandard.ZstdCompressor().compress(data)
    return data


@st.composite
def trees(draw: Any) -> dict[str, Any]:
    """A tree description: files, links, and how the source names the tree."""
    files = []
    next_id = 0
    for index in range(draw(st.integers(1, 7))):
        folder = draw(st.sampled_from(FOLDERS[:5] if index == 0 else FOLDERS))
        layout = draw(st.sampled_from(LAYOUTS))
        codec = "" if layout == "big-lines" else draw(st.sampled_from(CODECS))
        count = {"pretty": 1, "empty": 0, "big-lines": 3}.get(layout, draw(st.integers(1, 5)))
        suffix = ".jsonl" if layout in ("lines", "empty", "big-lines") else ".json"
        if layout == "empty" and draw(st.booleans()):
            suffix = ".json"
        name = f"{index}{suffix}{codec}"
        if folder.endswith(".ipynb_checkpoints"):
            name = f"{index}-checkpoint{suffix}{codec}"
        if draw(st.integers(0, 9)) == 0:
            name = "." + name  # a dotfile
        files.append({"path": f"{folder}/{name}".lstrip("/"), "layout": layout, "codec": codec,
                      "ids": list(range(next_id, next_id + count))})
        next_id += count
    links = draw(st.lists(st.sampled_from(["file-alias", "hidden-file-alias", "outside-dir",
                                           "loop", "sibling-dir-alias"]),
                          max_size=2, unique=True))
    source = draw(st.sampled_from(["dir", "dir", "dir", "glob", "glob", "files", "files",
                                   "dir+alias", "files+spelled-alias"]))
    return {"files": files, "links": links, "source": source, "next_id": next_id,
            "workers": draw(st.integers(0, 3)), "world_size": draw(st.integers(1, 3)),
            "shuffle": draw(st.booleans())}


def build(tree: dict[str, Any], base: Path) -> tuple[Path, list[Any]]:
    """Write the tree under base/root (and base/outside); return the root and the source."""
    root = base / "root"
    root.mkdir()
    for spec in tree["files"]:
        path = root / spec["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(compress(spec["codec"], encode(spec["layout"], spec["ids"])))
    visible = [root / spec["path"] for spec in tree["files"]
               if not any(part.startswith(".") for part in Path(spec["path"]).parts)]
    for link in tree["links"]:
        if link == "file-alias" and visible:
            (root / "alias.jsonl").symlink_to(visible[0])
        elif link == "hidden-file-alias" and visible:
            (root / ".alias.jsonl").symlink_to(visible[0])  # hidden: never read
        elif link == "outside-dir":
            outside = base / "outside"
            outside.mkdir()
            first = tree["next_id"]
            (outside / "o.jsonl").write_text(json.dumps({"id": first, "text": "outside"}) + "\n")
            tree["next_id"] += 1
            (root / "linked").symlink_to(outside, target_is_directory=True)
        elif link == "loop":
            (root / "a").mkdir(exist_ok=True)
            (root / "a" / "up").symlink_to("..", target_is_directory=True)
        elif link == "sibling-dir-alias" and (root / "a").is_dir():
            (root / "again").symlink_to("a", target_is_directory=True)
    kind = tree["source"]
    if kind == "dir":
        return root, [str(root)]
    if kind == "glob":
        return root, [f"{root}/**/*.json*"]
    if kind == "dir+alias" and visible:
        return root, [str(root), str(visible[-1]).replace(str(root), f"{root}/.", 1)]
    files = [str(path) for path in visible] or [str(root)]
    if kind == "files+spelled-alias" and visible:
        files.append(str(visible[0]).replace(str(root), f"{root}//", 1))
    return root, files


# -- the reference reader -----------------------------------------------------------------------


def reference_files(item: str) -> list[str]:
    """The files a directory or glob names, by the documented rule, walked independently."""
    if os.path.isfile(item):
        return [item]
    root, pattern = (item, None) if os.path.isdir(item) else item.split("/**/", 1)
    found = []

    def walk(directory: str, ancestors: frozenset[str]) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                real = os.path.realpath(entry.path)
                if real not in ancestors:
                    walk(entry.path, ancestors | {real})
            elif (fnmatch.fnmatchcase(entry.name, pattern) if pattern is not None
                  else entry.name.endswith(RECORD_NAMES)):
                found.append(entry.path)

    walk(root, frozenset({os.path.realpath(root)}))
    return found


def reference_records(path: str) -> list[int]:
    """A file's ids: decode it whole; a .json file that parses whole is a document."""
    data = Path(path).read_bytes()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    elif path.endswith(".zst") and data:
        data = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()
    text = data.decode()
    if path.removesuffix(".gz").removesuffix(".zst").endswith(".json") and text.strip():
        try:
            document = json.loads(text)
        except json.JSONDecodeError:
            pass
        else:
            return [r["id"] for r in document] if isinstance(document, list) else [document["id"]]
    return [json.loads(line)["id"] for line in text.splitlines() if line.strip()]


def reference(source: list[str]) -> Counter[int] | None:
    """Every id the source names, or None when it names one file twice."""
    paths = [path for item in source for path in reference_files(item)]
    if len({os.path.realpath(path) for path in paths}) < len(paths):
        return None
    ids: Counter[int] = Counter()
    for path in paths:
        ids.update(reference_records(path))
    return ids


# -- the property -------------------------------------------------------------------------------


def ids_of(batch: list[dict[str, Any]]) -> list[int]:
    return [record["id"] for record in batch]


def read_all_ranks(source: list[str], tree: dict[str, Any]) -> Counter[int]:
    got: Counter[int] = Counter()
    world_size = tree["world_size"]
    for rank in range(world_size):
        dataset = StreamingJsonl(source, shuffle=tree["shuffle"], seed=7, buffer_size=4,
                                 rank=rank, world_size=world_size)
        loader = DataLoader(dataset, batch_size=3, num_workers=tree["workers"],
                            collate_fn=ids_of)
        got.update(i for batch in loader for i in batch)
    return got


def converted(source: list[str], out: Path) -> Counter[int]:
    convert(source, out, shard_size=1 << 20)
    got: Counter[int] = Counter()
    for entry in read_manifest(out).shards:
        data = zstandard.ZstdDecompressor().stream_reader(
            (out / entry.name).read_bytes(), read_across_frames=True
        ).read()
        got.update(json.loads(line)["id"] for line in data.splitlines() if line)
    return got


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees())
def test_every_record_exactly_once_or_a_clear_error(tree: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        _root, source = build(tree, base)
        expected = reference(source)
        event(f"source {tree['source']}, links {sorted(tree['links'])}")
        if expected is None:  # one file under two names: both refuse, naming it
            event("refused: one file twice")
            with pytest.raises(ValueError, match="more than once"):
                StreamingJsonl(source)
            with pytest.raises(ValueError, match="more than once"):
                convert(source, base / "out")
            return
        if not expected and not any(reference_files(item) for item in source):
            event("refused: no visible files")
            with pytest.raises(FileNotFoundError, match=r"no JSONL files|no files match"):
                StreamingJsonl(source)
            with pytest.raises(ValueError, match=r"nothing to convert|does not exist"):
                convert(source, base / "out")
            return
        event(f"read {'some' if expected else 'no'} records")
        event(f"{tree['workers']} workers, {tree['world_size']} ranks")
        assert read_all_ranks(source, tree) == expected
        if not expected:  # converting nothing is an error, never an empty output
            with pytest.raises(ValueError, match="nothing to convert"):
                convert(source, base / "out")
            return
        assert converted(source, base / "out") == expected


# -- spellings, sibling copies, stale manifests and missing shards (issue 27) --------------------

SPELLINGS = [".jsonl", ".JSONL", ".Jsonl", ".ndjson", ".NDJSON", ".jsonlines", ".json"]
CODEC_SPELLINGS = {"": "", ".gz": ".gz", ".GZ": ".gz", ".gzip": ".gz", ".zst": ".zst",
                   ".zstd": ".zst", ".ZST": ".zst"}
COPY_NAMES = ["{stem} (1){suffix}", "Copy of {stem}{suffix}", "{stem} copy{suffix}",
              "{stem} - Copy{suffix}", "{stem}{record}{other_codec}"]
MANIFEST_DAMAGE = ["none", "missing-shard", "unlisted-file", "stale-size"]
_CONVERTED: dict[str, Path] = {}  # one conversion per session, copied into each tree


def converted_folder() -> Path:
    """A conversion of ids 10,000-10,059 into three shards (made once, then copied)."""
    if "out" not in _CONVERTED:
        base = Path(tempfile.mkdtemp(prefix="streamds-messy-"))
        atexit.register(shutil.rmtree, base, True)
        (base / "in.jsonl").write_bytes(encode("lines", list(range(10_000, 10_060))))
        convert([base / "in.jsonl"], base / "out", shard_size=1000)
        _CONVERTED["out"] = base / "out"
    return _CONVERTED["out"]


@st.composite
def spelled_trees(draw: Any) -> dict[str, Any]:
    files = []
    for index in range(draw(st.integers(1, 5))):
        suffix = draw(st.sampled_from(SPELLINGS))
        codec = draw(st.sampled_from(sorted(CODEC_SPELLINGS)))
        files.append({"stem": f"part_{index}", "suffix": suffix, "codec": codec,
                      "ids": list(range(index * 100, index * 100 + draw(st.integers(1, 4))))})
    copies = draw(st.lists(st.tuples(st.integers(0, len(files) - 1), st.sampled_from(COPY_NAMES)),
                           max_size=2, unique_by=lambda pair: pair[0]))
    return {"files": files, "copies": copies,
            "converted": draw(st.booleans()),
            "damage": draw(st.sampled_from(MANIFEST_DAMAGE)),
            "strays": draw(st.booleans()),  # notes.txt, an .orc file, _SUCCESS
            "world_size": draw(st.integers(1, 2)), "workers": draw(st.integers(0, 1)),
            "shuffle": draw(st.booleans())}


def build_spelled(tree: dict[str, Any], root: Path) -> tuple[Counter[int], str | None, list[str]]:
    """Write the tree; return the ids it holds (a copy's twice), the shard whose absence
    must be refused (or None), and the pairs of names a copy warning must name."""
    expected: Counter[int] = Counter()
    root.mkdir()
    for spec in tree["files"]:
        name = f"{spec['stem']}{spec['suffix']}{spec['codec']}"
        data = compress(CODEC_SPELLINGS[spec["codec"]], encode("lines", spec["ids"]))
        (root / name).write_bytes(data)
        spec["name"] = name
        expected.update(spec["ids"])
    pairs = []
    for index, pattern in tree["copies"]:
        spec = tree["files"][index]
        other = ".gz" if CODEC_SPELLINGS[spec["codec"]] != ".gz" else ".zst"
        name = pattern.format(stem=spec["stem"], suffix=spec["suffix"] + spec["codec"],
                              record=spec["suffix"], other_codec=other)
        codec = other if "{other_codec}" in pattern else CODEC_SPELLINGS[spec["codec"]]
        (root / name).write_bytes(compress(codec, encode("lines", spec["ids"])))
        expected.update(spec["ids"])  # read twice: both files are record files
        pairs.append((spec["name"], name))
    if tree["strays"]:
        (root / "notes.txt").write_text("not records\n")
        (root / "table.orc").write_bytes(b"ORC\x00\x00")
        (root / "_SUCCESS").write_text("")
    missing = None
    if tree["converted"]:
        shards = root / "shards"
        shutil.copytree(converted_folder(), shards)
        entries = read_manifest(shards).shards
        for entry in entries:
            expected.update(range(10_000 + sum(e.records for e in entries[: entries.index(entry)]),
                                  10_000 + sum(e.records for e in entries[: entries.index(entry)])
                                  + entry.records))
        damage = tree["damage"]
        if damage == "missing-shard":
            (shards / entries[1].name).unlink()
            missing = entries[1].name
        elif damage == "unlisted-file":
            (shards / "extra.jsonl").write_bytes(encode("lines", [20_000]))
            expected.update([20_000])
        elif damage == "stale-size":
            text = (shards / "manifest.json").read_text()
            entry = entries[0]
            (shards / "manifest.json").write_text(
                text.replace(f'"bytes":{entry.bytes},', f'"bytes":{entry.bytes + 7},', 1))
    return expected, missing, pairs


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=spelled_trees())
def test_spellings_copies_and_manifests_every_record_once_or_an_error_naming_the_file(
    tree: dict[str, Any],
) -> None:
    """Every record of every file the listing reads comes exactly once (a sibling copy's
    records come again, with a warning naming both files), or a missing shard is refused
    naming it."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        expected, missing, pairs = build_spelled(tree, root)
        logger = logging.getLogger("streamds.storage.shards")
        handler = _Records()
        logger.addHandler(handler)
        old_level = logger.level
        logger.setLevel(logging.DEBUG)
        try:
            if missing is not None:
                event("refused: a listed shard is missing")
                with pytest.raises(MissingShardError, match=re.escape(missing)):
                    StreamingJsonl(str(root))
                return
            event(f"{len(pairs)} copies, damage {tree['damage'] if tree['converted'] else '-'}")
            got = read_all_ranks([str(root)], tree)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
        assert got == expected
        warned = " ".join(handler.messages)
        for original, copy in pairs:
            assert f"/{original}'" in warned and f"/{copy}'" in warned, (original, copy)
        assert ("look like copies" in warned) == bool(pairs)
        if tree["strays"]:
            assert "notes.txt" in warned and "table.orc" in warned
