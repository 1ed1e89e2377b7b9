"""Rooms stay small: no module over 450 lines and no function over 80 outside tests and migrations."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("cardiofl", "coordinator", "site_agent", "shared", "bench")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(path for root in SOURCES for path in (REPO / root).rglob("*.py") if "__pycache__" not in path.parts)


def test_the_sources_are_found() -> None:
    assert len(_modules()) > 150


def test_no_module_is_over_450_lines() -> None:
    long = {
        str(p.relative_to(REPO)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these modules into rooms of at most {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = length
    assert long == {}, f"split these functions (at most {MAX_FUNCTION_LINES} lines, one job each): {long}"
