"""What the demo prints of its rounds: each line and each table row of the same two models, a note, no dead link."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from rich.console import Console

from cardiofl.demo_report import DemoReport, restart_command, round_line, round_tables, stopped_lines, table_note
from shared.wire.api import RoundPublic

AT = "2026-01-01T00:00:00Z"


def summary(micro_f1: float, map_: float, auroc: float) -> dict[str, Any]:
    return {"micro_f1": micro_f1, "map": map_, "macro_auroc": auroc, "n_samples": 40}


def a_round(number: int, status: str = "completed", *, kind: str = "train", read: bool = True) -> RoundPublic:
    """Round `number` of two sites: its own models' figures, and θ^g_t's once `read` (in round t + 1)."""
    update = {
        **{"num_examples": 100, "sha256": "0" * 64, "size": 10, "weight": 0.5, "train_seconds": 1.0},
        **{"received_at": AT, "train_loss": 0.3, "eval": None},
        "local_eval": summary(0.0 if number < 3 else 0.4, 0.2, 0.6),
    }
    pooled = {
        "train_loss": None if kind == "evaluate" else 0.4 - number / 100,
        "eval": summary(0.0 if number < 3 else 0.3, 0.1 + number / 100, 0.5 + number / 100)
        if read and kind == "train"
        else None,
        "local_eval": summary(0.0 if number < 3 else 0.4, 0.2, 0.6),
        "global_label": "Global",
    }
    return RoundPublic.model_validate(
        {
            **{"id": number, "study_id": 1, "number": number, "attempt": 1, "kind": kind, "status": status},
            **{"participants": {"site-1": 1.0, "site-2": 1.0}, "opened_at": AT, "deadline_at": AT, "closed_at": AT},
            **{"note": "", "base_sha256": "0" * 64, "base_size": 10, "global_model_sha256": None},
            "updates": [{**update, "site": site} for site in ("site-1", "site-2")],
            "pooled": pooled if status == "completed" else None,
        }
    )


def test_a_rounds_line_names_its_own_round_for_both_models() -> None:
    line = round_line(a_round(3))
    assert line == (
        "round 3: 2 sites, train loss 0.370; own models after round 3 (mean): micro-F1 0.400 mAP 0.200 "
        "macro-AUROC 0.600; global model θ^g_3 (pooled): micro-F1 0.300 mAP 0.130 macro-AUROC 0.530"
    )
    final = round_line(a_round(5, kind="evaluate"))
    assert final.startswith("final evaluation: 2 sites, nothing trained; each site's θ^g_4 with its own")
    assert "global" not in final and "train loss" not in final


def test_a_round_is_printed_once_its_global_model_was_read_and_in_order() -> None:
    report = DemoReport()
    rounds = [a_round(1, read=False), a_round(2, "open")]
    assert report.new_lines(rounds, finished=False) == []  # θ^g_1 is read in round 2
    rounds = [a_round(1), a_round(2, "open")]
    assert report.new_lines(rounds, finished=False) == []  # by the sites that reported so far: not all yet
    rounds = [a_round(1), a_round(2, read=False), a_round(3, "open")]
    assert [line.split(":")[0] for line in report.new_lines(rounds, finished=False)] == ["round 1"]
    rounds = [a_round(1), a_round(2), a_round(3, read=False), a_round(4, kind="evaluate")]
    printed = report.new_lines(rounds, finished=True)
    assert [line.split(":")[0] for line in printed] == ["round 2", "round 3", "final evaluation"]
    assert report.new_lines(rounds, finished=True) == []  # each line once
    assert "global model θ^g_3 (pooled): micro-F1 – mAP – macro-AUROC –" in printed[1]  # never read: a dash


def test_each_tables_row_holds_the_lines_figures_and_a_note_reads_them() -> None:
    rounds = [a_round(1), a_round(2), a_round(3), a_round(4, kind="evaluate")]
    console = Console(width=200, record=True)
    for table in round_tables(rounds):
        console.print(table)
    text = console.export_text()
    title = " ".join(text.split("┏")[0].split())  # as wrapped to the table's width
    assert title == "micro-F1: each site's own model after the round, and the round's global model θ^g_t (pooled)"
    row = next(line for line in text.splitlines() if line.startswith("│ 3 "))
    assert row.split("│")[-2].strip() == "0.300"  # the micro-F1 that round 3's line gives θ^g_3
    note = table_note(rounds)
    assert len(note) == 2
    assert (
        "it scores each site's θ^g_3 with its own φ_k (site columns) and θ^g_3 with the initial local part φ_0"
        in note[0]
    )
    assert "right after its own training, before it is averaged" in note[0] and "below round 3" in note[0]
    assert "a 0.000 (the global model in rounds 1–2) means that no record's true label scored that high" in note[1]
    assert table_note([a_round(3)]) == []  # no final evaluation, no zero: nothing to explain


def test_after_the_stop_nothing_points_at_the_dashboard_and_a_restart_command_is_given(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'coordinator.db'}"
    lines = stopped_lines(database, 8123, tmp_path / "card.md")
    assert lines[0].startswith("the coordinator has stopped, and the dashboard with it")
    assert not [line for line in lines if "http" in line or "/dashboard" in line]
    assert (
        f"  {restart_command(database, 8123)}" in lines and lines[-1] == f"the study's model card: {tmp_path}/card.md"
    )
    command = shlex.split(restart_command(database, 8123))  # run by tests/cardiofl/test_demo.py after a demo
    assert command[0] == f"CARDIOFL_DATABASE_URL={database}" and command[-4:] == [
        "coordinator",
        "serve",
        "--port",
        "8123",
    ]
    other = stopped_lines(None, 8123, None)  # another database: its URL is not printed
    assert "CARDIOFL_DATABASE_URL set to the demo's --database-url" in other[-1]


def test_another_algorithms_own_model_is_named_by_it() -> None:
    line = round_line(a_round(5, kind="evaluate"), "fedprox_adaptive")
    assert "each site's its own" not in line and "each site's own fedprox_adaptive model from θ^g_4 (mean)" in line
