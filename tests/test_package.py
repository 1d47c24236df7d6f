"""The package surface: lazy public names, and a command line that starts without torch."""

from __future__ import annotations

import subprocess
import sys

import streamds


def test_every_public_name_resolves_and_all_is_sorted():
    assert streamds.__all__ == sorted(streamds.__all__)
    for name in streamds.__all__:
        assert getattr(streamds, name) is not None


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
