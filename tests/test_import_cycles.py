"""Imports between the project's modules form no cycle; `streamds` never needs the converter.

The graph is read from the source, not from a running interpreter: every module of the
package `streamds` and of the converter, `streamds.preprocess` (its modules lie in the
checkout's `preprocess/` folder), found with `pkgutil` without importing anything, is
parsed with `ast`, and each ``import`` and ``from ... import`` naming a project module is an
edge, whether it runs at import time or inside a function (a function-level import that
closes a cycle still hides a tangle, and still fails when the function runs during the other
module's import).
Relative imports are resolved against the importing module's package; ``from pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg``; ``importlib.import_module``
with a literal name counts too. Imports under ``if TYPE_CHECKING:`` count as well: they never
run, but a cycle of them is still two modules that each need the other to be read (the type
checker, and the engineer, go round it); break it by moving the shared type down a module.

DESIGN.md: the converter (the writing side) imports `streamds`, never the reverse; a command
of streamds's CLI may load the converter lazily, inside a function.
"""

from __future__ import annotations

import ast
import itertools
import os
import pkgutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from import_walk import is_type_checking

REPO = Path(__file__).resolve().parents[1]
# package -> its folder in the checkout: `streamds/preprocess/__init__.py` only points the
# converter's package at `preprocess/`, where its modules are
PACKAGES = {"streamds": "streamds", "streamds.preprocess": "preprocess"}
CONVERTER = "streamds.preprocess"


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `path`:`line`: at import time, inside a function, or for
    type checkers only (under ``if TYPE_CHECKING:``)."""

    source: str
    target: str
    path: Path
    line: int
    module_level: bool
    type_only: bool = False

    def __str__(self) -> str:
        where = ("for type checkers" if self.type_only
                 else "module level" if self.module_level else "inside a function")
        return f"{self.source} -> {self.target} ({self.path.name}:{self.line}, {where})"


def walk_modules(root: Path, packages: Mapping[str, str]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, is a package), for `packages` (name -> folder) under `root`.

    A subpackage that `packages` names itself is walked from its own folder, not from where
    its parent's folder holds it.

    `pkgutil.walk_packages` would import every subpackage to find its path; this walk
    recurses with `pkgutil.iter_modules` instead, so nothing runs and a tangled tree is
    still read.
    """
    modules: dict[str, tuple[Path, bool]] = {}

    def walk(name: str, directory: Path) -> None:
        init = directory / "__init__.py"
        assert init.is_file(), f"{name}: no {init}"
        modules[name] = (init, True)
        for info in pkgutil.iter_modules([str(directory)], prefix=f"{name}."):
            if info.name in packages:
                continue  # walked from its own folder
            if info.ispkg:
                walk(info.name, directory / info.name.rpartition(".")[2])
            else:
                spec = info.module_finder.find_spec(info.name)  # type: ignore[call-arg]
                assert spec is not None and spec.origin is not None, info.name
                modules[info.name] = (Path(spec.origin), False)

    for package, folder in packages.items():
        walk(package, root / folder)
    return modules


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name that ``from <level dots><name> import ...`` in `module` means."""
    if level == 0:
        assert name is not None
        return name
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(parts) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, name] if name else base)


class _ImportVisitor(ast.NodeVisitor):
    """Collects (imported name, line, module level, type only) for every import of a module,
    those under ``if TYPE_CHECKING:`` included."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.is_package = is_package
        self.depth = 0  # functions we are inside
        self.type_only = 0  # `if TYPE_CHECKING:` blocks we are inside
        # names are candidates: "a.b" and "a.b.c"
        self.found: list[tuple[str, int, bool, bool]] = []

    def _add(self, names: Iterable[str], line: int) -> None:
        self.found.extend((name, line, self.depth == 0, self.type_only > 0) for name in names)

    def visit_If(self, node: ast.If) -> None:
        if not is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.type_only += 1
        for child in node.body:
            self.visit(child)
        self.type_only -= 1
        for child in node.orelse:  # `else:` of TYPE_CHECKING runs
            self.visit(child)

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        self._add([alias.name for alias in node.names], node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(self.module, self.is_package, node.level, node.module)
        # `from base import name`: the submodule base.name if there is one, else base itself
        self._add([f"{base}\x00{alias.name}" for alias in node.names], node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
            isinstance(func, ast.Name) and func.id == "import_module"
        )
        if named and node.args and isinstance(node.args[0], ast.Constant):
            target = node.args[0].value
            if isinstance(target, str) and not target.startswith("."):
                self._add([target], node.lineno)
        self.generic_visit(node)


def import_edges(root: Path, packages: Mapping[str, str]) -> list[Edge]:
    """Every import from one project module of `packages` (under `root`) to another."""
    modules = walk_modules(root, packages)
    edges = []
    for module, (path, is_package) in sorted(modules.items()):
        visitor = _ImportVisitor(module, is_package)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for name, line, module_level, type_only in visitor.found:
            base, _, member = name.partition("\x00")
            if member and f"{base}.{member}" in modules:
                target = f"{base}.{member}"
            else:  # the longest project module the name lies in (`import a.b.c` -> a.b.c)
                parts = base.split(".")
                prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
                target = next((p for p in prefixes if p in modules), "")
            if target and target != module:
                edges.append(Edge(module, target, path, line, module_level, type_only))
    return edges


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected tangle of `graph`, as [a, b, ..., a].

    Tarjan's algorithm finds the tangles (components with more than one node, or a node
    that points at itself); a walk inside each gives one concrete cycle to name.
    """
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:  # recursion is fine: a project has tens of modules
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in nodes:
        if node not in index:
            connect(node)
    cycles = []
    for component in sorted(components):
        members = set(component)
        start = component[0]
        if len(component) == 1 and start not in graph.get(start, ()):
            continue
        cycles.append(_cycle_through(graph, start, members))
    return cycles


def _cycle_through(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """A shortest cycle from `start` back to it, inside one strongly connected component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, ())):
                if target not in members:
                    continue
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in no cycle of {sorted(members)}")


def graph_of(edges: Iterable[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
    return graph


def describe_cycle(cycle: list[str], edges: list[Edge]) -> str:
    """`a -> b -> a`, then where each step's import is."""
    steps = []
    for source, target in itertools.pairwise(cycle):
        steps.extend(
            f"    {edge}" for edge in edges if (edge.source, edge.target) == (source, target)
        )
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


# -- the project -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(REPO, PACKAGES)


def test_every_module_is_walked(edges: list[Edge]) -> None:
    modules = walk_modules(REPO, PACKAGES)
    on_disk = {
        ".".join((package, *path.relative_to(REPO / folder).with_suffix("").parts))
        .removesuffix(".__init__")
        for package, folder in PACKAGES.items()
        for path in (REPO / folder).rglob("*.py")
        if path.parent != REPO / CONVERTER.replace(".", "/")  # the pointer to preprocess/
    }
    assert set(modules) == on_disk
    assert "streamds.preprocess.convert" in modules
    assert len(edges) > 20  # the packages do import each other's modules: the parse sees them
    assert any(  # DESIGN.md: the writing side builds on the reading side
        e.source.startswith(CONVERTER) and not e.target.startswith(CONVERTER) for e in edges
    )


def test_project_imports_have_no_cycle(edges: list[Edge]) -> None:
    cycles = find_cycles(graph_of(edges))
    assert not cycles, "import cycles between project modules:\n" + "\n".join(
        describe_cycle(cycle, edges) for cycle in cycles
    )


def in_converter(module: str) -> bool:
    return module == CONVERTER or module.startswith(CONVERTER + ".")


def test_streamds_never_imports_the_converter_at_module_level(edges: list[Edge]) -> None:
    wrong = [
        str(edge)
        for edge in edges
        if edge.module_level and not in_converter(edge.source) and in_converter(edge.target)
    ]
    assert not wrong, "streamds imports the converter at import time:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "statement",
    [
        "import streamds, streamds.preprocess.command",
        "import streamds.preprocess.command, streamds",
    ],
)
def test_packages_import_in_a_fresh_interpreter(statement: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", statement],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{statement!r} failed:\n{result.stderr}"


# -- the checker itself ----------------------------------------------------------------------


def test_find_cycles_names_every_cycle_and_only_cycles() -> None:
    graph = {
        "a": {"b"},
        "b": {"c", "x"},
        "c": {"a"},  # a -> b -> c -> a
        "d": {"e", "a"},
        "e": {"d"},  # d <-> e, leading into the first cycle
        "x": {"y"},
        "y": set(),  # a tail that closes nothing
        "s": {"s"},  # a module importing itself
    }
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"], ["s", "s"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []  # a diamond, no cycle
    assert find_cycles({}) == []


def test_find_cycles_on_a_long_ring_names_the_short_way_round() -> None:
    ring = {f"m{i}": {f"m{(i + 1) % 6}"} for i in range(6)}
    ring["m3"].add("m0")  # a shortcut: m0 -> m1 -> m2 -> m3 -> m0
    assert find_cycles(ring) == [["m0", "m1", "m2", "m3", "m0"]]


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_import_edges_read_every_kind_of_import(tmp_path: Path) -> None:
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from .a import thing\n",
            "pkg/a.py": (
                "from typing import TYPE_CHECKING\n"
                "import os\n"
                "from . import b\n"
                "from .sub import deep\n"
                "if TYPE_CHECKING:\n"
                "    from .c import Hint\n"
                "else:\n"
                "    from pkg.sub import deep as _\n"
                "def later():\n"
                "    from other.z import q\n"
                "    import importlib\n"
                "    return importlib.import_module('other.y')\n"
                "thing = 1\n"
            ),
            "pkg/b.py": "x = 1\n",
            "pkg/c.py": "from .a import thing\n",
            "pkg/sub/__init__.py": "from . import deep\nfrom .. import c\n",
            "pkg/sub/deep.py": "from ..b import x\nfrom pkg import thing\n",
            "other/__init__.py": "",
            "other/y.py": "",
            "other/z.py": "class K:\n    import pkg.b\n",
        },
    )
    found = {
        (edge.source, edge.target, edge.module_level, edge.type_only)
        for edge in import_edges(tmp_path, {"pkg": "pkg", "other": "other"})
    }
    assert found == {
        ("pkg", "pkg.a", True, False),
        ("pkg.a", "pkg.b", True, False),  # `from . import b`: the module b
        ("pkg.a", "pkg.c", True, True),  # under `if TYPE_CHECKING:`
        ("pkg.a", "pkg.sub.deep", True, False),  # relative and, under `else:`, absolute
        ("pkg.a", "other.z", False, False),  # inside a function
        ("pkg.a", "other.y", False, False),  # importlib.import_module('other.y')
        ("pkg.c", "pkg.a", True, False),
        ("pkg.sub", "pkg.sub.deep", True, False),
        ("pkg.sub", "pkg.c", True, False),
        ("pkg.sub.deep", "pkg.b", True, False),  # `from ..b import x`
        ("pkg.sub.deep", "pkg", True, False),  # `thing` is a name, not a module
        ("other.z", "pkg.b", True, False),  # a class body runs at import time
    }


def test_cycle_check_counts_imports_for_type_checkers(tmp_path: Path) -> None:
    """A cycle closed only by a type-only import (or only inside functions) is still one."""
    write_package(
        tmp_path,
        {
            "lib/__init__.py": "",
            "lib/base.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from .packed import Packed\n"
            ),
            "lib/packed.py": "def make():\n    from .batched import Batched\n",
            "lib/batched.py": "from .base import thing\n",
        },
    )
    edges = import_edges(tmp_path, {"lib": "lib"})
    cycles = find_cycles(graph_of(edges))
    assert cycles == [["lib.base", "lib.packed", "lib.batched", "lib.base"]]
    message = describe_cycle(cycles[0], edges)
    assert "lib.base -> lib.packed (base.py:3, for type checkers)" in message
    assert "lib.packed -> lib.batched (packed.py:2, inside a function)" in message


def test_cycle_check_catches_a_cycle_in_a_package(tmp_path: Path) -> None:
    write_package(
        tmp_path,
        {
            "lib/__init__.py": "",
            "lib/cli.py": "def run():\n    from tool.convert import main\n    return main()\n",
            "lib/units.py": "KB = 1000\n",
            "tool/__init__.py": "",
            "tool/convert.py": "from lib.cli import run\nfrom lib.units import KB\n",
        },
    )
    edges = import_edges(tmp_path, {"lib": "lib", "tool": "tool"})
    cycles = find_cycles(graph_of(edges))
    assert cycles == [["lib.cli", "tool.convert", "lib.cli"]]
    message = describe_cycle(cycles[0], edges)
    assert "lib.cli -> tool.convert (cli.py:2, inside a function)" in message
    assert "tool.convert -> lib.cli (convert.py:1, module level)" in message
