"""The documentation builds strictly and offline, its generated references are complete, and its examples run.

Every `cardiofl ...` line in a shell code block of README.md or docs/ is parsed and walked down the real
command tree, so a renamed command or option breaks the suite, not a reader.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from cardiofl.cli import app

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
sys.path.append(str(DOCS))
import hooks  # noqa: E402  (docs/hooks.py, the build's own generators)

CDN_MARKERS = ("https://fonts.googleapis", "cdn.jsdelivr", "unpkg")
SHELL_FENCES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[\w-]*)\s*$")
# A `cardiofl` at a command position: line start (after a prompt), or after &&, ;, |, $( or `do`.
COMMAND = re.compile(r"(?:^|&&|;|\||\$\(|\bdo\b)\s*(?:\$\s+)?(?:\S*/)?cardiofl\s+(?P<args>[^;&|)#\n]*)")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return site


def _page_text(site: Path, page: str) -> str:
    return (site / page).read_text(encoding="utf-8")


def test_the_site_builds_strictly_with_every_generated_reference_page(built_site: Path) -> None:
    for uri in hooks.GENERATED:
        assert (built_site / uri.replace(".md", ".html")).is_file(), uri
    assert (built_site / "plugins.html").is_file() and (built_site / "images" / "dashboard.png").is_file()
    assert not (built_site / "hooks.py").exists()


def test_the_cli_reference_names_every_command(built_site: Path) -> None:
    text = _page_text(built_site, "reference/cli.html")
    paths = [" ".join(path) for path, _ in hooks.cli_commands()]
    assert len(paths) > 40
    assert [path for path in paths if f">{path}<" not in text and f"{path}</h2>" not in text] == []


def test_the_rest_reference_names_every_path_of_the_live_openapi_document(built_site: Path) -> None:
    text = _page_text(built_site, "reference/rest.html")
    document = hooks.openapi_document()
    operations = [(m.upper(), p) for p, ops in document["paths"].items() for m in ops]
    assert len(operations) > 30
    assert [(m, p) for m, p in operations if f"{m} {p}" not in text] == []
    assert [name for name in document["components"]["schemas"] if f'id="schema-{hooks.slug(name)}"' not in text] == []


def test_the_reference_pages_name_every_setting_term_and_error_code(built_site: Path) -> None:
    from coordinator.config import CoordinatorSettings
    from coordinator.errors import CoordinatorError
    from shared.terms import StudyTerms
    from site_agent.config import AgentSettings

    config = _page_text(built_site, "reference/configuration.html")
    assert [f for f in CoordinatorSettings.model_fields if f"CARDIOFL_{f.upper()}" not in config] == []
    assert [f for f in AgentSettings.model_fields if f"CARDIOFL_SITE_{f.upper()}" not in config] == []
    terms = _page_text(built_site, "reference/study-terms.html")
    schema = StudyTerms.model_json_schema()
    fields = [*schema["properties"], *(f for d in schema["$defs"].values() for f in d.get("properties", {}))]
    assert [f for f in fields if f"<code>{f}</code>" not in terms] == []
    errors = _page_text(built_site, "reference/errors.html")
    codes = [cls.code for cls in hooks._error_classes(CoordinatorError)]
    codes += ["approval_digest_mismatch", "privacy_budget", "signing_keys_missing", "private_tensors_in_payload"]
    assert [c for c in codes if f"<code>{c}</code>" not in errors] == []


def test_no_page_loads_anything_from_another_host(built_site: Path) -> None:
    pages = [*built_site.rglob("*.html"), *built_site.rglob("*.css")]
    assert len(pages) > 20
    found = {str(p.relative_to(built_site)): m for p in pages for m in CDN_MARKERS if m in p.read_text("utf-8")}
    assert found == {}
    external = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.IGNORECASE)
    assert [str(p) for p in built_site.rglob("*.html") if external.search(p.read_text("utf-8"))] == []


# --- the examples ----------------------------------------------------------------------------------------------


def _shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced code blocks of `text` whose language is a shell."""
    blocks, body, info = [], None, ""
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and body is None:
            body, info = [], match["info"]
        elif match and body is not None and not match["info"]:
            if info in SHELL_FENCES:
                blocks.append("\n".join(body))
            body = None
        elif body is not None:
            body.append(line)
    return blocks


def documented_examples() -> list[tuple[str, str]]:
    """(file, the arguments after `cardiofl`) of every `cardiofl` command line in README.md and docs/."""
    files = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    examples = []
    for path in files:
        for block in _shell_blocks(path.read_text(encoding="utf-8")):
            joined = block.replace("\\\n", " ")
            for line in joined.splitlines():
                examples += [(str(path.relative_to(REPO)), m["args"].strip()) for m in COMMAND.finditer(line)]
    return examples


def _walk(args: list[str]) -> tuple[Any, list[str], list[str]]:
    """The deepest (sub)command that `args` names, its path, and the arguments left for it."""
    command, path = typer.main.get_command(app), []
    while args and args[0] in (getattr(command, "commands", None) or {}):
        path.append(args[0])
        command, args = command.commands[args[0]], args[1:]
    return command, path, args


def _option_names(command: Any) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)} | {"--help"}


EXAMPLES = documented_examples()


def test_the_documentation_has_command_examples_to_check() -> None:
    assert len(EXAMPLES) > 40
    assert {file for file, _ in EXAMPLES} >= {"README.md", "docs/quickstart.md", "docs/hospital-it/tls.md"}


def test_every_documented_command_line_names_a_real_command_and_its_real_options() -> None:
    problems = []
    for file, line in EXAMPLES:
        command, path, rest = _walk(shlex.split(line))
        if not path:
            problems.append(f"{file}: `cardiofl {line}` names no command")
            continue
        if getattr(command, "commands", None) and rest and not rest[0].startswith("-"):
            problems.append(f"{file}: `cardiofl {line}`: {' '.join(path)} has no subcommand {rest[0]}")
        for token in rest:
            if token == "--":
                break
            option = token.split("=", 1)[0]
            if re.fullmatch(r"--?[A-Za-z][\w-]*", option) and option not in _option_names(command):
                problems.append(f"{file}: `cardiofl {line}`: {' '.join(path)} has no option {option}")
    assert problems == []


def test_every_documented_command_prints_its_help() -> None:
    runner = CliRunner()
    paths = sorted({tuple(_walk(shlex.split(line))[1]) for _, line in EXAMPLES})
    failed = {}
    for path in paths:
        result = runner.invoke(app, [*path, "--help"])
        if result.exit_code != 0:
            failed[" ".join(path)] = result.output[-300:]
    assert failed == {}
    assert len(paths) > 25


def test_the_threat_models_dropout_table_is_the_codes() -> None:
    """Each row of docs/architecture/threat-model.md's table is what graph.adversary_parameters gives (K, c)."""
    from shared.privacy.graph import adversary_parameters

    text = (REPO / "docs" / "architecture" / "threat-model.md").read_text()
    rows = re.findall(
        r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+)(?: \((\d+) of a site's \d+\))? \|", text, re.M
    )
    assert len(rows) > 60
    for row in rows:
        sites, colluding, *expected = (int(v) if v else None for v in row)
        p = adversary_parameters(sites, colluding)  # type: ignore[arg-type]
        got = [p.neighbour_count, p.threshold, p.signature_quorum, p.min_survivors, p.dropouts]
        got.append(None if p.complete else p.neighbourhood_dropouts)
        assert got == expected, (sites, colluding)
