"""A plug-in distribution without a RECORD (or an empty or unreadable one) has no identity, and is refused everywhere.

Without this, every such distribution hashed as no file at all: two different plug-ins had the one identity.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from shared.algorithms.registry import ALGORITHMS, PRESETS, terms_plugin_problems
from shared.errors import PluginIdentityError, StudyRuleError
from shared.plugins import PluginIdentity, plugin_identity
from tests.cardiofl.test_plugins import PLUGIN, expected_identity, forget_registries, install
from tests.coordinator.factories import ADMIN, enrol
from tests.site_agent.test_agent import SITES
from tests.site_agent.test_differential_privacy import config

# How a RECORD can fail a plug-in, and what the refusal says of it.
DEFECTS = {
    "missing": "has no RECORD file",
    "empty": "has an empty RECORD file",
    "not utf-8": "has a RECORD file that cannot be read",
    "lists nothing": "has a RECORD file that lists none of its files",
    "lists a missing file": f"cannot read {PLUGIN}/gone.py, which its RECORD lists",
}
REINSTALL = "reinstall it from a wheel with pip"


def spoil(root: Path, defect: str, name: str = PLUGIN) -> Path:
    """The distribution installed at `root` with its RECORD spoiled as `defect` says; its dist-info folder."""
    info = root / f"{name}-1.0.dist-info"
    record = info / "RECORD"
    if defect == "missing":
        record.unlink()
    elif defect == "empty":
        record.write_text(" \n")
    elif defect == "not utf-8":
        record.write_bytes(b"\xff\xfe" + record.read_bytes())
    elif defect == "lists nothing":  # only what the identity leaves out: bytecode and the installer's own files
        record.write_text(f"{name}/__pycache__/__init__.cpython-311.pyc,,\n{info.name}/RECORD,,\n")
    elif defect == "lists a missing file":
        record.write_text(record.read_text() + f"{name}/gone.py,sha256=AAAA,1\n")
    return info


@pytest.fixture(params=sorted(DEFECTS))
def spoiled(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The example plug-in installed on sys.path with a spoiled RECORD for this test only; the defect."""
    root = install(tmp_path / "site-packages")
    spoil(root, request.param)
    sys.path.insert(0, str(root))
    forget_registries()
    yield request.param
    sys.path.remove(str(root))
    forget_registries()


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_a_distribution_with_a_spoiled_record_has_no_identity(tmp_path: Path, defect: str) -> None:
    info = spoil(install(tmp_path / "site-packages"), defect)
    with pytest.raises(PluginIdentityError) as refused:
        plugin_identity(metadata.PathDistribution(info))
    message = str(refused.value)
    assert DEFECTS[defect] in message and REINSTALL in message
    assert f"plug-in distribution {PLUGIN!r} 1.0 at {tmp_path / 'site-packages'}" in message
    assert isinstance(refused.value, StudyRuleError)  # what shared/plugins.py refuses with, as before


def test_two_distributions_without_record_no_longer_look_alike(tmp_path: Path) -> None:
    """They hashed alike (sha256 of nothing) whatever their files; now neither has an identity to compare."""
    first = spoil(install(tmp_path / "one"), "missing")
    other = "cardiofl_other_proximal"
    second = spoil(install(tmp_path / "two", name=other), "missing", name=other)
    (second.parent / other / "__init__.py").write_text("RULE = None  # other code altogether\n")
    for info in (first, second):
        with pytest.raises(PluginIdentityError, match="has no RECORD file"):
            plugin_identity(metadata.PathDistribution(info))


def test_a_site_refuses_to_approve_or_run_a_plugin_without_identity(spoiled: str, tmp_path: Path) -> None:
    from site_agent.approvals import Approvals
    from site_agent.errors import AgentError, TaskMismatch
    from site_agent.store import SiteStore
    from site_agent.task_check import check_task
    from tests.site_agent.test_task_check import honest, terms

    with pytest.raises(PluginIdentityError, match=DEFECTS[spoiled]):
        ALGORITHMS.plugin("proximal")
    named = PluginIdentity(distribution=PLUGIN, version="1.0", sha256="e3b0c44298fc1c149afbf4c8996fb924" * 2)
    for plugin in (named, None):  # the terms name an identity (even the empty one's), or none
        problem = ALGORITHMS.problem("proximal", plugin) or ""
        assert problem.startswith("algorithm 'proximal': plug-in distribution") and DEFECTS[spoiled] in problem
    assert DEFECTS[spoiled] in (PRESETS.problem("mini", None) or "")
    approved = terms(algorithm={"name": "proximal", "plugin": named.model_dump()})
    assert len(terms_plugin_problems(approved)) == 1
    with pytest.raises(TaskMismatch, match=f"algorithm 'proximal': .*{DEFECTS[spoiled]}"):
        check_task(honest(approved), approved, "oslo")
    store = SiteStore(tmp_path / "store", b"k" * 32, "oslo")
    with pytest.raises(AgentError, match=f"cannot be approved here: algorithm 'proximal': .*{DEFECTS[spoiled]}"):
        Approvals(store).approve(honest(approved), by="operator")


def test_the_coordinator_refuses_a_study_of_a_plugin_without_identity(spoiled: str, coordinator: TestClient) -> None:
    for name in SITES:
        enrol(coordinator, name)
    for part in ({"algorithm": {"name": "proximal"}}, {"model": {"preset": "mini"}}):
        values = config(**part, aggregation={"name": "samples"})
        refused = coordinator.post("/api/v1/studies", json={"name": "t", "config": values}, headers=ADMIN)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "plugin_unidentifiable"
        assert DEFECTS[spoiled] in error["message"] and PLUGIN in error["message"]
    assert coordinator.get("/api/v1/studies", headers=ADMIN).json()["count"] == 0


def test_a_coordinator_names_the_same_plugin_once_its_record_is_restored(tmp_path: Path) -> None:
    """The refusal is of the RECORD, not of the plug-in: reinstalled whole, it has its identity again."""
    root = install(tmp_path / "site-packages")
    info = root / f"{PLUGIN}-1.0.dist-info"
    kept = (info / "RECORD").read_bytes()
    spoil(root, "missing")
    with pytest.raises(PluginIdentityError):
        plugin_identity(metadata.PathDistribution(info))
    (info / "RECORD").write_bytes(kept)
    assert plugin_identity(metadata.PathDistribution(info)) == expected_identity(root, PLUGIN, "1.0")


def test_plugins_list_shows_why_a_plugin_is_refused(spoiled: str) -> None:
    shown = CliRunner().invoke(app, ["plugins", "list", "--json"])
    assert shown.exit_code == 0, shown.output
    by_name = {entry["name"]: entry for entry in json.loads(shown.output)}
    for name in ("proximal", "mini"):
        entry = by_name[name]
        assert entry["identity"] is None and (entry["distribution"], entry["version"]) == (PLUGIN, "1.0")
        assert DEFECTS[spoiled] in entry["problem"] and REINSTALL in entry["problem"]
    assert by_name["fedavg"]["problem"] is None and by_name["fedavg"]["identity"]["distribution"] == "cardiofl"
    table = CliRunner().invoke(app, ["plugins", "list"], env={"COLUMNS": "300"})
    assert table.exit_code == 0, table.output
    assert "refused: no identity" in table.output
    assert f"refused: plug-in distribution {PLUGIN!r} 1.0" in table.output and DEFECTS[spoiled] in table.output
    assert table.output.count(f"refused: plug-in distribution {PLUGIN!r}") == 1  # once, for both entry points


def test_a_plugin_data_source_without_identity_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site's data cache is keyed by its source plug-in's identity: without one, the source's kind is refused."""
    from site_agent.data.cache import cache_key
    from site_agent.data.config import SOURCES, PreprocessConfig, parse_source
    from site_agent.data.sources import SourceError

    def unidentified(kind: str) -> None:
        raise PluginIdentityError(f"plug-in distribution 'x_sources' 1.0 at /nowhere has no RECORD file: {REINSTALL}")

    monkeypatch.setattr(SOURCES, "plugin", unidentified)
    (tmp_path / "records").mkdir()
    source = parse_source({"kind": "challenge", "path": str(tmp_path / "records")})
    with pytest.raises(SourceError, match="has no RECORD file") as refused:
        cache_key([source], PreprocessConfig(), tmp_path / "cache")
    assert refused.value.setting == "kind"
