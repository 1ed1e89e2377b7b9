"""With CI=true an unreachable PostgreSQL fails the PostgreSQL tests; elsewhere they are skipped."""

import os
import subprocess
import sys

import pytest

TARGET = "tests/coordinator/test_migrations.py::test_upgrade_head_on_an_empty_database_equals_the_models"


def _run_against_a_closed_port(ci: bool) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if name != "CI"}
    env["CARDIOFL_TEST_POSTGRES_URL"] = "postgresql+psycopg://postgres@127.0.0.1:1/test"
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{TARGET}[postgres]"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(("ci", "outcome"), [(True, "1 failed"), (False, "1 skipped")])
def test_unreachable_postgres(ci: bool, outcome: str) -> None:
    result = _run_against_a_closed_port(ci)
    assert outcome in result.stdout, result.stdout[-2000:]
    assert "127.0.0.1:1/test is unreachable" in result.stdout
