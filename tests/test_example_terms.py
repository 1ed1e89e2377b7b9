"""The example study terms are valid, and every alternative their comments offer is what the code does.

Which TOML is a study's terms:
- deploy/*.toml and examples/**/*.toml whose top-level `sites` is a list of site names (site.example.toml
  is a site agent's settings, pyproject.toml a package's: neither has one);
- a fenced ```toml block of a .md file under docs/ or examples/ whose top-level `sites` is a list of
  site names, or that has a top-level `[model]`, `[training]` or `[privacy]` table. Blocks without
  `sites` are fragments: they are checked merged over deploy/study.example.toml. Blocks naming the
  example plug-in's model are checked only where it is installed. Experiment configs (`[[sites]]`
  tables, docs/researcher/experiments.md) and a plug-in's `[project]` are not terms.

Each is checked as `cardiofl study create` and POST /studies check terms (no database, no enrolment):
shared/study/checks.py `checked_terms` (refused: 422 invalid_request), then the privacy budget
(422 privacy_budget); an evaluate study's model files stand in as digests, as the CLI sends them.

The comments of deploy/*.toml are checked too. On a line `key = "a"  # ... "b" ...`, every quoted word
of its comment (continued on comment lines aligned with it) is an alternative value of `key`: each is
substituted and must be accepted, or refused with the code the comment gives as `"b" is refused ...
(422 code)`. A commented-out `# key = value` is uncommented with its run of commented keys (and their
commented table header, `# [privacy.dp]`), applying what the comment above that run says: `needs
key = "value"` sets it, `instead of key` drops it; then its own alternatives are tried the same way.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cardiofl.client.model_files import FILE_KEYS
from shared.study.accounting import budget_problem
from shared.study.checks import checked_terms
from shared.study.survey import survey_budget_problem
from shared.terms import SurveySpec, TermsError

ROOT = Path(__file__).resolve().parents[1]
BASE_EXAMPLE = ROOT / "deploy" / "study.example.toml"
TERMS_TABLES = ("model", "training", "privacy")
PLUGIN_PRESETS = {"compact_cnn", "compact_cnn_tiny"}  # examples/plugin-example's models

KEY_LINE = re.compile(r"^(?P<hash>#\s)?(?P<key>[A-Za-z_][\w-]*)\s*=\s*(?P<value>[^#]*?)\s*(?:(?P<comment>#.*))?$")
HEADER = re.compile(r"^(?P<hash>#\s)?\[(?P<table>[\w.]+)\]\s*(?:#.*)?$")
QUOTED = re.compile(r'"([^"]*)"')


def is_terms(table: dict[str, Any]) -> bool:
    """Whether a TOML table is a study's terms (or a fragment of them), by the rule of the docstring."""
    sites = table.get("sites")
    if isinstance(sites, list):
        return all(isinstance(site, str) for site in sites)
    return any(isinstance(table.get(name), dict) for name in TERMS_TABLES)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over`'s keys, tables merged key by key."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


def refusal(table: dict[str, Any]) -> str | None:
    """The code creating a study of `table` (a study file's table) would be refused with; None when accepted."""
    raw = {key: value for key, value in table.items() if key != "name"}
    evaluation = raw.get("evaluation")
    if isinstance(evaluation, dict):  # `cardiofl study create` sends a model file's digest in its key's place
        spec = dict(evaluation)
        for file_key, digest_key in FILE_KEYS.items():
            if file_key in spec:
                spec[digest_key] = hashlib.sha256(str(spec.pop(file_key)).encode()).hexdigest()
        raw["evaluation"] = spec
    try:
        terms = checked_terms(raw)
    except TermsError:
        return "invalid_request"
    if terms.kind == "survey":
        survey = terms.survey or SurveySpec()
        problem = survey_budget_problem(survey.noise_sigma, survey.delta, None)
    else:
        problem = budget_problem(terms) if terms.kind == "train" else None
    return None if problem is None else "privacy_budget"


def study_files() -> list[Path]:
    """The TOML files of deploy/ and examples/ that are a study's terms."""
    files = sorted(ROOT.glob("deploy/*.toml")) + sorted(ROOT.glob("examples/**/*.toml"))
    return [path for path in files if is_terms(tomllib.loads(path.read_text()))]


def doc_blocks() -> list[tuple[str, dict[str, Any]]]:
    """("file:line", table) of every fenced TOML block of docs/ and examples/ that is a study's terms."""
    blocks = []
    for path in sorted([*ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/**/*.md")]):
        text = path.read_text()
        for match in re.finditer(r"^```toml\n(.*?)^```", text, flags=re.S | re.M):
            table = tomllib.loads(match.group(1))
            if is_terms(table):
                line = text.count("\n", 0, match.start()) + 1
                blocks.append((f"{path.relative_to(ROOT)}:{line}", table))
    return blocks


@dataclass(frozen=True)
class Option:
    """A value a comment of a study file offers for a setting, and the code it is refused with (None: accepted)."""

    file: str
    line: int  # 0-based index of the setting's line
    path: tuple[str, ...]  # the setting's table and key
    value: Any
    refused: str | None

    def __str__(self) -> str:
        return f"{self.file}:{self.line + 1}:{'.'.join(self.path)}={self.value!r}"


def comment_of(lines: list[str], index: int, comment: str) -> str:
    """The comment of line `index`, with its continuation lines (comments starting at the same column)."""
    column = lines[index].index(comment)
    text = [comment[1:]]
    for line in lines[index + 1 :]:
        if len(line) > column and line[column] == "#" and line[:column].strip() in ("", "#"):
            text.append(line[column + 1 :])
        else:
            break
    return " ".join(part.strip() for part in text)


def settings(lines: list[str]) -> Iterator[tuple[int, tuple[str, ...], bool, Any, str]]:
    """(line index, path, commented out, value, comment) of every setting of a study file, live or commented."""
    table: tuple[str, ...] = ()
    for index, line in enumerate(lines):
        header = HEADER.match(line)
        if header:
            table = tuple(header["table"].split("."))
            continue
        match = KEY_LINE.match(line)
        if match is None or (match["hash"] and not match["value"]):
            continue
        try:
            value = tomllib.loads(f"v = {match['value']}")["v"]
        except tomllib.TOMLDecodeError:
            continue  # prose that happens to hold an "=" sign
        comment = comment_of(lines, index, match["comment"]) if match["comment"] else ""
        yield index, (*table, match["key"]), bool(match["hash"]), value, comment


def uncommented(lines: list[str], index: int) -> dict[str, Any]:
    """The file's table with the run of commented-out settings around line `index` (and their header) uncommented."""
    commented = {i for i, _, is_commented, _, _ in settings(lines) if is_commented}
    start = index
    while start - 1 >= 0 and (start - 1 in commented or lines[start - 1].startswith("#   ")):
        start -= 1
    end = index
    while end + 1 < len(lines) and (end + 1 in commented or lines[end + 1].startswith("#   ")):
        end += 1
    if start > 0 and HEADER.match(lines[start - 1]) and lines[start - 1].startswith("# "):
        start -= 1
    preamble: list[str] = []
    above = start - 1
    while above >= 0 and lines[above].startswith("# ") and not KEY_LINE.match(lines[above]):
        preamble.insert(0, lines[above][2:])
        above -= 1
    changed = [line[2:] if start <= i <= end else line for i, line in enumerate(lines)]
    table = tomllib.loads("\n".join(changed))
    said = " ".join(preamble)
    for path, value in re.findall(r'needs ([\w.]+) = ("[^"]*")', said):
        *parents, key = path.split(".")
        target = table
        for part in parents:
            target = target.setdefault(part, {})
        target[key] = tomllib.loads(f"v = {value}")["v"]
    header = next((HEADER.match(lines[i]) for i in range(start, -1, -1) if HEADER.match(lines[i])), None)
    section = table
    for part in header["table"].split(".") if header else []:
        section = section[part]
    for key in re.findall(r"instead of (\w+)", said):
        section.pop(key, None)
    return table


def with_value(table: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A copy of `table` with the setting at `path` set to `value`."""
    if len(path) == 1:
        return {**table, path[0]: value}
    return {**table, path[0]: with_value(table[path[0]], path[1:], value)}


def options() -> list[tuple[Option, dict[str, Any]]]:
    """Every option the comments of deploy/'s study files offer, with the table it is tried in."""
    found = []
    for path in study_files():
        lines = path.read_text().splitlines()
        table = tomllib.loads(path.read_text())
        name = str(path.relative_to(ROOT))
        for index, key_path, commented, value, comment in settings(lines):
            base = uncommented(lines, index) if commented else table
            if commented:
                found.append((Option(name, index, key_path, value, None), base))
            if not isinstance(value, str):
                continue
            for alternative in dict.fromkeys(QUOTED.findall(comment)):
                refused = re.search(rf'"{re.escape(alternative)}" is refused[^(]*\(422 (\w+)\)', comment)
                option = Option(name, index, key_path, alternative, refused[1] if refused else None)
                found.append((option, with_value(base, key_path, alternative)))
    return found


STUDY_FILES = study_files()
DOC_BLOCKS = doc_blocks()
OPTIONS = options()


def test_the_rules_find_the_shipped_examples() -> None:
    names = {path.name for path in STUDY_FILES}
    assert {"study.example.toml", "survey.example.toml", "evaluate.example.toml", "study.compose.toml"} <= names
    assert "site.example.toml" not in names
    assert {place.split(":")[0] for place, _ in DOC_BLOCKS} >= {"docs/researcher/beyond-training.md"}
    offered = {(str(option.path), repr(option.value), option.refused) for option, _ in OPTIONS}
    assert {
        ("('privacy', 'dp', 'accountant')", "'pld'", "privacy_budget"),
        ("('privacy', 'dp', 'mode')", "'distributed'", "invalid_request"),
        ("('training', 'optimizer')", "'adam'", None),
        ("('aggregation', 'name')", "'equal'", None),
        ("('evaluation', 'model_file')", "'theta.safetensors'", None),
    } <= offered


@pytest.mark.parametrize("path", STUDY_FILES, ids=lambda path: path.name)
def test_every_study_file_is_valid_terms(path: Path) -> None:
    assert refusal(tomllib.loads(path.read_text())) is None


@pytest.mark.parametrize(("place", "table"), DOC_BLOCKS, ids=[place for place, _ in DOC_BLOCKS])
def test_every_terms_block_of_the_docs_is_valid(place: str, table: dict[str, Any]) -> None:
    if table.get("model", {}).get("preset") in PLUGIN_PRESETS:
        pytest.importorskip("cardiofl_plugin_example")
    full = table if "sites" in table else merged(tomllib.loads(BASE_EXAMPLE.read_text()), table)
    assert refusal(full) is None, place


@pytest.mark.parametrize(("option", "table"), OPTIONS, ids=[str(option) for option, _ in OPTIONS])
def test_every_option_a_comment_offers_is_accepted_or_refused_as_it_says(option: Option, table: dict[str, Any]) -> None:
    assert refusal(table) == option.refused


def test_a_budget_below_what_the_rounds_spend_is_refused_as_the_example_says() -> None:
    lines = BASE_EXAMPLE.read_text().splitlines()
    index, path = next((i, p) for i, p, commented, *_ in settings(lines) if commented and p[-1] == "epsilon_budget")
    table = uncommented(lines, index)
    assert refusal(table) is None  # the example's own budget holds its rounds
    assert refusal(with_value(table, path, 1.0)) == "privacy_budget"
