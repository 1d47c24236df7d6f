"""The converter (the writing side), as the package `streamds.preprocess`, in a source checkout.

Its modules live in the checkout's top-level `preprocess/` folder. An installed streamds holds
them here instead (pyproject.toml maps `preprocess/` to `streamds/preprocess/` in the wheel, and
leaves this file out), so the converter has one name, `streamds.preprocess`, installed or not:
no generic top-level `preprocess` in site-packages for a user's own `preprocess.py` to shadow,
and Dask workers import the converter by that one name. This file points the package at the
folder, so that a checkout on ``sys.path`` runs the checkout's own converter.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "preprocess")]
