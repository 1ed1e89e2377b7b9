"""deploy/: every setting is documented, and every command the containers run exists."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cardiofl.cli import app
from coordinator.config import CoordinatorSettings
from shared.terms import StudyTerms
from site_agent.config import ENV_PREFIX, AgentSettings

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def documented() -> set[str]:
    return set(re.findall(r"^(CARDIOFL_[A-Z_]+)=", (DEPLOY / "env.example").read_text(), flags=re.M))


def test_env_example_documents_every_setting() -> None:
    names = documented()
    coordinator = {f"CARDIOFL_{field.upper()}" for field in CoordinatorSettings.model_fields}
    agent = {f"{ENV_PREFIX}{field.upper()}" for field in AgentSettings.model_fields}
    assert coordinator <= names, coordinator - names
    assert agent <= names, agent - names
    assert {"CARDIOFL_URL", "CARDIOFL_TOKEN"} <= names


def cardiofl_commands() -> list[list[str]]:
    """The `cardiofl <group> <command>` words of every command line in deploy/."""
    found = set()
    for path in DEPLOY.iterdir():
        if path.suffix not in (".yaml", ".Dockerfile") and not path.name.endswith("Dockerfile"):
            continue
        lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
        text = " ".join(lines).replace('", "', " ").replace('"', " ").replace("[", " ").replace(",", " ")
        for match in re.finditer(r"(?:^|[\s;&|])cardiofl ([a-z][a-z-]*) ([a-z][a-z-]*)", text):
            found.add((match.group(1), match.group(2)))
    return [list(pair) for pair in sorted(found)]


@pytest.mark.parametrize("words", cardiofl_commands(), ids=lambda w: " ".join(w))
def test_every_command_in_deploy_exists(words: list[str]) -> None:
    result = CliRunner().invoke(app, [*words, "--help"])
    assert result.exit_code == 0, result.output


def test_commands_were_found() -> None:
    commands = {" ".join(w) for w in cardiofl_commands()}
    assert {
        "site run",
        "site keygen",
        "site health",
        "site enroll",
        "coordinator serve",
        "coordinator migrate",
        "study create",
        "data synth",
    } <= commands


def test_compose_agent_environment_parses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    data = re.search(r"CARDIOFL_SITE_DATA: '(.+)'", text)
    assert data is not None
    monkeypatch.setenv("CARDIOFL_SITE_NAME", "site-1")
    monkeypatch.setenv("CARDIOFL_SITE_COORDINATOR_URL", "http://coordinator:8000")
    monkeypatch.setenv("CARDIOFL_SITE_DATA", data.group(1))
    settings = AgentSettings()
    assert settings.data[0].kind == "challenge" and str(settings.data[0].path) == "/data/site_00"


@pytest.mark.parametrize(
    "name", ["study.compose.toml", "study.example.toml", "survey.example.toml", "evaluate.example.toml"]
)
def test_study_files_are_valid(name: str) -> None:
    raw = tomllib.loads((DEPLOY / name).read_text())
    raw.pop("name")
    StudyTerms.model_validate(raw)


DOCKERFILES = ("site-agent.Dockerfile", "coordinator.Dockerfile")


def instructions(name: str) -> list[str]:
    """A Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfiles_run_as_non_root_with_healthchecks() -> None:
    for name in DOCKERFILES:
        text = (DEPLOY / name).read_text()
        assert text.startswith("#"), name
        assert re.search(r"^USER cardiofl$", text, flags=re.M), name
        assert "HEALTHCHECK" in text, name
        assert "useradd --system --uid 10001 --gid 10001" in text, name  # the uid tests/containers checks
    agent = (DEPLOY / "site-agent.Dockerfile").read_text()
    assert re.search(r'HEALTHCHECK .*CMD \["cardiofl", "site", "health"', agent.replace("\\\n", ""), flags=re.S)
    heartbeat = re.search(r"CARDIOFL_SITE_HEARTBEAT_FILE=(\S+)", agent)
    assert heartbeat and "heartbeat_file" in AgentSettings.model_fields  # what `cardiofl site health` reads
    assert heartbeat.group(1).startswith("/var/lib/cardiofl/")  # the agent's volume: writable when read-only


def test_coordinator_image_migrates_then_serves_with_the_blob_dir_owned_by_its_user() -> None:
    lines = instructions("coordinator.Dockerfile")
    final = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM ")) :]
    assert final.index("USER cardiofl") < final.index("RUN mkdir -p /var/lib/cardiofl/blobs")
    cmd = next(line for line in final if line.startswith("CMD "))
    assert re.search(r"cardiofl coordinator migrate && exec cardiofl coordinator serve", cmd)


def test_dockerfiles_build_from_the_local_base_image_and_wheelhouse_only() -> None:
    """No registry, no index, no download: the base is a build argument, packages come from /wheels."""
    stages: dict[str, list[str]] = {}
    for name in DOCKERFILES:
        lines = instructions(name)
        assert lines[0] == "ARG BASE_IMAGE=cardiofl/base:bookworm", name
        froms = [line for line in lines if line.startswith("FROM ")]
        assert froms == ["FROM ${BASE_IMAGE} AS deps", "FROM deps AS wheel", "FROM ${BASE_IMAGE}"], name
        assert "ARG WHEELHOUSE=.wheelhouse/cpu" in lines and "COPY ${WHEELHOUSE} /wheels" in lines, name
        assert "PIP_NO_INDEX=1" in next(line for line in lines if line.startswith("ENV PIP_")), name
        for line in lines:
            if re.match(r"(RUN|ADD|COPY|FROM) ", line):  # what runs at build time
                assert not re.search(r"apt-get|curl|wget|https?://|index-url", line), (name, line)
        final = lines[lines.index("FROM ${BASE_IMAGE}") :]
        for line in final:
            if re.search(r"\bpip (install|wheel)\b", line):
                assert "--no-index" in line, (name, line)  # the final stage has no PIP_NO_INDEX
        # The deps and wheel stages are the same text in both files, so both images share their layers.
        stages[name] = lines[: lines.index("FROM ${BASE_IMAGE}")]
    assert len({tuple(v) for v in stages.values()}) == 1, stages


def test_cuda_agent_is_the_same_dockerfile_with_another_wheelhouse() -> None:
    agent = (DEPLOY / "site-agent.Dockerfile").read_text()
    assert "nvidia/cuda" not in agent  # one CUDA runtime: the wheels torch brings, never a CUDA base image
    assert "--build-arg WHEELHOUSE=.wheelhouse/cuda" in agent
    wheelhouse = (DEPLOY / "make-wheelhouse.sh").read_text()
    assert re.search(r"cuda\) TORCH_SPEC=.*torch===", wheelhouse)  # PyPI's build, never a local +cpu one
    assert re.search(r"cpu\) TORCH_SPEC=.*\+cpu", wheelhouse)


def test_dockerignore_keeps_the_context_to_what_the_dockerfiles_copy() -> None:
    lines = [
        line.strip()
        for line in (DEPLOY.parent / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"  # everything out (.venv, .cardiofl, build outputs) ...
    included = {line[1:] for line in lines if line.startswith("!")}
    assert not included & {".venv", ".cardiofl", "build", ".git", "test-artifacts"}
    for name in DOCKERFILES:  # ... but what the Dockerfiles copy from the context
        for line in instructions(name):
            if line.startswith("COPY ") and "--from=" not in line:
                for source in line.split()[1:-1]:
                    top = ".wheelhouse" if source == "${WHEELHOUSE}" else source.split("/")[0]
                    assert top in included, (name, source)


def test_compose_builds_each_image_once_and_its_users_depend_on_the_builder() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert "name" not in compose  # Debian's docker-compose (1.29) refuses it: `-p cardiofl` instead
    services = compose["services"]
    builders = {spec["image"]: name for name, spec in services.items() if "build" in spec}
    assert len(builders) == sum("build" in spec for spec in services.values())  # one build per image
    assert set(builders.values()) == {"coordinator", "synthetic-data"}
    for name, spec in services.items():
        for build in [spec.get("build")] if "build" in spec else []:
            assert build["context"] == ".." and (DEPLOY.parent / build["dockerfile"]).is_file(), name
            assert set(build["args"]) == {"BASE_IMAGE", "WHEELHOUSE"}, name
        if not spec["image"].startswith("cardiofl/"):
            continue
        assert spec.get("read_only") is True and "/tmp" in spec.get("tmpfs", []), name
        # Built here, never pulled: a registry may hold another `cardiofl/...` image, or be unreachable.
        assert spec["pull_policy"] == ("build" if "build" in spec else "never"), name
        if "build" not in spec:
            assert builders[spec["image"]] in spec["depends_on"], name


def test_dockerfiles_copy_every_package_the_wheel_installs() -> None:
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    packages = {name for name in pyproject["tool"]["setuptools"]["packages"] if "." not in name}
    assert {"cardiofl", "coordinator", "site_agent", "shared"} <= packages
    for name in ("site-agent.Dockerfile", "coordinator.Dockerfile"):
        copied = set(re.findall(r"^COPY (\w+) /src/\1$", (DEPLOY / name).read_text(), flags=re.M))
        assert packages <= copied, (name, packages - copied)


def _sourced_env_example() -> dict[str, str]:
    """The variables `set -a; . deploy/env.example` exports: each value up to its comment, blanks included."""
    return {
        name: value.split("#", 1)[0].strip()
        for name, value in re.findall(r"^([A-Z_]+)=(.*)$", (DEPLOY / "env.example").read_text(), flags=re.M)
    }


def test_settings_read_from_a_sourced_env_example_take_empty_values_as_unset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from site_agent.config import load_settings

    exported = _sourced_env_example()
    assert exported["CARDIOFL_SITE_DATA"] == ""  # the case that once broke the agent at start
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "site.toml"
    config.write_text(
        'name = "lyon"\ncoordinator_url = "http://127.0.0.1:8000"\n'
        f'store_dir = "{tmp_path / "store"}"\n[[data]]\nkind = "challenge"\npath = "{tmp_path}"\n'
    )
    settings = load_settings(config)
    assert settings.name == "lyon" and len(settings.data) == 1  # the file's values stand, empty variables do not
    assert CoordinatorSettings(_env_file=None).admin_token is None  # empty: no bootstrap admin


def test_ci_runs_the_containers_after_the_tests_and_linters() -> None:
    root = DEPLOY.parent
    steps = [line.strip() for line in (root / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert steps == [
        "make test",
        "make lint",
        "make docs",
        "make plugin-example",
        "make soak SOAK_MAX_SLOPE_MB=3",
        "make containers",
        "make containers-production",
    ]
    assert re.search(r"^plugin-example:", (root / "Makefile").read_text(), flags=re.M)
    assert re.search(r"^containers:", (root / "Makefile").read_text(), flags=re.M)
    for script in ("build-images.sh", "make-base-image.sh", "make-wheelhouse.sh"):
        assert os.access(DEPLOY / script, os.X_OK), script
    assert "debootstrap --variant=minbase" in (DEPLOY / "make-base-image.sh").read_text()


def test_container_study_is_tiny_and_names_the_runs_sites() -> None:
    containers = DEPLOY.parent / "tests" / "containers"
    raw = tomllib.loads((containers / "study.toml").read_text())
    raw.pop("name")
    config = StudyTerms.model_validate(raw)
    assert config.model.preset == "tiny" and config.rounds <= 2
    sites = re.search(r"^SITES = (\[.*\])$", (containers / "run_study.py").read_text(), flags=re.M)
    assert sites is not None and config.sites == eval(sites.group(1))  # noqa: S307 - a literal list
