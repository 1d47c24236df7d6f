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

import corpus
import pytest

import streamds.stages
from streamds import StreamingJsonl
from streamds.stages.chunks import ChunkCursor

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


# -- how to add a stage (docs/architecture.md), followed once by hand ------------------------

class Passing:
    """A pass-through stage after the reader: records -> the same records. State:
    ``{"stage": "passing", "source": <the reader's state>, "passed": n}``."""

    STAGE = "passing"
    SOURCE = "source"
    PASSED = "passed"

    def __init__(self, source: Any) -> None:
        self.source = source
        self.reset(None)

    def reset(self, state: dict[str, Any] | None) -> None:
        self.source.load_state_dict(None if state is None else state[self.SOURCE])
        self.passed = 0 if state is None else state[self.PASSED]

    def get_state(self) -> dict[str, Any]:
        return {"stage": self.STAGE, self.SOURCE: self.source.state_dict(),
                self.PASSED: self.passed}

    def __iter__(self) -> Any:
        for record in self.source:
            self.passed += 1
            yield record


def test_a_stage_added_by_the_recipe_resumes_exactly(tmp_path: Path) -> None:
    from resume_contract import run_test_save_load_state

    path = tmp_path / "part.jsonl"
    corpus.write_plain(path, corpus.jsonl(corpus.make_records(30)))

    class _Reader(StreamingJsonl):
        def load_state_dict(self, state: Any) -> None:  # None: the epoch's start
            if state is not None:
                super().load_state_dict(state)

    def make() -> Passing:
        return Passing(_Reader(str(path), shuffle=True, seed=2, buffer_size=6))

    reference = run_test_save_load_state(make, range(0, 30, 7))
    assert sorted(record["id"] for record in reference) == list(range(30))
