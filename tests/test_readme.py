"""The README's self-contained examples (blocks that import and make their own data) run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = [
    block
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    if block.startswith(("import ", "from ")) and "tempfile" in block
]


def test_readme_has_a_runnable_resume_example():
    assert any("load_state_dict" in block for block in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(block: str, tmp_path: Path):
    script = tmp_path / "example.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_bad_input_row_names_a_test_that_exists():
    text = README.read_text()
    table = text[text.index("### What each bad input does"):]
    table = table[: table.index("\n## ")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) - 1 >= 30  # the header row, then one row per bad input
    tests = Path(__file__).resolve().parent
    for file, name in re.findall(r"`(test_\w+\.py)::(?:\*::)?(\w+)`", table):
        assert f"def {name}(" in (tests / file).read_text(), f"{file}::{name} is not a test"
