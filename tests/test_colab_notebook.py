"""examples/colab.ipynb runs top to bottom off Colab, twice in the same place.

Every cell runs in a Jupyter kernel on this interpreter (a kernelspec written into a temporary
folder), with a local folder standing in for Google Drive and a generated PubMed-layout
corpus. The notebook asserts itself that the run resumed from its checkpoint on Drive yields
exactly the uninterrupted run's batches; a cell error fails this test. The second run finds the
shards and the tokenizer on "Drive" and must not convert again.
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


def _run(notebook: Path, cwd: Path) -> list[str]:
    """Execute every cell in `cwd`; the text each code cell printed, in order."""
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=240,
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()  # raises CellExecutionError naming the cell and its traceback
    return ["".join(out.get("text", "") for out in cell.get("outputs", []))
            for cell in nb.cells if cell.cell_type == "code"]


def test_the_colab_notebook_runs_and_resumes_exactly(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("JUPYTER_PATH", str(_kernelspec(tmp_path / "jupyter")))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's stand-in for Drive lives here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))

    first = "\n".join(_run(NOTEBOOK, work))
    assert "converted into" in first
    assert "are the uninterrupted run's, weights equal" in first
    manifest = tmp_path / "streamds-colab" / "drive" / "shards" / "manifest.json"
    written = manifest.stat().st_mtime_ns

    second = "\n".join(_run(NOTEBOOK, work))
    assert "shards already on Drive: not converting again" in second
    assert "converted into" not in second
    assert manifest.stat().st_mtime_ns == written
    assert "are the uninterrupted run's, weights equal" in second
