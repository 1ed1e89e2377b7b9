"""`cardiofl --version`, `--help` and the read-only commands' help load no torch, numpy, scipy or server stack.

Each command runs in a fresh interpreter as `python -X importtime -m cardiofl ARGS`: the interpreter lists
every module it imports on stderr, so the test reads what the command loaded without changing how it runs.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shared.wire.api import Page, SitePublic, TokenPublic

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


def test_the_coordinators_app_loads_no_scipy() -> None:
    """No scipy in the server's imports: scipy.stats and scipy.special cost every coordinator process ~1 s of CPU.

    The figures that use them (AUROC's ranks, calibration bins, the precision sums) import them when they run.
    """
    code = "import sys, coordinator.main; print(sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))"
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


class _Reads(BaseHTTPRequestHandler):
    """A coordinator's reads as a plain HTTP server: the canned answer of each path (tests/cardiofl/job_results.py)."""

    answers: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 - the handler's protocol
        body = self.answers.get(self.path.split("?")[0])
        self.send_response(200 if body is not None else 404)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body if body is not None else b'{"error": {"code": "not_found", "message": "no such path"}}')

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the handler's protocol
        """Quiet."""


@pytest.fixture(scope="module")
def coordinator_url() -> Iterator[str]:
    """The URL of a server answering the read views of a completed training study, a survey and an evaluation."""
    from tests.cardiofl.job_results import answers, study

    sites = Page[SitePublic](data=[], count=0)
    _Reads.answers = {path: view.model_dump_json().encode() for path, view in answers().items()}
    _Reads.answers["/api/v1/sites"] = sites.model_dump_json().encode()
    _Reads.answers["/api/v1/tokens"] = Page[TokenPublic](data=[], count=0).model_dump_json().encode()
    assert study(1).status == "completed"  # `study watch` of it prints its rounds and returns
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Reads)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    "args",
    [["study", "list"], ["study", "show", "1"], ["study", "show", "2"], ["study", "watch", "1"], ["site", "list"]],
    ids=" ".join,
)
def test_a_read_only_command_loads_no_heavy_module(args: list[str], coordinator_url: str) -> None:
    done, heavy = _run(*args, "--url", coordinator_url, "--token", "cfl_reader")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert heavy == set()
