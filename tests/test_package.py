"""The package surface: lazy public names, and a command line that starts without torch."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import streamds

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves_and_all_is_sorted():
    assert streamds.__all__ == sorted(streamds.__all__)
    for name in streamds.__all__:
        assert getattr(streamds, name) is not None


def test_every_top_level_name_is_public():
    """One list of names: `streamds.NAME` reaches exactly the names of __all__."""
    assert set(streamds._HOMES) == set(streamds.__all__)


def test_streaming_jsonl_takes_at_most_ten_keywords():
    """DESIGN.md: the contract's eight (shuffle ... storage) and at most two more."""
    keywords = [p.name for p in inspect.signature(streamds.StreamingJsonl).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert {"shuffle", "seed", "buffer_size", "on_error", "rank", "world_size", "even_ranks",
            "storage"} <= set(keywords)
    assert len(keywords) <= 10, keywords


def user_texts() -> list[Path]:
    examples = ROOT / "examples"
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted(examples.rglob("*.py")), *sorted(examples.rglob("*.ipynb"))]


# where users are sent on purpose: the framework integrations (they import their framework)
# the writing side (`streamds convert`'s functions) and the sample generator (`streamds synthetic`)
OWN_NAMESPACES = ("streamds.integrations", "streamds.preprocess", "streamds.tools.synthetic")


def test_users_import_streamds_names_from_the_top_level():
    """The README, docs and examples take every streamds name from `streamds` itself, and each
    of those names is public there: no user is sent into an internal sub-module."""
    imported = re.compile(r"from (streamds(?:\.\w+)*) import (?:\(([^)]*)\)|([\w ,]+))")
    sent_in, missing = [], []
    for path in user_texts():
        text = path.read_text()
        if path.suffix == ".md":  # its code blocks
            text = "\n".join(re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S))
        for module, grouped, inline in imported.findall(text):
            if module.startswith(OWN_NAMESPACES):
                continue
            if module != "streamds":
                sent_in.append(f"{path.relative_to(ROOT)}: {module}")
                continue
            names = [part.split()[0] for part in (grouped or inline).split(",") if part.strip()]
            missing += [f"{path.relative_to(ROOT)}: {name}" for name in names
                        if name not in streamds.__all__]
    assert sent_in == [] and missing == []


def test_command_line_and_shard_writer_start_without_importing_torch():
    code = ("import sys, streamds.tools.cli, streamds.formats.seekable; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_unknown_name_is_an_attribute_error():
    try:
        streamds.NoSuchThing  # noqa: B018
    except AttributeError as err:
        assert "NoSuchThing" in str(err)
    else:
        raise AssertionError("expected AttributeError")
