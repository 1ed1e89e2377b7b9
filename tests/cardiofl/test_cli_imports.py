"""`cardiofl --version`, `--help` and the read-only commands' help load no torch, numpy, scipy or server stack.

Each command runs in a fresh interpreter as `python -X importtime -m cardiofl ARGS`: the interpreter lists
every module it imports on stderr, so the test reads what the command loaded without changing how it runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Loaded only inside the commands that need them (training, model summaries and exports, tables of
# figures, the coordinator's server and database): a command that prints, or only asks the coordinator
# over HTTP, loads none of them.
HEAVY = frozenset({"torch", "numpy", "scipy", "fastapi", "uvicorn", "starlette", "sqlalchemy"})


def _run(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """`python -m cardiofl ARGS` in a fresh interpreter, and the top-level packages of the heavy modules it loaded."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cardiofl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    imported = {
        line.rpartition("|")[2].strip().split(".")[0]
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "cardiofl" in imported, done.stderr[-2000:]
    return done, imported & HEAVY


def test_importing_the_command_line_loads_no_heavy_module() -> None:
    code = f"import sys, cardiofl.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_the_version_loads_no_heavy_module() -> None:
    done, heavy = _run("--version")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("cardiofl ") and "(protocol " in done.stdout
    assert heavy == set()


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["study", "--help"],
        ["study", "list", "--help"],
        ["study", "show", "--help"],
        ["study", "watch", "--help"],
        ["site", "--help"],
        ["site", "list", "--help"],
        ["coordinator", "--help"],
        ["model", "--help"],
    ],
    ids=" ".join,
)
def test_a_commands_help_loads_no_heavy_module(args: list[str]) -> None:
    done, heavy = _run(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Usage: " in done.stdout and "cardiofl" in done.stdout
    assert heavy == set()


def test_a_command_that_needs_torch_still_loads_it() -> None:
    # The reading is sound: `model summary` builds the model, so torch shows where a command needs it.
    done, heavy = _run("model", "summary", "--preset", "tiny")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch" in heavy and "DualAttentionResNet1D" in done.stdout
