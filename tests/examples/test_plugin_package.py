"""The example plug-in package, built as a wheel and installed beside cardiofl: its tests, a study, another version.

The wheel is installed with pip into a folder of its own (not editable: sites refuse editable
plug-ins) that this process and the example's own test run then find on their path, as a site's
operator would install it beside cardiofl.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from cardiofl.experiment.runner import simulate_study
from shared import plugins
from shared.algorithms.registry import ALGORITHMS
from shared.terms import StudyTerms
from shared.terms.model_config import PRESETS
from site_agent.data import SiteData
from tests.coordinator.factories import ADMIN
from tests.site_agent.test_agent import site_data
from tests.site_agent.test_differential_privacy import CPU, config, model, run_service

__all__ = ["site_data"]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin-example"
DISTRIBUTION = "cardiofl-plugin-example"


def install_example(into: Path, source: Path = EXAMPLE) -> Path:
    """Build the example's wheel and install it into the folder `into` with pip, offline; return the folder."""
    wheels, tree = into.parent / f"{into.name}-wheel", into.parent / f"{into.name}-source"
    shutil.copytree(source, tree, ignore=shutil.ignore_patterns("build", "*.egg-info"))  # builds leave no trace here
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(tree)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(into), str(wheel)], check=True, timeout=300
    )
    return into


def forget() -> None:
    plugins.forget_plugins()
    for name in [n for n in sys.modules if n.startswith("cardiofl_plugin_example")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = install_example(tmp_path_factory.mktemp("plugin") / "site-packages")
    sys.path.insert(0, str(folder))
    forget()
    yield folder
    sys.path.remove(str(folder))
    forget()


def test_the_examples_own_tests_pass_against_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    shutil.copytree(EXAMPLE / "tests", tests)  # away from its source: only the installed copy can be imported
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tests)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 passed" in done.stdout


def test_a_study_of_the_plugins_runs_in_the_service_as_in_the_runner(
    installed: Path, coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    """The plug-in model under the plug-in algorithm: the terms name both, phi_k and mu stay home, runner = service."""
    identity = ALGORITHMS.plugin("fedprox_adaptive")
    assert identity is not None and identity.distribution == DISTRIBUTION and identity.version == "0.1.0"
    assert PRESETS.plugin("compact_cnn_tiny") == identity  # one distribution provides both
    params = {"mu": 0.05, "step": 0.1, "patience": 1}
    values = config(
        model={"preset": "compact_cnn_tiny"},
        algorithm={"name": "fedprox_adaptive", "params": params},
        aggregation={"name": "samples"},
    )
    study_id, wires = run_service(coordinator, site_data, tmp_path, values)
    shown = coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert shown["status"] == "completed"
    assert shown["config"]["algorithm"]["plugin"] == shown["config"]["model"]["plugin"] == identity.model_dump()
    for recorder in wires.values():  # the sites' adapters and mu stay with them: no upload names them
        for url, body in recorder.bodies:
            assert b"adaptive_prox" not in body and b"adapter." not in body, url
    outcomes = list(simulate_study(StudyTerms.model_validate(shown["config"]), site_data, CPU))
    for t in (1, 2):
        service, ours = model(coordinator, study_id, t), outcomes[t - 1].global_model
        assert set(service) == set(ours) and "head.weight" in ours and "adapter.weight" not in ours
        assert all(torch.equal(ours[n], service[n]) for n in ours), f"round {t} differs"


def test_a_site_with_another_version_declines_saying_which(installed: Path, tmp_path: Path) -> None:
    """The terms name 0.1.0 (what the coordinator has); this site installed 0.1.1 of the same package."""
    from site_agent.errors import TaskMismatch
    from site_agent.task_check import check_task
    from tests.site_agent.test_task_check import honest, terms

    named = ALGORITHMS.plugin("fedprox_adaptive")
    assert named is not None
    newer = tmp_path / "newer"
    shutil.copytree(EXAMPLE, newer, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    pyproject = newer / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', 'version = "0.1.1"'))
    folder = install_example(tmp_path / "site-packages", newer)
    sys.path.insert(0, str(folder))
    sys.path.remove(str(installed))
    forget()
    try:
        approved = terms(
            model={"preset": "compact_cnn_tiny", "plugin": named.model_dump()},
            algorithm={"name": "fedprox_adaptive", "plugin": named.model_dump()},
        )
        with pytest.raises(TaskMismatch) as declined:
            check_task(honest(approved), approved, "oslo")
        for part in ("model 'compact_cnn_tiny'", "algorithm 'fedprox_adaptive'"):
            assert f"{part}: this site has {DISTRIBUTION} 0.1.1" in str(declined.value)
        assert f"the terms name {DISTRIBUTION} 0.1.0" in str(declined.value)
    finally:
        sys.path.remove(str(folder))
        sys.path.insert(0, str(installed))
        forget()


def test_a_site_reads_the_plugin_source_from_its_settings_and_caches_it_by_the_plugins_identity(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The site's TOML names the plug-in's kind; its records load; the plug-in's identity keys the cache."""
    from cardiofl_plugin_example.csv_source import CsvFolderSource  # type: ignore[import-not-found]

    from site_agent.config import load_settings
    from site_agent.data import open_site_data
    from site_agent.data.cache import cache_key
    from site_agent.data.config import SOURCES, PreprocessConfig

    sys.path.insert(0, str(EXAMPLE / "tests"))
    try:
        from test_plugin_example import write_csv_site  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLE / "tests"))
    folder = write_csv_site(tmp_path / "site", [(f"ecg{i}", "164889003") for i in range(5)])
    config = tmp_path / "site.toml"
    config.write_text(
        'name = "oslo"\ncoordinator_url = "http://127.0.0.1:1"\ntoken = "t"\n'
        f'[[data]]\nkind = "csv_folder"\npath = "{folder}"\nunits = "uV"\n'
    )
    settings = load_settings(config)
    (source,) = settings.data
    assert isinstance(source, CsvFolderSource)
    assert settings.model_dump(mode="json")["data"][0]["kind"] == "csv_folder"  # every field kept, not the base's
    data = open_site_data(settings.data, tmp_path / "cache")
    assert data.report.loaded == 5
    key = cache_key([source], PreprocessConfig(), tmp_path / "cache")
    identity = SOURCES.plugin("csv_folder")
    assert identity is not None and identity.distribution == DISTRIBUTION
    newer = identity.model_copy(update={"version": "0.1.1"})  # another build of the plug-in, the same data
    monkeypatch.setattr(plugins, "_identity", lambda _distribution: newer)
    assert cache_key([source], PreprocessConfig(), tmp_path / "cache") != key
