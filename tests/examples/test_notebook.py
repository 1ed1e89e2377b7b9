"""The quickstart notebook runs top to bottom in a real kernel: processes started, a study run, a figure shown."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "quickstart.ipynb"
# run after the notebook's own cells: what it plotted, and whether its folder is still there
CHECK = "import json\nprint(json.dumps({'curves': curves, 'workdir': str(WORKDIR), 'left': WORKDIR.exists()}))"


def test_the_quickstart_notebook_executes_plots_inline_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(CHECK))
    monkeypatch.delenv("CARDIOFL_NOTEBOOK_WORKDIR", raising=False)  # its own temporary folder, here
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    streams = "".join(o.text for o in outputs if o.output_type == "stream")
    assert "ipywidgets" not in streams and "Warning" not in streams  # no live bar asking for widgets
    results = [o for o in outputs if o.output_type == "execute_result"]
    assert results[0].data["text/plain"] == "'completed'"
    assert "(1, 'train', 'completed'" in results[1].data["text/plain"]
    assert "image/png" in results[-1].data  # the figure, inline
    printed = [o for o in outputs if o.output_type == "display_data" and "text/plain" in o.data]
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(o.data["text/plain"] for o in printed))  # rich's colours out
    before, after = text.split("the coordinator has stopped")  # said once
    assert "/dashboard?study=" in before and "/dashboard" not in after and "http" not in after
    checked = json.loads(streams.splitlines()[-1])
    assert Path(checked["workdir"]).parent == tmp_path and not checked["left"]  # the temporary folder went
    assert not list(tmp_path.glob("cardiofl-quickstart-*"))
    for name, curve in checked["curves"].items():  # three rounds of each, and none of them flat
        assert len(curve) == 3 and len({value for _, value in curve}) > 1, (name, curve)
