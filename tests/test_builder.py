"""One module builds the reader chain: `streamds.stages.pipeline` constructs every reader stage.

The resumes (elastic merge, plain-loader resume, replays) ask the builder for what they need
(`buffer_intake`, `preparer`, `numbers_shuffle`, `state_after`) and the stages for what their
nodes say (`rest_of`: each node's stage answers `unfinished`), so the chain's shape is written
once. The stages beside the reader chain (a mix's, a packed dataset's, a pool batcher's,
`Rebatch`) are built by the dataset types that describe them, and are not counted here.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any, Protocol

import pytest

import streamds.stages
from streamds import StateMismatchError
from streamds.stages.batch import Batch
from streamds.stages.buckets import PoolBatch
from streamds.stages.chunks import ChunkCursor, Rest
from streamds.stages.pipeline import rest_of, work_after
from streamds.stages.transform import AfterBuffer

ROOT = Path(__file__).resolve().parents[1]
BUILDER = "streamds/stages/pipeline.py"
BESIDE_THE_READER = {"MixStage", "PackStage", "PoolStage", "Rebatch"}
# a stage that builds a part of itself: the records stages keep their position with a cursor
OWN_PARTS = {"streamds/stages/records.py": {"ChunkCursor"},
             "streamds/stages/shuffle.py": {"ChunkCursor"}}


def reader_stages() -> set[str]:
    """The names of the reader chain's stage classes: every class of `streamds.stages` with
    the protocol's `reset` and `get_state` (the cursor, which says `position` instead, too)."""
    found = {ChunkCursor.__name__}
    for info in pkgutil.iter_modules(streamds.stages.__path__):
        module = importlib.import_module(f"streamds.stages.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if (cls.__module__ == module.__name__ and Protocol not in cls.__mro__
                    and callable(getattr(cls, "reset", None))
                    and callable(getattr(cls, "get_state", None))):
                found.add(name)
    return found - BESIDE_THE_READER


def constructions(text: str, stages: set[str]) -> list[str]:
    """Where `text` calls a stage class (by its name, an alias it was imported as, or an
    attribute of a module): ``Shuffle(...)``, ``S(...)`` after ``import Shuffle as S``,
    ``shuffle.Shuffle(...)``."""
    tree = ast.parse(text)
    names = {stage: stage for stage in stages}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in stages and alias.asname:
                    names[alias.asname] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = (func.id if isinstance(func, ast.Name) else
                  func.attr if isinstance(func, ast.Attribute) else None)
        if called in names:
            found.append(f"line {node.lineno}: {names[called]}(...)")
    return found


def modules() -> list[str]:
    return sorted(str(path.relative_to(ROOT)) for folder in ("streamds", "preprocess")
                  for path in (ROOT / folder).rglob("*.py"))


def test_the_stage_list_holds_the_reader_chain() -> None:
    assert {"Lines", "Parse", "ParseLater", "Transform", "EvenRanks", "Records", "Shuffle",
            "AfterBuffer", "Batch", "PoolBatch", "ChunkCursor", "Numbers"} <= reader_stages()


def test_only_the_builder_constructs_reader_stages() -> None:
    stages = reader_stages()
    found = {}
    for module in modules():
        if module == BUILDER:
            continue
        allowed = OWN_PARTS.get(module, set())
        made = [at for at in constructions((ROOT / module).read_text(), stages - allowed)]
        if made:
            found[module] = made
    assert found == {}, (
        f"modules other than {BUILDER} construct reader stages (ask the builder instead): "
        f"{found}")


def test_the_builder_constructs_them() -> None:
    made = constructions((ROOT / BUILDER).read_text(), reader_stages())
    assert any("Shuffle(" in at for at in made) and any("EvenRanks(" in at for at in made)


@pytest.mark.parametrize("by_hand", [
    "cursor = ChunkCursor(EvenRanks(front, 3))",
    "from streamds.stages.shuffle import Shuffle as S\nbuffer = S(numbers, size=4)",
    "from streamds.stages import lines\nreader = lines.Lines(shards, blocks, work)",
])
def test_the_check_catches_a_construction_by_hand(by_hand: str) -> None:
    assert constructions(by_hand, reader_stages())


# -- the elastic merge asks each node's stage (`rest_of`) ------------------------------------

def _cursor() -> dict[str, Any]:
    lines = {"stage": "lines", "item": 3, "offset": None, "counts": {}}
    return ChunkCursor.at({"stage": "even_ranks", "source": lines, "emitted": 0, "cut": None},
                          3, 70)


def test_rest_of_passes_through_wrapping_stages_to_the_cursor() -> None:
    cursor = _cursor()
    rest = rest_of(Batch.state_over(AfterBuffer.state_over(cursor)))
    assert rest == Rest(cursor)
    assert work_after([(0, None), (1, None), (2, None), (5, None), (6, 10)], rest.position) == [
        (5, 70), (6, 10)]


def test_rest_of_refuses_a_node_no_reader_stage_names() -> None:
    with pytest.raises(StateMismatchError, match="'mystery'"):
        rest_of({"stage": "mystery", "source": _cursor()})


def test_an_open_pool_without_a_shuffle_buffer_is_refused_by_its_stage() -> None:
    node = PoolBatch.state_over(_cursor(), ["length_buckets"], 2, 1)
    with pytest.raises(ValueError, match="shuffle=False"):
        rest_of(node)
    assert rest_of(PoolBatch.state_over(_cursor(), ["length_buckets"], 2, 0)).pool is None
