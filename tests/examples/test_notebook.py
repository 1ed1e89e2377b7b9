"""The quickstart notebook runs top to bottom in a real kernel: processes started, a study run, a figure shown."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "quickstart.ipynb"


def test_the_quickstart_notebook_executes_and_plots_inline(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    monkeypatch.setenv("CARDIOFL_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    results = [o for o in outputs if o.output_type == "execute_result"]
    assert results[0].data["text/plain"] == "'completed'"
    assert "(1, 'train', 'completed'" in results[1].data["text/plain"]
    assert "image/png" in results[-1].data  # the figure, inline
    assert os.path.isdir(tmp_path / "work")
