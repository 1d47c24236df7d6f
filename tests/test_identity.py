"""Identity of a file, hidden names, and empty or wrong-typed sources (issue 9, part 1).

The same file under two names (``d//a.jsonl``, ``d/./a.jsonl``, ``d/../d/a.jsonl``, a symbolic
link, a file inside a directory also listed) is one file: the reader and the converter both
refuse it with an error naming both spellings, as they refuse a path listed twice. Directory
listings and globs follow one rule for hidden names: ``.ipynb_checkpoints`` and dotfiles are
skipped unless the pattern spells the dot. Every case runs against the reader
(`StreamingJsonl`) and the converter (`preprocess.convert`), which must agree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pytest

from streamds import StreamingJsonl
from streamds.formats.manifest import read_manifest
from streamds.preprocess.convert import ConversionError, convert
from streamds.preprocess.sources import Inputs

pytestmark = pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges there")


def write(path: Path, ids: range | list[int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps({"id": i}) + b"\n" for i in ids))
    return path


def read(source: Any) -> list[int]:
    return [record["id"] for record in StreamingJsonl(source)]


def converted(source: list[Any], out: Path) -> list[int]:
    convert(source, out, shard_size=1 << 20)
    import zstandard

    ids = []
    for entry in read_manifest(out).shards:
        data = zstandard.ZstdDecompressor().stream_reader(
            (out / entry.name).read_bytes(), read_across_frames=True
        ).read()
        ids += [orjson.loads(line)["id"] for line in data.splitlines() if line]
    return ids


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """d/a.jsonl (ids 0-2) and d/sub/b.jsonl (ids 10-12)."""
    write(tmp_path / "d" / "a.jsonl", range(3))
    write(tmp_path / "d" / "sub" / "b.jsonl", range(10, 13))
    return tmp_path


# -- one file, two names -------------------------------------------------------------------

ALIASES = {
    "double slash": "d//a.jsonl",
    "dot": "d/./a.jsonl",
    "dot dot": "d/../d/a.jsonl",
    "dot slash prefix": "./d/a.jsonl",
    "trailing dot dir": "d/sub/../a.jsonl",
}


@pytest.mark.parametrize("alias", ALIASES.values(), ids=ALIASES.keys())
def test_reader_refuses_a_file_under_two_spellings(tree, monkeypatch, alias):
    monkeypatch.chdir(tree)
    with pytest.raises(ValueError, match="more than once") as raised:
        StreamingJsonl(["d/a.jsonl", alias])
    message = str(raised.value)
    assert str(tree / "d" / "a.jsonl") in message  # the one real file
    assert alias.lstrip("./") in message or alias in message  # and the other spelling
    assert "list each file once" in message


@pytest.mark.parametrize("alias", ALIASES.values(), ids=ALIASES.keys())
def test_converter_refuses_a_file_under_two_spellings_and_writes_nothing(tree, monkeypatch,
                                                                         alias):
    monkeypatch.chdir(tree)
    with pytest.raises(ValueError, match="more than once") as raised:
        convert(["d/a.jsonl", alias], tree / "out")
    assert alias in str(raised.value) and "d/a.jsonl" in str(raised.value)
    assert not list((tree / "out").glob("shard-*"))


def test_the_same_path_twice_is_refused_by_both(tree):
    path = str(tree / "d" / "a.jsonl")
    with pytest.raises(ValueError, match=r"more than once \(twice\)"):
        StreamingJsonl([path, path])
    with pytest.raises(ValueError, match=r"more than once \(twice\)"):
        convert([path, path], tree / "out")  # `streamds convert a.jsonl a.jsonl`


def test_cli_convert_of_one_file_twice_fails_without_writing(tree, capsys):
    from streamds.preprocess.command import main

    path = str(tree / "d" / "a.jsonl")
    assert main([path, path, "--output", str(tree / "out"), "--quiet"]) == 2
    assert "more than once" in capsys.readouterr().err
    assert not list((tree / "out").glob("shard-*"))


def test_symlink_beside_its_target_is_the_same_file(tree):
    (tree / "d" / "link.jsonl").symlink_to("a.jsonl")
    for source in (tree / "d", f"{tree}/d/*.jsonl", f"{tree}/d/**/*.jsonl",
                   [tree / "d" / "a.jsonl", tree / "d" / "link.jsonl"]):
        with pytest.raises(ValueError, match="more than once") as raised:
            StreamingJsonl(source)
        assert "link.jsonl" in str(raised.value) and "a.jsonl'" in str(raised.value)
        with pytest.raises(ValueError, match="more than once"):
            convert(source if isinstance(source, list) else [source], tree / "out")


def test_file_inside_a_listed_directory_is_named_twice(tree):
    for source in ([tree / "d", tree / "d" / "sub" / "b.jsonl"], [tree / "d", f"{tree}/d/*"]):
        with pytest.raises(ValueError, match="more than once"):
            StreamingJsonl(source)
        with pytest.raises(ValueError, match="more than once"):
            convert(source, tree / "out")


def test_symlinked_folder_that_aliases_a_sibling_is_refused(tree):
    (tree / "d" / "again").symlink_to("sub", target_is_directory=True)
    with pytest.raises(ValueError, match="more than once") as raised:
        StreamingJsonl(tree / "d")
    assert "again" in str(raised.value)
    with pytest.raises(ValueError, match="more than once"):
        convert([tree / "d"], tree / "out")


def test_symlinked_folder_elsewhere_is_followed_by_both(tree):
    write(tree / "elsewhere" / "c.jsonl", range(20, 22))
    (tree / "d" / "linked").symlink_to(tree / "elsewhere", target_is_directory=True)
    expected = [0, 1, 2, 20, 21, 10, 11, 12]  # natural order: a, linked/c, sub/b
    assert read(tree / "d") == expected
    assert read(f"{tree}/d/**/*.jsonl") == expected
    assert converted([tree / "d"], tree / "out1") == expected
    assert converted([f"{tree}/d/**/*.jsonl"], tree / "out2") == expected


def test_symlink_loop_is_walked_once(tree):
    (tree / "d" / "sub" / "up").symlink_to("..", target_is_directory=True)
    assert read(tree / "d") == [0, 1, 2, 10, 11, 12]
    assert converted([tree / "d"], tree / "out") == [0, 1, 2, 10, 11, 12]


def test_a_symlink_named_as_the_source_is_read_once(tree):
    (tree / "link.jsonl").symlink_to(tree / "d" / "a.jsonl")
    assert read(tree / "link.jsonl") == [0, 1, 2]
    assert converted([tree / "link.jsonl"], tree / "out") == [0, 1, 2]


def test_broken_symlink_in_a_directory_is_named(tree):
    (tree / "d" / "gone.jsonl").symlink_to("missing.jsonl")
    with pytest.raises(FileNotFoundError, match="broken symbolic link") as raised:
        StreamingJsonl(tree / "d")
    assert "gone.jsonl" in str(raised.value) and "missing.jsonl" in str(raised.value)
    with pytest.raises(ConversionError, match=r"gone\.jsonl"):
        convert([tree / "d"], tree / "out")


def test_remote_duplicates_use_the_filesystems_own_name():
    memory = fsspec.filesystem("memory")
    memory.pipe("/identity/a.jsonl", b'{"id": 1}\n')
    try:
        assert read("memory://identity/a.jsonl") == [1]
        with pytest.raises(ValueError, match="more than once"):
            StreamingJsonl(["memory://identity/a.jsonl", "memory:///identity/a.jsonl"])
        with pytest.raises(ValueError, match="more than once"):
            StreamingJsonl(["memory://identity/a.jsonl", "memory://identity/*.jsonl"])
    finally:
        memory.rm("/identity", recursive=True)


# -- hidden names ------------------------------------------------------------------------------


@pytest.fixture
def notebook_tree(tmp_path: Path) -> Path:
    """A Colab folder: real files, Jupyter checkpoints, dotfiles, at several depths."""
    data = tmp_path / "data"
    write(data / "train.jsonl", range(3))
    write(data / "part_1" / "x.jsonl", range(10, 12))
    write(data / ".ipynb_checkpoints" / "train-checkpoint.jsonl", range(100, 103))
    write(data / "part_1" / ".ipynb_checkpoints" / "x-checkpoint.jsonl", range(110, 112))
    write(data / ".hidden.jsonl", range(200, 201))
    write(data / ".git" / "objects.jsonl", range(300, 301))
    return data


VISIBLE = [10, 11, 0, 1, 2]  # part_1/x.jsonl, then train.jsonl


@pytest.mark.parametrize("pattern", ["", "/**/*.jsonl", "/**", "/*", "/part_*", "/*/*.jsonl"])
def test_globs_and_listings_skip_checkpoints_and_dotfiles(notebook_tree, pattern):
    source = f"{notebook_tree}{pattern}"
    expected = {"/part_*": [10, 11], "/*/*.jsonl": [10, 11]}.get(pattern, VISIBLE)
    assert read(source) == expected
    assert converted([source], notebook_tree.parent / "out") == expected


@pytest.mark.parametrize(("pattern", "expected"), [
    ("/.ipynb_checkpoints/*.jsonl", [100, 101, 102]),
    ("/**/.ipynb_checkpoints/*.jsonl", [100, 101, 102, 110, 111]),
    ("/.*.jsonl", [200]),
    ("/.ipynb_checkpoints", [100, 101, 102]),
    ("/.hidden.jsonl", [200]),
])
def test_hidden_names_are_read_when_spelled_out(notebook_tree, pattern, expected):
    source = f"{notebook_tree}{pattern}"
    assert read(source) == expected
    assert converted([source], notebook_tree.parent / "out") == expected


def test_remote_globs_skip_checkpoints_too():
    memory = fsspec.filesystem("memory")
    memory.pipe("/nb/train.jsonl", b'{"id": 1}\n')
    memory.pipe("/nb/.ipynb_checkpoints/train-checkpoint.jsonl", b'{"id": 2}\n')
    memory.pipe("/nb/sub/.hidden.jsonl", b'{"id": 3}\n')
    try:
        assert read("memory://nb/**/*.jsonl") == [1]
        assert read("memory://nb") == [1]
        assert read("memory://nb/.ipynb_checkpoints/*.jsonl") == [2]
    finally:
        memory.rm("/nb", recursive=True)


# -- empty and wrong-typed sources ---------------------------------------------------------------


@pytest.mark.parametrize("source", ["", " ", None, [], [""], ["a.jsonl", ""]])
def test_empty_source_is_refused_naming_the_value_and_the_fix(tmp_path, monkeypatch, source):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.jsonl", range(2))  # "" must not stream the working directory
    with pytest.raises(ValueError) as raised:
        StreamingJsonl(source)
    message = str(raised.value)
    assert repr(source if not isinstance(source, list) or not source else source[-1]) in message \
        or "empty list" in message
    assert "pass" in message


@pytest.mark.parametrize(("source", "type_name"), [
    (5, "int"), (b"data.jsonl", "bytes"), ({"path": "a"}, "dict"),
    ([Path("a.jsonl"), 3], "int"), ((p for p in ["a.jsonl"]), "generator"),
])
def test_wrong_typed_source_raises_type_error_naming_the_type(source, type_name):
    with pytest.raises(TypeError, match=type_name) as raised:
        StreamingJsonl(source)
    assert "must be a path" in str(raised.value)


def test_converter_refuses_empty_and_wrong_typed_inputs(tmp_path):
    with pytest.raises(ValueError, match=r"inputs\[0\] is ''"):
        Inputs([""])
    with pytest.raises(TypeError, match=r"inputs\[1\] must be a path .* got int"):
        Inputs([str(tmp_path), 7])
    with pytest.raises(ValueError, match="no inputs"):
        Inputs([])
