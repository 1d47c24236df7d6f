"""Every code block of README.md and docs/ runs as written.

The README is walked as a reader would: its blocks in order, in one empty folder, with the
installed `streamds` (the editable install here, the built wheel in .ci/clean_install.sh) and
nothing of the checkout on the path; its first block makes the data the others read.

Each ```python block of docs/ runs in a process of its own (this interpreter, the repository first
on the path; a fork of one that imported torch once, `forked_python.py`) in an empty temporary
directory. HTML comments on the lines just before a block's fence
change that (they do not show on GitHub or the docs site):

- ``<!-- setup: NAME -->``: first put the files of ``SETUPS[NAME]`` into that directory (the
  docs say so in words too, e.g. "a PubMed-layout ``train.txt``").
- ``<!-- skip: REASON -->``: do not run it, for a block that needs a GPU, a cluster, Colab or
  a multi-process launcher; the reason is the skip's.
- ``<!-- run -->``: run a ```bash block too (shell blocks run only where marked).
- ``<!-- runs: N -->``: run it N times in the same directory (a block that resumes from the
  checkpoint its previous run left); the last run must print "resumed", so that a block that
  only looks tested (a checkpoint never written, a resume that starts over) fails.
- ``<!-- save: NAME -->``: do not run this block; write it as NAME into the directory of the
  next block of the page, which runs it (a script launched by ``torchrun`` in a bash block).
- ``<!-- slow -->``: the block takes more than a few seconds (``pytest -m 'not slow'`` leaves it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from forked_python import ForkedPython

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^( *)```(\S*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*(setup|skip|runs|run|slow|save)\s*(?::\s*(.*?))?\s*-->\s*$")

# The files a `setup:` names, made once per test session with the commands a reader would run
# (`streamds synthetic` ships with the package).
SETUPS = {
    # train.txt alone (what `streamds convert` starts from)
    "pubmed-text": [
        ["{python}", "-m", "streamds.tools.cli", "synthetic", "pubmed", "train.txt", "--bytes",
         "2MB", "--record-chars", "2000"],
    ],
    # train.txt: ~430 PubMed-layout records (article_text: a list of sentences, abstract_text:
    # a list, long strings), and shards/: the same converted by `streamds convert`
    "pubmed": [
        ["{python}", "-m", "streamds.tools.cli", "synthetic", "pubmed", "train.txt", "--bytes",
         "2MB", "--record-chars", "2000"],
        ["{python}", "-m", "streamds.tools.cli", "convert", "train.txt", "--output", "shards/",
         "--quiet"],
    ],
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    directives: dict[str, str]
    files: tuple[tuple[str, str], ...] = ()  # (name, code) of the saved blocks just above

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of one Markdown page, with the directives just above each."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.group(1), opening.group(2)
        end = i + 1
        while not re.match(rf"^{indent}```\s*$", lines[end]):
            end += 1
        directives, above = {}, i - 1
        while above >= 0 and (directive := DIRECTIVE.match(lines[above])):
            directives[directive.group(1)] = directive.group(2) or ""
            above -= 1
        code = "\n".join(line[len(indent):] for line in lines[i + 1:end]) + "\n"
        found.append(Block(page, i + 1, language, code, directives))
        i = end + 1
    return _with_saved_files(found)


def _with_saved_files(found: list[Block]) -> list[Block]:
    """Each block with the `save:` blocks just above it as its files (a saved block is not
    run on its own)."""
    out: list[Block] = []
    saved: list[tuple[str, str]] = []
    for block in found:
        out.append(replace(block, files=tuple(saved)))
        if "save" in block.directives:
            saved.append((block.directives["save"], block.code))
        else:
            saved = []
    return out


BLOCKS = [block for page in PAGES for block in blocks_of(page)]
RUNNABLE = [block for block in BLOCKS if "save" not in block.directives
            and (block.language == "python" or "run" in block.directives)]
README = [block for block in RUNNABLE if block.page.name == "README.md"]


def _param(block: Block):
    marks = [pytest.mark.slow] if "slow" in block.directives else []
    if "skip" in block.directives:
        marks.append(pytest.mark.skip(reason=block.directives["skip"]))
    return pytest.param(block, id=block.id, marks=marks)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # compiled once, not in every block's process
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # `streamds` and `python` in a shell block are this interpreter's
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # blocks run 4 at a time: torch's intra-op threads, one per core in each process, would
    # spin against each other (a tiny model's step then costs 15x the CPU)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _make_setups(root: Path) -> dict[str, Path]:
    made = {}
    for name, commands in SETUPS.items():
        where = root / name
        where.mkdir()
        for command in commands:
            argv = [part.format(python=sys.executable) for part in command]
            subprocess.run(argv, cwd=where, env=_env(), check=True, capture_output=True)
        made[name] = where
    return made


def _installed_env() -> dict[str, str]:
    """The environment of a reader after `pip install`: this interpreter's `streamds` and
    `python` first on PATH, and nothing of the checkout added to the path."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _run(block: Block, where: Path, setups: dict[str, Path], *,
         env: dict[str, str] | None = None, python: ForkedPython | None = None) -> str | None:
    """Run `block` in the directory `where` (a Python block by `python` where given): None,
    or what went wrong (with every run's output, so a caller can read what the block
    printed)."""
    if "setup" in block.directives:
        shutil.copytree(setups[block.directives["setup"]], where, dirs_exist_ok=True)
    if block.language == "python":
        script = where / f"block{block.line}.py"
        argv = [sys.executable, str(script)]
    else:
        script = where / f"block{block.line}.sh"
        argv = ["bash", "-euo", "pipefail", str(script)]
    script.write_text(block.code)
    for name, code in block.files:
        (where / name).write_text(code)
    runs = int(block.directives.get("runs", 1))
    for run in range(runs):
        if python is not None and block.language == "python":
            status, stdout, stderr = python.run(script, where, timeout=300)
        else:
            done = subprocess.run(argv, cwd=where, env=env or _env(), capture_output=True,
                                  text=True, timeout=300)
            status, stdout, stderr = done.returncode, done.stdout, done.stderr
        (where / f"{script.stem}.out{run + 1}").write_text(stdout)
        if status:
            return f"{block.id} failed (run {run + 1}):\n{stdout[-2000:]}{stderr[-3000:]}"
    if runs > 1 and "resumed" not in stdout:
        return (f"{block.id}: run {runs} printed no 'resumed': the run before left no "
                f"checkpoint to resume from, or the block does not say so:\n{stdout[-2000:]}")
    return None


@pytest.fixture(scope="session")
def outcomes(request, tmp_path_factory) -> dict[str, str | None]:
    """Every selected block, run a few at a time (most of a block's time is starting Python,
    torch and DataLoader workers, which overlap well): block id -> None or the failure."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "callspec", None) and "block" in item.callspec.params
                and not item.get_closest_marker("skip")]
    root = tmp_path_factory.mktemp("blocks")
    setups = _make_setups(root)
    wheres = {block.id: root / f"block{i}" for i, block in enumerate(selected)}
    for where in wheres.values():
        where.mkdir()
    (root / "outputs").mkdir()
    python = ForkedPython(_env(), root, root / "outputs")
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = {block.id: pool.submit(_run, block, wheres[block.id], setups,
                                             python=python)
                       for block in selected}
            return {key: future.result() for key, future in futures.items()}
    finally:
        python.close()


@pytest.mark.parametrize("block", [_param(block) for block in RUNNABLE if block not in README])
def test_block_runs(block: Block, outcomes: dict[str, str | None]):
    failure = outcomes[block.id]
    assert failure is None, failure


def test_the_readme_runs_in_order_in_one_folder(tmp_path, tmp_path_factory):
    """A new user's walk: every README block in order, in one empty folder, with the installed
    package; the resume block, run twice, resumes mid-epoch and ends where the first run did."""
    assert README[0].language == "bash" and "streamds synthetic" in README[0].code
    outputs = tmp_path_factory.mktemp("readme-outputs")
    python = ForkedPython(_installed_env(), tmp_path, outputs)
    try:
        for block in README:
            assert "setup" not in block.directives, f"{block.id}: the walk makes its own data"
            if "skip" in block.directives:
                continue
            failure = _run(block, tmp_path, {}, env=_installed_env(), python=python)
            assert failure is None, failure
    finally:
        python.close()
    twice = [block for block in README if block.directives.get("runs") == "2"]
    assert len(twice) == 1, "the README has one resume block, run twice"
    first, second = ((tmp_path / f"block{twice[0].line}.out{run}").read_text()
                     for run in (1, 2))
    ended = re.findall(r"epoch done after batch (\d+)", first + second)
    resumed = re.findall(r"resumed after batch (\d+)", second)
    assert len(ended) == 2 and ended[0] == ended[1], (first, second)
    assert resumed and 0 < int(resumed[0]) < int(ended[0]), second  # mid-epoch, not over


def test_every_block_is_run_or_skipped_with_a_reason():
    for block in BLOCKS:
        assert block.language, f"{block.id}: a fence without a language (python, bash, text)"
        assert block.language not in ("py", "python3", "sh", "shell"), (
            f"{block.id}: write ```python or ```bash so the test finds the block")
        if "skip" in block.directives:
            assert block.directives["skip"], f"{block.id}: <!-- skip: REASON --> needs a reason"
        if "setup" in block.directives:
            assert block.directives["setup"] in SETUPS, f"{block.id}: no setup of that name"
        if "save" in block.directives:
            assert block.directives["save"], f"{block.id}: <!-- save: NAME --> needs a name"
            after = [other for other in BLOCKS if other.page == block.page
                     and other.line > block.line]
            assert after and after[0] in RUNNABLE and "skip" not in after[0].directives, (
                f"{block.id}: a saved block must be followed by the block that runs it")
    assert sum(block.page.name == "README.md" for block in RUNNABLE) >= 4


def test_the_readme_is_short_and_runs_convert_as_written():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    convert = [block for block in RUNNABLE
               if block.page.name == "README.md" and "streamds convert" in block.code]
    assert convert and all("skip" not in block.directives for block in convert)


def test_no_commit_ids_in_the_docs():
    commit = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not commit.search(line), f"{page.name}:{number}: a commit id: {line.strip()}"


def test_every_bad_input_row_names_a_test_that_exists():
    text = (ROOT / "docs" / "errors.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 30
    tests = ROOT / "tests"
    named = re.findall(r"`(test_\w+\.py)::(?:\*::)?(\w+)`", text)
    assert len(named) >= 20
    for file, name in named:
        assert f"def {name}(" in (tests / file).read_text(), f"{file}::{name} is not a test"
