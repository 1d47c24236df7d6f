"""Every third-party import of `streamds` and `preprocess` is a declared dependency.

The Makefile's venv installs every extra, so an import that `[project].dependencies` does not
declare still passes the rest of the suite; a user's `pip install streamds` then fails with
`No module named ...` (it happened with `xxhash`, brought along by the bench extra's
`datasets`). This test reads the source instead of the venv: every module of the packages is
parsed with `ast`, and every ``import`` and ``from ... import`` it can run (at module level,
in a class body or inside a function; ``importlib.import_module`` with a literal name too) is
checked. Imports under ``if TYPE_CHECKING:`` never run and are left out.

A top-level name that is neither the standard library nor the project is mapped to the
distributions that provide it (`importlib.metadata.packages_distributions()`), and one of
them must be named in `[project].dependencies` directly: arriving through another
package's requirements is not enough, since that package may drop it in any release.

An optional dependency may stay out of `[project].dependencies` only where the import runs
when a feature is used, and fails with what to install:

- inside a function, within ``try:`` whose ``except ImportError`` (or
  ``ModuleNotFoundError``) handler has a message naming an extra that provides it, e.g.
  ``raise ImportError("... pip install 'streamds[remote]'") from err``;
- or through an explicit helper, ``optional_import("module", extra="remote")``, called
  inside a function, whose extra provides it.

A guard at module level does not count: the module fails to import for everyone without the
extra. `.ci/clean_install.sh` checks the same thing from the other side, by installing the
built package with its declared dependencies only and running the command line.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from import_walk import RuntimeImportVisitor

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the CI runs 3.11
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("streamds", "preprocess")
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})
OPTIONAL_HELPER = "optional_import"  # optional_import("module", extra="name")


def normalize(name: str) -> str:
    """A distribution name in PEP 503 form: ``PyYAML`` and ``pyyaml`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """``torch>=2.1,<3`` -> ``torch``; ``pkg[extra]; python_version<'3.11'`` -> ``pkg``."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"pyproject.toml: cannot read a distribution name from {requirement!r}")
    return normalize(match.group(1))


@dataclass(frozen=True)
class Project:
    """What pyproject.toml declares: the name, the dependencies, the extras (normalized)."""

    name: str
    dependencies: frozenset[str]
    extras: Mapping[str, frozenset[str]]

    @classmethod
    def read(cls, pyproject: Path) -> Project:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        extras = project.get("optional-dependencies", {})
        return cls(
            name=project["name"],
            dependencies=frozenset(map(requirement_name, project.get("dependencies", []))),
            extras={
                extra: frozenset(map(requirement_name, requirements))
                for extra, requirements in extras.items()
            },
        )


@dataclass(frozen=True)
class Import:
    """Module `module` (file `path`, line `line`) imports the top-level name `top`.

    `in_function`: the import runs when a function is called, not when the module loads.
    `guarded`: it sits in a ``try:`` with an ImportError handler (or goes through the helper).
    `messages`: the string constants of that handler (for the helper: ``"[EXTRA]"``).
    """

    module: str
    path: Path
    line: int
    top: str
    in_function: bool
    guarded: bool = False
    messages: tuple[str, ...] = ()

    def where(self, root: Path) -> str:
        return f"{self.module} ({self.path.relative_to(root)}:{self.line})"


@dataclass
class _Scope:
    in_function: bool
    guards: list[tuple[str, ...]] = field(default_factory=list)  # innermost last


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = {
        kind.id if isinstance(kind, ast.Name) else kind.attr
        for kind in kinds
        if isinstance(kind, ast.Name | ast.Attribute)
    }
    return bool(names & IMPORT_ERRORS)


def _strings(node: ast.AST) -> tuple[str, ...]:
    """Every string constant under `node`, f-strings' literal parts included."""
    return tuple(
        child.value
        for child in ast.walk(node)
        if isinstance(child, ast.Constant) and isinstance(child.value, str)
    )


class _ImportVisitor(RuntimeImportVisitor):
    """Collects every import of one module that can run, with its scope and guard."""

    def __init__(self, module: str, path: Path) -> None:
        self.module = module
        self.path = path
        self.scope = _Scope(in_function=False)
        self.found: list[Import] = []

    def _add(self, name: str, line: int, messages: tuple[str, ...] | None = None) -> None:
        if messages is None and self.scope.guards:
            messages = self.scope.guards[-1]
        self.found.append(
            Import(
                module=self.module,
                path=self.path,
                line=line,
                top=name.partition(".")[0],
                in_function=self.scope.in_function,
                guarded=messages is not None,
                messages=messages or (),
            )
        )

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for decorator in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if decorator is not None:  # these run where the function is defined
                self.visit(decorator)
        outer, self.scope = self.scope, _Scope(in_function=True)  # a try around a def
        for statement in node.body:  # guards nothing that runs when the function is called
            self.visit(statement)
        self.scope = outer

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Try(self, node: ast.Try) -> None:
        handlers = [h for h in node.handlers if _catches_import_error(h)]
        if handlers:
            self.scope.guards.append(tuple(s for h in handlers for s in _strings(h)))
        for statement in node.body:
            self.visit(statement)
        if handlers:
            self.scope.guards.pop()
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    visit_TryStar = visit_Try

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module is not None:  # relative imports stay in the project
            self._add(node.module, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        literal = (
            node.args[0].value
            if node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            else None
        )
        if literal is not None and not literal.startswith("."):
            if called == "import_module":
                self._add(literal, node.lineno)
            elif called == OPTIONAL_HELPER:
                extra = next(
                    (k.value for k in node.keywords if k.arg == "extra"),
                    node.args[1] if len(node.args) > 1 else None,
                )
                named = (
                    extra.value
                    if isinstance(extra, ast.Constant) and isinstance(extra.value, str)
                    else None
                )
                # the helper is the guard; its message is the extra it names, if any
                self._add(literal, node.lineno, (f"[{named}]",) if named else ())
        self.generic_visit(node)


def walk_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Module name -> source file, for every ``.py`` file of `packages` under `root`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts).removesuffix(".__init__")] = path
    return modules


def find_imports(root: Path, packages: Iterable[str]) -> list[Import]:
    """Every import that the modules of `packages` under `root` can run."""
    found = []
    for module, path in walk_modules(root, packages).items():
        visitor = _ImportVisitor(module, path)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        found.extend(visitor.found)
    return found


def _extras_named(messages: Sequence[str], project: str) -> set[str]:
    """The extras a guard's message tells the user to install: ``streamds[remote,bench]``."""
    pattern = re.compile(rf"(?:{re.escape(project)})?\[([A-Za-z0-9_,\s-]+)\]")
    return {
        extra.strip()
        for message in messages
        for match in pattern.finditer(message)
        for extra in match.group(1).split(",")
    }


def undeclared_imports(
    root: Path,
    packages: Sequence[str],
    project: Project,
    distributions: Mapping[str, Sequence[str]],
) -> list[str]:
    """One line per import that a user with the declared dependencies only cannot run.

    `distributions` maps a top-level import name to the distributions that provide it, as
    `importlib.metadata.packages_distributions()` does.
    """
    local = set(packages) | set(sys.stdlib_module_names)
    problems = []
    for found in find_imports(root, packages):
        if found.top in local:
            continue
        where = found.where(root)
        provided = {normalize(name) for name in distributions.get(found.top, ())}
        if not provided:
            problems.append(
                f"{where}: imports {found.top!r}, which no installed distribution provides; "
                "install it and declare it in [project].dependencies"
            )
            continue
        if provided & project.dependencies:
            continue
        missing = " or ".join(sorted(provided))
        extras = sorted(e for e, reqs in project.extras.items() if provided & reqs)
        fix = f"declare {missing!r} in [project].dependencies of pyproject.toml"
        if not found.in_function:
            problems.append(
                f"{where}: imports {found.top!r} at import time, but distribution {missing!r} is "
                f"not in [project].dependencies; {fix} (a guard at module level does not help: "
                "the module fails to import without it)"
            )
        elif not found.guarded:
            problems.append(
                f"{where}: imports {found.top!r} in a function, unguarded, but distribution "
                f"{missing!r} is not in [project].dependencies; {fix}, or wrap the import in "
                "try/except ImportError raising a message that names the extra to install"
                + (f" ({project.name}[{extras[0]}])" if extras else "")
            )
        elif not set(extras) & _extras_named(found.messages, project.name):
            named = sorted(_extras_named(found.messages, project.name))
            problems.append(
                f"{where}: imports {found.top!r} (distribution {missing!r}, not in "
                "[project].dependencies) under an ImportError guard whose message names "
                + (f"extras {named}, none of which provides it" if named else "no extra")
                + f"; {fix}, or name "
                + (f"'{project.name}[{extras[0]}]'" if extras else "an extra that provides it")
                + " in the message"
            )
    return problems


# -- the project -----------------------------------------------------------------------------


def test_every_import_is_covered_by_the_declared_dependencies() -> None:
    problems = undeclared_imports(
        REPO,
        PACKAGES,
        Project.read(REPO / "pyproject.toml"),
        importlib.metadata.packages_distributions(),
    )
    assert not problems, (
        "imports that `pip install streamds` (declared dependencies only) cannot run:\n  "
        + "\n  ".join(problems)
    )


def test_the_walk_sees_every_module_and_the_third_party_imports() -> None:
    modules = walk_modules(REPO, PACKAGES)
    expected = {"streamds", "streamds.datasets.dataset", "streamds.tools.cli", "preprocess.writers"}
    assert expected <= set(modules)
    found = find_imports(REPO, PACKAGES)
    tops = {f.top for f in found}
    # the packages really import these: a walk that saw nothing would pass the check above
    assert {"torch", "orjson", "zstandard", "fsspec", "tqdm", "webdataset"} <= tops
    assert any(f.top == "torch" and f.in_function for f in found)  # streamds.world
    assert any(f.top == "torch" and f.guarded for f in found)  # inside try/except ImportError


def test_the_check_would_have_caught_the_xxhash_gap() -> None:
    real = Project.read(REPO / "pyproject.toml")
    without = Project(real.name, real.dependencies - {"xxhash"}, real.extras)
    problems = undeclared_imports(REPO, PACKAGES, without, {"xxhash": ["xxhash"]} | dict(
        importlib.metadata.packages_distributions()))
    flagged = [p for p in problems if "'xxhash'" in p]
    assert flagged and len(flagged) == len(problems), problems
    assert any(p.startswith("preprocess.writers (preprocess/writers.py:") for p in flagged)


# -- the checker itself ----------------------------------------------------------------------

SYNTHETIC = {
    "pkg/__init__.py": "from .core import run\n",
    "pkg/core.py": (
        "from __future__ import annotations\n"  # 1
        "import json, os.path\n"  # 2: standard library
        "from typing import TYPE_CHECKING\n"  # 3
        "import orjson\n"  # 4: declared
        "import fastjson.fast\n"  # 5: undeclared, at import time
        "from . import helpers\n"  # 6: relative
        "from pkg.helpers import optional_import\n"  # 7: the project itself
        "if TYPE_CHECKING:\n"  # 8
        "    import hinted\n"  # 9: never runs
        "try:\n"  # 10
        "    import yaml\n"  # 11: guarded, but at import time
        "except ImportError as err:\n"  # 12
        "    raise ImportError(\"pip install 'pkg[yaml]'\") from err\n"  # 13
        "def run():\n"  # 14
        "    import requests\n"  # 15: undeclared, in a function, unguarded
        "    try:\n"  # 16
        "        import yaml\n"  # 17: guarded, names the extra: fine
        "    except (ModuleNotFoundError, OSError) as err:\n"  # 18
        "        raise ImportError(f\"{err}; pip install 'pkg[yaml]'\") from err\n"  # 19
        "    try:\n"  # 20
        "        import xxhash\n"  # 21: guarded, no extra named
        "    except ImportError:\n"  # 22
        "        xxhash = None\n"  # 23
        "    try:\n"  # 24
        "        import xxhash\n"  # 25: guarded, names an extra without it
        "    except ImportError:\n"  # 26
        "        raise RuntimeError('pip install \"pkg[yaml]\"') from None\n"  # 27
        "    try:\n"  # 28
        "        import yaml\n"  # 29: a handler for another error is no guard
        "    except KeyError:\n"  # 30
        "        raise ImportError(\"pip install 'pkg[yaml]'\") from None\n"  # 31
        "    optional_import('xxhash', extra='fast')\n"  # 32: the helper, right extra
        "    optional_import('xxhash', extra='yaml')\n"  # 33: the helper, wrong extra
        "    import importlib\n"  # 34
        "    return importlib.import_module('notinstalled.sub')\n"  # 35: provided by nothing
        "class Later:\n"  # 36
        "    import requests\n"  # 37: a class body runs at import time
    ),
    "pkg/helpers.py": "def optional_import(module, extra):\n    return __import__(module)\n",
}
SYNTHETIC_DISTRIBUTIONS = {
    "orjson": ["orjson"],
    "fastjson": ["fast_json"],
    "yaml": ["PyYAML"],
    "requests": ["requests"],
    "xxhash": ["xxhash"],
    "hinted": ["hinted"],
}


def write_package(root: Path, files: Mapping[str, str], pyproject: str) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / "pyproject.toml").write_text(pyproject, encoding="utf-8")


def test_the_check_names_module_line_and_distribution_of_each_undeclared_import(
    tmp_path: Path,
) -> None:
    write_package(
        tmp_path,
        SYNTHETIC,
        '[project]\nname = "pkg"\ndependencies = ["orjson>=3"]\n'
        '[project.optional-dependencies]\nyaml = ["PyYAML>=6"]\n'
        'fast = ["xxhash>=3", "Fast.JSON"]\n',
    )
    problems = undeclared_imports(
        tmp_path, ["pkg"], Project.read(tmp_path / "pyproject.toml"), SYNTHETIC_DISTRIBUTIONS
    )
    lines = [re.fullmatch(r"pkg\.core \(pkg/core\.py:(\d+)\): .*", p) for p in problems]
    assert all(lines), problems
    by_line = {int(m.group(1)): m.group(0) for m in lines if m}
    assert len(by_line) == len(problems), problems  # one problem per line
    assert sorted(by_line) == [5, 11, 15, 21, 25, 29, 33, 35, 37]
    assert by_line[5].startswith("pkg.core (pkg/core.py:5): imports 'fastjson' at import time")
    assert "distribution 'fast-json'" in by_line[5]
    assert "at import time" in by_line[11]  # a module-level guard does not count
    assert "in a function, unguarded" in by_line[15] and "'requests'" in by_line[15]
    assert "names no extra" in by_line[21] and "'pkg[fast]'" in by_line[21]
    assert "extras ['yaml'], none of which provides it" in by_line[25]
    assert "unguarded" in by_line[29]  # `except KeyError` guards nothing
    assert "extras ['yaml']" in by_line[33]
    assert "'notinstalled', which no installed distribution provides" in by_line[35]
    assert "at import time" in by_line[37]


def test_declaring_the_distributions_clears_the_check(tmp_path: Path) -> None:
    write_package(
        tmp_path,
        SYNTHETIC,
        '[project]\nname = "pkg"\ndependencies = ["orjson", "fast_json", "pyyaml", '
        '"requests ; python_version >= \'3.8\'", "xxhash[extra]==3.*"]\n',
    )
    distributions = {**SYNTHETIC_DISTRIBUTIONS, "notinstalled": ["notinstalled"]}
    problems = undeclared_imports(
        tmp_path, ["pkg"], Project.read(tmp_path / "pyproject.toml"), distributions
    )
    assert problems == [
        "pkg.core (pkg/core.py:35): imports 'notinstalled' in a function, unguarded, but "
        "distribution 'notinstalled' is not in [project].dependencies; declare 'notinstalled' "
        "in [project].dependencies of pyproject.toml, or wrap the import in try/except "
        "ImportError raising a message that names the extra to install"
    ]


def test_a_transitive_dependency_is_not_a_declaration(tmp_path: Path) -> None:
    # webdataset requires PyYAML, but `import yaml` must still be declared in its own right
    write_package(
        tmp_path,
        {"pkg/__init__.py": "import yaml\n"},
        '[project]\nname = "pkg"\ndependencies = ["webdataset"]\n',
    )
    problems = undeclared_imports(
        tmp_path,
        ["pkg"],
        Project.read(tmp_path / "pyproject.toml"),
        {"yaml": ["PyYAML"], "webdataset": ["webdataset"]},
    )
    assert len(problems) == 1 and "distribution 'pyyaml' is not in" in problems[0]
