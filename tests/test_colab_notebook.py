"""examples/colab.ipynb runs off Colab: a session that loses its runtime, then a restart.

Every cell runs in a Jupyter kernel on this interpreter (a kernelspec written into a temporary
folder), with a local folder standing in for Google Drive and a generated PubMed-layout
corpus. The first session runs the cells up to the simulated disconnect; a new kernel (the
restart) then runs every cell: it must find the shards and the tokenizer on "Drive" and not
convert again, and resume from the checkpoint on "Drive". The notebook asserts itself that the
resumed run yields exactly the uninterrupted run's batches and weights; a cell error fails this
test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

DEV = "running a notebook needs nbformat, nbclient and ipykernel (the 'dev' extra)"
nbformat = pytest.importorskip("nbformat", reason=DEV)
nbclient = pytest.importorskip("nbclient", reason=DEV)
pytest.importorskip("ipykernel", reason=DEV)
pytest.importorskip("tokenizers", reason="the notebook's tokenizer needs the 'example' extra")
pytest.importorskip("torchdata", reason="ds.loader needs torchdata (the 'dev' extra)")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "colab.ipynb"
KERNEL = "streamds-test-python"


def _kernelspec(where: Path) -> Path:
    """A kernelspec named KERNEL that starts this interpreter; returns the JUPYTER_PATH dir."""
    spec = where / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps(
        {"argv": argv, "display_name": KERNEL, "language": "python"}))
    return where


def _run(notebook: Path, cwd: Path, *, until: str | None = None) -> list[str]:
    """Execute the cells in `cwd` (all, or those before the first markdown cell starting with
    `until`); the text each code cell printed, in order."""
    nb = nbformat.read(notebook, as_version=4)
    if until is not None:
        stop = next(i for i, cell in enumerate(nb.cells)
                    if cell.cell_type == "markdown" and cell.source.startswith(until))
        nb.cells = nb.cells[:stop]
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=240,
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()  # raises CellExecutionError naming the cell and its traceback
    return ["".join(out.get("text", "") for out in cell.get("outputs", []))
            for cell in nb.cells if cell.cell_type == "code"]


def test_the_colab_notebook_resumes_exactly_after_a_restart(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("JUPYTER_PATH", str(_kernelspec(tmp_path / "jupyter")))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's stand-in for Drive lives here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))

    # the first session: converts, trains, and loses its runtime after step 12
    first = "\n".join(_run(NOTEBOOK, work, until="## 7."))
    assert "converted into" in first
    assert "disconnected; checkpoint on Drive at step 10" in first
    manifest = tmp_path / "streamds-colab" / "drive" / "shards" / "manifest.json"
    written = manifest.stat().st_mtime_ns

    # a restart: a new kernel runs every cell; only "Drive" is left of the first session
    second = "\n".join(_run(NOTEBOOK, work))
    assert "shards already on Drive: not converting again" in second
    assert "converted into" not in second
    assert manifest.stat().st_mtime_ns == written
    assert "an unfinished run is on Drive at step 10" in second
    assert "resumed at step 10: batches 10-19" in second  # asserted equal in the notebook
