"""An earlier release's own code, from this repository's history, run in a subprocess on a test's database.

The release's tree comes from `git archive` (its coordinator, migrations and its tests' factories),
so a database it makes, or reads back after a downgrade, is exactly what that release would make
or read: nothing of this tree is imported there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from coordinator.db import make_engine
from coordinator.main import create_app
from coordinator.migrate import upgrade_database
from tests.conftest import coordinator_settings_for

ROOT = Path(__file__).resolve().parents[2]

# Every script runs the release's migrations on the database at sys.argv[1], then its body with the
# release's app open as `client` (its factories imported); the body leaves what it found in `result`.
_SCRIPT = """
import json, sys
from fastapi.testclient import TestClient
from coordinator.db import make_engine
from coordinator.main import create_app
from coordinator.migrate import upgrade_database
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import *

url = sys.argv[1]
engine = make_engine(url)
upgrade_database(engine)
engine.dispose()
with TestClient(create_app(coordinator_settings_for(url))) as client:
{body}
print(json.dumps(result))
"""

# A running study of 2 rounds over two freshly enrolled sites, its round 1 aggregated, and a draft study.
MAKE_STUDIES = """
running, headers = running_study(client, rounds=2)
for delta, (name, site) in enumerate(headers.items(), start=1):
    assert train_and_upload(client, site, float(delta), 10 * delta).status_code == 201
draft = create_study(client, list(headers))
tokens = {name: site["Authorization"].removeprefix("Bearer ") for name, site in headers.items()}
result = {"running": running, "draft": draft, "tokens": tokens}
"""


def release_tree(commit: str, into: Path) -> Path:
    """The tree of release `commit`, extracted under `into` (skip where this checkout's history lacks it)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True, check=False
    )
    if archive.returncode != 0:
        pytest.skip(f"the release {commit} is not in this checkout's git history")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_release(tree: Path, database_url: str, *bodies: str, args: Sequence[str] = ()) -> Any:
    """Run `bodies` (one after the other) with the release of `tree` on `database_url`; their `result`.

    `args` follow the database's URL in the script's sys.argv.
    """
    body = textwrap.indent("".join(textwrap.dedent(part) for part in bodies), "    ")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_")} | {"PYTHONPATH": str(tree)}
    ran = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(body=body), database_url, *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


def upgraded_app(database_url: str) -> TestClient:
    """The app of the tree under test on `database_url`, once its migrations brought the database to their head."""
    engine = make_engine(database_url)
    upgrade_database(engine)
    engine.dispose()
    return TestClient(create_app(coordinator_settings_for(database_url)))
