"""The package as a hospital installs it: a wheel, installed into a fresh venv, run from there alone."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from setuptools import find_namespace_packages, find_packages

from tests.coordinator.conftest import postgres_schema_url

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAPPED = {"coordinator.migrations": "migrations", "coordinator.migrations.versions": "migrations/versions"}


def _data_folders() -> set[str]:
    """The folders under the packages that hold files but no __init__.py (configs, static): packages to setuptools."""
    roots = ["cardiofl*", "coordinator*", "site_agent*", "shared*"]
    found = set(find_namespace_packages(str(ROOT), include=roots)) - set(find_packages(str(ROOT), include=roots))
    folders = {name for name in found if "__pycache__" not in name}
    return {name for name in folders if any(p.is_file() for p in (ROOT / name.replace(".", "/")).iterdir())}


def test_the_package_list_names_every_package_and_the_migrations() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = set(find_packages(str(ROOT), include=["cardiofl*", "coordinator*", "site_agent*", "shared*"]))
    assert {"cardiofl.experiment.configs", "coordinator.static"} <= _data_folders()
    assert listed == found | set(MAPPED) | _data_folders()
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"coordinator.migrations": "migrations"}


def _outside_env(**extra: str) -> dict[str, str]:
    """The environment of the tests without what points into the source tree or configures cardiofl."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_") and k != "PYTHONPATH"}
    return {**env, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    (out / "build.log").write_text(build.stdout + build.stderr)
    (built,) = out.glob("cardiofl-*.whl")
    return built


def test_the_wheel_builds_without_setuptools_warnings(wheel: Path) -> None:
    """A folder of data that is not a listed package draws 40 lines of 'Package would be ignored' per folder."""
    log = (wheel.parent / "build.log").read_text()
    assert "would be ignored" not in log and "Warning" not in log, log


def test_the_wheel_carries_every_migration_and_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {f"coordinator/{p.relative_to(ROOT)}" for p in (ROOT / "migrations").rglob("*") if p.is_file()}
    needed = {n for n in needed if "__pycache__" not in n}
    needed |= {"shared/label_maps.json", "coordinator/static/dashboard.html"}
    needed |= {f"site_agent/ui/{name}" for name in ("page.html", "page.js", "page.css")}
    needed |= {f"cardiofl/experiment/configs/{p.name}" for p in (ROOT / "cardiofl/experiment/configs").glob("*.toml")}
    assert needed <= names, sorted(needed - names)


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel and its dependencies (the same torch build as this one), not editable.

    `--no-compile`: pip's byte-compiling of every installed module took half the install (some 20 s);
    Python compiles what the tests import as they import it.
    """
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_outside_env())
    torch_release = torch.__version__.split("+")[0]
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    subprocess.run(
        [*pip, f"torch=={torch_release}", str(wheel)],
        check=True,
        capture_output=True,
        env=_outside_env(),
        cwd=venv.parent,
    )
    yield venv / "bin"


def _run(bin_dir: Path, cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Run the venv's `cardiofl` outside the source tree, with no CARDIOFL_* variable from this process."""
    result = subprocess.run(
        [str(bin_dir / "cardiofl"), *args],
        cwd=cwd,
        env=_outside_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_the_installed_package_is_the_wheel_not_the_source_tree(installed: Path, tmp_path: Path) -> None:
    probe = "import cardiofl, coordinator.migrate as m; print(cardiofl.__file__); print(m.MIGRATIONS_DIR)"
    out = subprocess.run(
        [str(installed / "python"), "-c", probe], cwd=tmp_path, env=_outside_env(), capture_output=True, text=True
    ).stdout.split()
    assert len(out) == 2, out
    site_packages = installed.parent / "lib"
    assert all(Path(line).is_relative_to(site_packages) for line in out), out


def test_the_installed_package_migrates_sqlite(installed: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    out = _run(installed, tmp_path, "coordinator", "migrate", env={"CARDIOFL_DATABASE_URL": url})
    assert "newest revision" in out


@pytest.mark.postgres
def test_the_installed_package_migrates_postgresql(installed: Path, tmp_path: Path) -> None:
    for url in postgres_schema_url():
        out = _run(installed, tmp_path, "coordinator", "migrate", env={"CARDIOFL_DATABASE_URL": url})
        assert "newest revision" in out


def test_the_installed_package_serves_and_its_agents_finish_a_study(installed: Path, tmp_path: Path) -> None:
    """`cardiofl demo` from the venv: `coordinator serve` and two `site run` processes, a tiny study end to end."""
    args = ["--sites", "2", "--rounds", "1", "--preset", "tiny", "--records", "30", "--max-steps", "2"]
    out = _run(installed, tmp_path, "demo", *args, "--workdir", str(tmp_path / "demo"))
    assert "data-readiness survey of site-1, site-2" in out, out  # study 1, then the training study 2
    assert "study 2 completed" in out and "validating each released model: site-2" in out, out
