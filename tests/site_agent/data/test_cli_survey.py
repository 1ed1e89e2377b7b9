"""`cardiofl data survey` prints a planted site's exact counts, and what would leave it just as `release` makes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cardiofl.cli import app
from shared.study.survey import survey_epsilon
from shared.wire.survey import GROUPS, SiteSurvey
from shared.wire.survey_release import release
from site_agent.data.survey import survey_site
from tests.site_agent.data.test_survey import write_planted

runner = CliRunner()
EXACT_TITLE = "EXACT survey"
RELEASED_TITLE = "RELEASED survey"


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SiteSurvey]:
    """A site config whose one source holds test_survey.py's planted defects, and that source's exact survey."""
    folder = tmp_path_factory.mktemp("planted")
    source = write_planted(folder)
    config = folder / "site.toml"
    config.write_text(
        'name = "planted"\ncoordinator_url = "https://coordinator.example.org"\n'
        f'[[data]]\nkind = "challenge"\npath = "{source.path}"\nsplit_file = "{source.split_file}"\n'
    )
    return config, survey_site(source)


def _table(output: str, title: str) -> dict[tuple[str, str], list[str]]:
    """The rows of the table printed under `title`: (table, key) to its train, test and excluded columns."""
    lines = output[output.index(title) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["table", "key"])
    rows: dict[tuple[str, str], list[str]] = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        table, rest = line.split(maxsplit=1)
        parts = rest.rsplit(maxsplit=3 if table != "reason" else 1)
        key, counts = parts[0], parts[1:]
        rows[(table, key)] = counts if table != "reason" else ["", "", counts[0]]
    return rows


def _printed(survey: SiteSurvey) -> dict[tuple[str, str], list[str]]:
    """How the command prints each count of `survey`: the number, "–" where suppressed."""
    cells = survey.cells()
    rows: dict[tuple[str, str], list[str]] = {}
    for (group, table, key), value in cells.items():
        row = rows.setdefault((table, key), ["", "", ""])
        row[GROUPS.index(group)] = "–" if value is None else str(value)
    return rows


def test_the_survey_prints_the_exact_counts_then_what_would_leave(planted: tuple[Path, SiteSurvey]) -> None:
    config, exact = planted
    result = runner.invoke(app, ["data", "survey", "--config", str(config), "--min-records", "5"])
    assert result.exit_code == 0, result.output
    assert "stays at this site" in result.output and result.output.index(EXACT_TITLE) < result.output.index(
        RELEASED_TITLE
    )
    printed = _table(result.output, EXACT_TITLE)
    assert printed == _printed(exact)
    assert printed[("quality", "flat_lead")] == ["4", "0", "1"] and printed[("quality", "clipped")] == ["0", "3", "0"]
    assert printed[("quality", "non_finite")] == ["0", "0", "2"] and printed[("labels", "AFIB")] == ["0", "0", "2"]
    released = _table(result.output, RELEASED_TITLE)
    assert released == _printed(release(exact, min_records=5))
    assert released[("records", "records")] == ["18", "6", "9"]  # every group has at least 5 records
    assert released[("quality", "clipped")] == ["0", "–", "0"] and released[("labels", "AFIB")][:2] == ["–", "–"]
    assert "epsilon" not in result.output  # no noise: no epsilon is spent


def test_the_default_hides_every_group_below_20_records(planted: tuple[Path, SiteSurvey]) -> None:
    config, _ = planted
    result = runner.invoke(app, ["data", "survey", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "min_records 20" in result.output
    assert all(
        counts == ["–", "–", "–"]
        for (table, _), counts in _table(result.output, RELEASED_TITLE).items()
        if table != "reason"
    )


def _counts(survey: dict[str, object]) -> list[object]:
    """Every count of a survey's JSON."""
    groups = survey["groups"]
    assert isinstance(groups, dict)
    return [v for g in groups.values() for v in [g["records"], *(c for t in g["tables"].values() for c in t.values())]]


def test_the_json_is_the_released_survey_and_shows_no_small_count(planted: tuple[Path, SiteSurvey]) -> None:
    config, exact = planted
    result = runner.invoke(app, ["data", "survey", "--config", str(config), "--min-records", "5", "--json"])
    assert result.exit_code == 0, result.output
    released = SiteSurvey.model_validate_json(result.stdout)
    assert released == release(exact, min_records=5) and released.min_records == 5
    assert not [count for count in _counts(json.loads(result.stdout)) if count != "suppressed" and 0 < count < 5]
    small = {value for value in exact.cells().values() if value is not None and 0 < value < 5}
    assert small == {1, 2, 3, 4}  # the planted site has small counts, and none of them is in the JSON
    result = runner.invoke(app, ["data", "survey", "--config", str(config), "--json", "--exact"])
    assert result.exit_code == 0 and SiteSurvey.model_validate_json(result.stdout) == exact
    assert "EXACT survey: it stays at this site" in result.stderr


def test_noise_prints_the_epsilon_it_spends(planted: tuple[Path, SiteSurvey]) -> None:
    config, exact = planted
    args = ["data", "survey", "--config", str(config), "--noise-sigma", "3", "--delta", "1e-6"]
    result = runner.invoke(app, [*args, "--min-records", "5"])
    assert result.exit_code == 0, result.output
    assert f"epsilon {survey_epsilon(3.0, 1e-6):.6g} at delta 1e-06" in result.output
    assert "noise sigma 3" in result.output
    result = runner.invoke(app, [*args, "--json"])
    released = SiteSurvey.model_validate_json(result.stdout)
    assert released.noise_sigma == 3.0 and released.min_records == 20
    assert f"epsilon {survey_epsilon(3.0, 1e-6):.6g}" in result.stderr


def test_sources_are_named_as_for_inspect_and_bad_settings_are_refused(tmp_path: Path) -> None:
    runner.invoke(app, ["data", "synth", "--out", str(tmp_path), "--sites", "1", "--records", "6"])
    result = runner.invoke(
        app, ["data", "survey", str(tmp_path / "site_00"), "--kind", "challenge", "--json", "--exact"]
    )
    assert result.exit_code == 0, result.output
    assert sum(int(g.records) for g in SiteSurvey.model_validate_json(result.stdout).groups.values()) == 6
    assert runner.invoke(app, ["data", "survey"]).exit_code == 2  # no source
    assert runner.invoke(app, ["data", "survey", str(tmp_path), "--noise-sigma", "0"]).exit_code == 2
    assert runner.invoke(app, ["data", "survey", str(tmp_path), "--delta", "1"]).exit_code == 2
    assert runner.invoke(app, ["data", "survey", "--config", str(tmp_path / "none.toml")]).exit_code == 2
