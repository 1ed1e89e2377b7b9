"""Plug-ins through entry points: the built-ins register so, an installed distribution adds one, and sites check it."""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.experiment.runner import simulate_study
from shared import plugins
from shared.algorithms.registry import ALGORITHMS, plugin_uses, terms_plugin_problems
from shared.errors import StudyRuleError
from shared.plugins import PluginIdentity, plugin_identity
from shared.terms import StudyTerms
from shared.terms.model_config import PRESETS, ModelConfig
from site_agent.algorithms import CLIENT_ALGORITHMS, CLIENTS
from site_agent.data import SiteData
from tests.coordinator.factories import ADMIN, enrol
from tests.site_agent.test_agent import SITES, site_data

__all__ = ["site_data"]
from tests.site_agent.test_differential_privacy import CPU, config, model, run_service

PLUGIN = "cardiofl_example_proximal"
MODULE = '''"""A plug-in algorithm (FedProx's client and server under another name) and model size, from outside."""

from dataclasses import replace

from shared.algorithms import exchange
from shared.algorithms.params import FedProxParams
from shared.algorithms.rule import Algorithm
from shared.terms.model_config import TINY
from site_agent.algorithms.fedprox import FedProx

RULE = Algorithm(FedProxParams, exchange.model_partition_as_is)
CLIENT = FedProx()
MINI = replace(TINY, n_heads=4, n_global_heads=3)  # the built-in architecture at another size
'''


def install(
    root: Path,
    name: str = PLUGIN,
    version: str = "1.0",
    *,
    editable: bool = False,
    entry: str = "proximal",
    client: str | None = "",
) -> Path:
    """A distribution installed by hand into `root` as a wheel would lay it out: its module, METADATA, RECORD.

    It registers the algorithm `entry` and a client of the same name, or of the name `client`, or none (None).
    """
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(MODULE)
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"bytecode: not part of the identity")
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        f"[cardiofl.algorithms]\n{entry} = {name}:RULE\n\n"
        + (f"[cardiofl.clients]\n{client or entry} = {name}:CLIENT\n\n" if client is not None else "")
        + f"[cardiofl.models]\nmini = {name}:MINI\n"
    )
    if editable:
        (info / "direct_url.json").write_text(json.dumps({"url": "file:///src", "dir_info": {"editable": True}}))
    files = [p for p in root.rglob("*") if p.is_file()]
    lines = []
    for path in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        lines.append(f"{path.relative_to(root).as_posix()},sha256={digest},{path.stat().st_size}")
    lines.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(lines) + "\n")
    return root


def expected_identity(root: Path, name: str, version: str) -> PluginIdentity:
    """The identity by hand: the module and the dist-info's own files, no bytecode, no RECORD."""
    counted = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name not in {"RECORD", "direct_url.json"}
    )
    digest = hashlib.sha256()
    for path in counted:
        digest.update(f"{path}\0{hashlib.sha256((root / path).read_bytes()).hexdigest()}\n".encode())
    return PluginIdentity(distribution=name, version=version, sha256=digest.hexdigest())


def forget_registries() -> None:
    plugins.forget_plugins()
    sys.modules.pop(PLUGIN, None)


@pytest.fixture()
def installed(tmp_path: Path) -> Iterator[Path]:
    """The example plug-in installed on sys.path for this test only."""
    root = install(tmp_path / "site-packages")
    sys.path.insert(0, str(root))
    forget_registries()
    yield root
    sys.path.remove(str(root))
    forget_registries()


def test_the_builtins_are_cardiofls_own_entry_points() -> None:
    points = metadata.entry_points(group="cardiofl.algorithms")
    own = {point.name for point in points if point.dist is not None and point.dist.metadata["Name"] == "cardiofl"}
    assert own == set(ALGORITHMS) and "fedavg" in own and "learned_heads" in own
    assert all(ALGORITHMS.plugin(name) is None and ALGORITHMS.problem(name, None) is None for name in own)
    assert "plugin" not in StudyTerms(sites=["a"]).model_dump(mode="json")["algorithm"]  # built-in digests unchanged


def test_the_builtin_models_are_cardiofls_own_entry_points() -> None:
    points = metadata.entry_points(group="cardiofl.models")
    own = {point.name for point in points if point.dist is not None and point.dist.metadata["Name"] == "cardiofl"}
    assert own == set(PRESETS) == {"paper", "small", "tiny", "resnet1d34"}
    assert all(PRESETS.plugin(name) is None and PRESETS.problem(name, None) is None for name in own)
    assert PRESETS["paper"] == ModelConfig() and PRESETS["resnet1d34"].heads == "-"
    assert "plugin" not in StudyTerms(sites=["a"]).model_dump(mode="json")["model"]  # built-in digests unchanged


def test_the_builtin_sources_are_cardiofls_own_entry_points_and_an_unknown_kind_is_refused() -> None:
    from pydantic import ValidationError

    from site_agent.data.config import SOURCES, ChallengeSource, parse_source

    assert set(SOURCES) == {"ptbxl", "challenge", "manifest", "sph"}
    assert all(SOURCES.plugin(kind) is None for kind in SOURCES)
    assert isinstance(parse_source({"kind": "challenge", "path": "/data"}), ChallengeSource)
    with pytest.raises(ValidationError, match="'challenge', 'manifest', 'ptbxl', 'sph'"):
        parse_source({"kind": "csv_folder", "path": "/data"})


def test_an_installed_distribution_adds_a_model_size_with_its_identity(installed: Path) -> None:
    assert "mini" in PRESETS and PRESETS["mini"].heads == "3:1"
    identity = expected_identity(installed, PLUGIN, "1.0")
    assert PRESETS.plugin("mini") == identity and PRESETS.problem("mini", identity) is None
    assert "model 'mini' is plug-in" in (PRESETS.problem("mini", None) or "")
    study = StudyTerms(sites=["a"], model={"preset": "mini", "plugin": identity.model_dump()})
    assert {use.part: use.installed for use in plugin_uses(study)} == {"model": identity, "algorithm": None}
    assert terms_plugin_problems(study) == []


def test_an_installed_distribution_adds_an_algorithm_with_its_identity(installed: Path) -> None:
    assert "proximal" in ALGORITHMS and CLIENT_ALGORITHMS["proximal"] is sys.modules[PLUGIN].CLIENT
    identity = ALGORITHMS.plugin("proximal")
    assert identity == expected_identity(installed, PLUGIN, "1.0")
    assert identity == plugin_identity(metadata.distribution(PLUGIN))
    assert ALGORITHMS.problem("proximal", identity) is None
    assert "the terms name no plug-in for it" in (ALGORITHMS.problem("proximal", None) or "")
    other = identity.model_copy(update={"version": "1.1"})
    assert f"this site has {PLUGIN} 1.0" in (ALGORITHMS.problem("proximal", other) or "")
    assert "1.1" in (ALGORITHMS.problem("proximal", other) or "")
    assert "built into cardiofl here" in (ALGORITHMS.problem("fedavg", identity) or "")


def test_an_editable_plugin_is_refused_and_a_name_taken_twice_is_not_resolved(tmp_path: Path) -> None:
    editable = install(tmp_path / "editable", editable=True)
    sys.path.insert(0, str(editable))
    forget_registries()
    try:
        identity = ALGORITHMS.plugin("proximal")
        assert "installed editable" in (ALGORITHMS.problem("proximal", identity) or "")
        twice = install(tmp_path / "twice", name="cardiofl_other_proximal")
        sys.path.insert(0, str(twice))
        forget_registries()
        try:
            with pytest.raises(StudyRuleError, match="registered by both"):
                list(ALGORITHMS)
        finally:
            sys.path.remove(str(twice))
    finally:
        sys.path.remove(str(editable))
        forget_registries()


def test_a_client_side_comes_only_from_the_distribution_that_registered_the_rule(tmp_path: Path) -> None:
    # the rule's distribution registers no client; another registers a client under the rule's name
    rule_only = install(tmp_path / "rule", client=None)
    imposter = install(tmp_path / "imposter", name="cardiofl_imposter", entry="imposter", client="proximal")
    sys.path[:0] = [str(rule_only), str(imposter)]
    forget_registries()
    try:
        assert "proximal" in ALGORITHMS and "proximal" in CLIENTS
        with pytest.raises(StudyRuleError, match="comes from 'cardiofl_imposter', its rule from"):
            CLIENT_ALGORITHMS["proximal"]
        with pytest.raises(StudyRuleError, match="registers no `cardiofl.clients` entry point 'imposter'"):
            CLIENT_ALGORITHMS["imposter"]
        assert CLIENT_ALGORITHMS["fedavg"] is CLIENTS["fedavg"]  # cardiofl's own: both halves from cardiofl
    finally:
        sys.path.remove(str(rule_only))
        sys.path.remove(str(imposter))
        sys.modules.pop("cardiofl_imposter", None)
        forget_registries()


def test_the_builtin_clients_are_cardiofls_own_entry_points_named_as_the_rules() -> None:
    points = metadata.entry_points(group="cardiofl.clients")
    own = {point.name for point in points if point.dist is not None and point.dist.metadata["Name"] == "cardiofl"}
    assert own == set(ALGORITHMS) and {
        name: type(CLIENT_ALGORITHMS[name]).__name__ for name in ("fedavg", "ditto")
    } == {
        "fedavg": "FedAvg",
        "ditto": "Ditto",
    }


def test_plugins_list_shows_each_entry_point_with_its_identity(installed: Path) -> None:
    shown = json.loads(CliRunner().invoke(app, ["plugins", "list", "--json"]).output)
    by_name = {entry["name"]: entry for entry in shown}
    assert by_name["fedavg"]["builtin"] and by_name["fedavg"]["identity"]["distribution"] == "cardiofl"
    mine = by_name["proximal"]
    assert not mine["builtin"] and not mine["editable"] and mine["location"] == str(installed)
    assert mine["identity"] == expected_identity(installed, PLUGIN, "1.0").model_dump()


def test_a_plugin_study_runs_through_the_service_as_through_the_runner(
    installed: Path, coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    """The coordinator names the plug-in in the terms, the sites check it, and the models equal the runner's."""
    values = config(algorithm={"name": "proximal", "params": {"mu": 0.01}}, aggregation={"name": "samples"})
    study_id, _ = run_service(coordinator, site_data, tmp_path, values)
    shown = coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert shown["status"] == "completed"
    assert shown["config"]["algorithm"]["plugin"] == expected_identity(installed, PLUGIN, "1.0").model_dump()
    study = StudyTerms.model_validate(shown["config"])
    outcomes = list(simulate_study(study, site_data, CPU))
    for t in (1, 2):
        service, ours = model(coordinator, study_id, t), outcomes[t - 1].global_model
        assert all(torch.equal(ours[n], service[n]) for n in ours), f"round {t} differs"


def test_a_study_naming_another_plugin_identity_is_refused(installed: Path, coordinator: TestClient) -> None:
    for name in SITES:
        enrol(coordinator, name)
    other = expected_identity(installed, PLUGIN, "1.0").model_copy(update={"version": "0.9"}).model_dump()
    values = config(algorithm={"name": "proximal", "plugin": other}, aggregation={"name": "samples"})
    refused = coordinator.post("/api/v1/studies", json={"name": "t", "config": values}, headers=ADMIN)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "plugin_mismatch"
    assert "0.9" in refused.text and "1.0" in refused.text
    values = config(model={"preset": "mini", "plugin": other}, aggregation={"name": "samples"})
    refused = coordinator.post("/api/v1/studies", json={"name": "t", "config": values}, headers=ADMIN)
    assert refused.status_code == 409 and "model 'mini'" in refused.json()["error"]["message"]
    values = config(model={"preset": "mini"}, aggregation={"name": "samples"})
    created = coordinator.post("/api/v1/studies", json={"name": "t", "config": values}, headers=ADMIN)
    assert created.json()["config"]["model"]["plugin"] == expected_identity(installed, PLUGIN, "1.0").model_dump()


def test_a_site_whose_plugin_differs_declines_the_task_and_the_approval(installed: Path, tmp_path: Path) -> None:
    """The terms name version 0.9 of the plug-in, the site has 1.0: no task of the study, no approval either."""
    from site_agent.approvals import Approvals
    from site_agent.errors import AgentError, TaskMismatch
    from site_agent.store import SiteStore
    from site_agent.task_check import check_task
    from tests.site_agent.test_task_check import honest, terms

    other = expected_identity(installed, PLUGIN, "1.0").model_copy(update={"version": "0.9"})
    approved = terms(algorithm={"name": "proximal", "plugin": other.model_dump()})
    with pytest.raises(TaskMismatch, match=f"this site has {PLUGIN} 1.0.*the terms name {PLUGIN} 0.9"):
        check_task(honest(approved), approved, "oslo")
    unnamed_model = terms(model={"preset": "mini"})  # a plug-in model the terms name no plug-in for
    with pytest.raises(TaskMismatch, match="model 'mini' is plug-in .* the terms name no plug-in for it"):
        check_task(honest(unnamed_model), unnamed_model, "oslo")
    same = terms(algorithm={"name": "proximal", "plugin": ALGORITHMS.plugin("proximal").model_dump()})  # type: ignore[union-attr]
    assert check_task(honest(same), same, "oslo").terms == same
    store = SiteStore(tmp_path / "store", b"k" * 32, "oslo")
    with pytest.raises(AgentError, match="cannot be approved here"):
        Approvals(store).approve(honest(approved), by="operator")
