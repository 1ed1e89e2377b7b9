"""The report as objects for a notebook: matplotlib Figures made without pyplot, the tables as text, saved on demand."""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from cardiofl.experiment.config import LEARNED
from cardiofl.experiment.report import build_report, write_report
from tests.cardiofl.experiment.test_auto_heads import FIXED, results_file


def test_a_report_is_objects_and_touches_no_global_plotting_state(tmp_path: Path) -> None:
    backend = matplotlib.get_backend()
    grid = {**FIXED, ("learned heads", LEARNED): [(0.49, 0.60, 0.60), (0.51, 0.64, 0.61)]}
    report = build_report(results_file(tmp_path / "results.jsonl", grid))
    assert set(report.figures) == {"curves", "head_ratio_deltas", "gates"}
    assert all(isinstance(figure, Figure) for figure in report.figures.values())
    curves = report.figures["curves"].axes
    assert [axis.get_ylabel() for axis in curves] == ["global F1 (%)", "global mAP (%)"]
    assert {line.get_label() for line in curves[0].get_lines()} == {
        "FedDualAtt 8:0",
        "FedDualAtt 4:4",
        "FedDualAtt 0:8",
        f"learned heads {LEARNED}",
    }
    assert matplotlib.get_backend() == backend  # no backend forced on the caller (a notebook keeps its inline one)
    if "matplotlib.pyplot" in sys.modules:  # nothing registered with pyplot: no figure to close, none leaks
        assert sys.modules["matplotlib.pyplot"].get_fignums() == []
    assert report._repr_markdown_() == report.markdown and "| learned heads | learned |" in report.markdown
    assert report.csv.splitlines()[0].startswith("method,heads,seeds,")
    assert report.sites == ["a", "b"] and len(report.rows) == 4


def test_saving_a_report_writes_what_the_cli_writes(tmp_path: Path) -> None:
    results = results_file(tmp_path / "results.jsonl", FIXED)
    report = build_report(results)
    saved = report.save(tmp_path / "saved")
    written = write_report(results, tmp_path / "cli")
    assert sorted(saved) == sorted(written) == ["curves.png", "head_ratio_deltas.png", "table.csv", "table.md"]
    for name in ("table.md", "table.csv"):
        assert saved[name].read_bytes() == written[name].read_bytes()
    assert saved["table.md"].read_text() == report.markdown
    assert saved["table.csv"].read_bytes() == report.csv.encode()  # CSV's own \r\n line ends, kept
    for name in ("curves.png", "head_ratio_deltas.png"):
        assert saved[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
