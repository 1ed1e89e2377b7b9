"""The import contracts in pyproject.toml hold on the tree, and break when a change crosses a layer."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cardiofl", "coordinator", "site_agent", "shared")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the packages in `root`, with the contracts of `root/pyproject.toml`."""
    assert LINT_IMPORTS.exists(), "import-linter is a dev dependency: pip install -e '.[dev]'"
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )


def test_every_contract_is_kept_on_the_tree() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("coordinator/db.py", "from site_agent import device", "coordinator.db -> site_agent.device"),
        ("site_agent/backoff.py", "from coordinator import errors", "site_agent.backoff -> coordinator.errors"),
        ("shared/labels.py", "from coordinator import errors", "shared.labels -> coordinator.errors"),
        ("shared/model/network.py", "from cardiofl import demo", "shared.model.network -> cardiofl.demo"),
        ("site_agent/device.py", "from cardiofl.experiment import config", "site_agent.device -> cardiofl"),
        # shared/'s rooms: the wire below the study rooms, the terms below the checks that need the registry.
        ("shared/wire/protocol.py", "from shared.study import rules", "shared.wire.protocol -> shared.study.rules"),
        ("shared/terms/study_terms.py", "from shared.study import checks", "shared.terms.study_terms -> shared.study"),
        # An import made for type checking only is a dependency too: the terms' hidden cycle once ran through one.
        (
            "shared/terms/study_terms.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shared.algorithms import registry",
            "shared.terms.study_terms -> shared.algorithms.registry",
        ),
        # Nothing below the tensors floor loads torch.
        ("shared/wire/urls.py", "import torch", "shared.wire.urls -> torch"),
        ("shared/privacy/shamir.py", "from shared.privacy import client", "No cycles are allowed in shared.privacy"),
        ("site_agent/data/report.py", "from site_agent import worker", "No cycles are allowed in site_agent"),
        # The coordinator's rooms (coordinator/__init__.py): a lower room importing a higher one.
        (
            "coordinator/storage/blobs.py",
            "from coordinator.rounds import tasks",
            "coordinator.storage.blobs -> coordinator.rounds.tasks",
        ),
        (
            "coordinator/rounds/tasks.py",
            "from coordinator.studies import views",
            "coordinator.rounds.tasks -> coordinator.studies.views",
        ),
        (
            "coordinator/studies/views.py",
            "from coordinator.api import deps",
            "coordinator.studies.views -> coordinator.api.deps",
        ),
        (
            "coordinator/sites/access.py",
            "from coordinator.storage import blobs",
            "coordinator.sites.access -> coordinator.storage.blobs",
        ),
        ("coordinator/api/deps.py", "from coordinator import main", "coordinator.api.deps -> coordinator.main"),
        # The work signals and the server process sit at the bottom, beside sites and storage.
        (
            "coordinator/signals/work.py",
            "from coordinator.rounds import tasks",
            "coordinator.signals.work -> coordinator.rounds.tasks",
        ),
        ("coordinator/serving/tls.py", "from coordinator import main", "coordinator.serving.tls -> coordinator.main"),
        # The certificate authority, apart in both directions.
        (
            "coordinator/pki/tls.py",
            "from coordinator.rounds import opening",
            "coordinator.pki.tls -> coordinator.rounds.opening",
        ),
        (
            "coordinator/rounds/opening.py",
            "from coordinator.pki import tls",
            "coordinator.rounds.opening -> coordinator.pki.tls",
        ),
    ],
)
def test_a_change_that_crosses_a_layer_breaks_a_contract(tmp_path: Path, module: str, line: str, expected: str) -> None:
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    changed = tmp_path / module
    changed.write_text(changed.read_text() + f"\n{line}  # noqa: E402\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout
    assert expected in result.stdout
    assert "BROKEN" in result.stdout
