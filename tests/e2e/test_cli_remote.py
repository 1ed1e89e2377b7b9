"""`cardiofl study|site|token` against a live coordinator over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cardiofl.cli import app
from shared.tensors.codec import load
from tests.e2e.conftest import LiveCoordinator

runner = CliRunner()
EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "study.example.toml"


def cli(live: LiveCoordinator, *args: str, token: str | None = None) -> tuple[int, str, str]:
    result = runner.invoke(
        app, [*args], env={"CARDIOFL_URL": live.url, "CARDIOFL_TOKEN": token or live.admin_token, "COLUMNS": "200"}
    )
    return result.exit_code, result.stdout, result.stderr


def test_admin_and_researcher_drive_a_study(live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    live = live_coordinator
    for name in ("lyon", "oslo"):
        code, out, _ = cli(live, "site", "enroll", name, "--token-file", str(tmp_path / f"{name}.token"))
        assert code == 0 and "enrolled site" in out
        assert (tmp_path / f"{name}.token").stat().st_mode & 0o777 == 0o600
    code, out, _ = cli(live, "site", "list", "--json")
    assert code == 0 and [s["name"] for s in json.loads(out)] == ["lyon", "oslo"]

    code, out, _ = cli(live, "token", "create", "researcher", "--label", "ana", "--json")
    researcher = json.loads(out)["token"]
    config = tmp_path / "study.toml"
    config.write_text(
        'name = "cli study"\nrounds = 2\nsites = ["lyon", "oslo"]\n[model]\npreset = "tiny"\nheads = "7:1"\n'
    )
    code, out, _ = cli(live, "study", "create", str(config), "--start", "--json", token=researcher)
    assert code == 0, out
    study = json.loads(out)
    assert study["status"] == "running" and study["config"]["model"]["heads"] == "7:1"

    code, out, _ = cli(live, "study", "list", token=researcher)
    assert code == 0 and "cli study" in out and "running" in out
    code, out, _ = cli(live, "study", "show", str(study["id"]), token=researcher)
    assert code == 0 and "micro-F1" in out and "mAP" in out and "open" in out
    assert "not reported" in out  # no agent has looked at the study yet: it runs without the sites

    for action, status in (("pause", "paused"), ("resume", "running"), ("cancel", "cancelled")):
        code, out, _ = cli(live, "study", action, str(study["id"]), "--json", token=researcher)
        assert code == 0 and json.loads(out)["status"] == status

    target = tmp_path / "theta0.safetensors"
    code, out, _ = cli(live, "study", "download", str(study["id"]), "--out", str(target), token=researcher)
    assert code == 0 and "round 0" in out
    tensors, meta = load(target.read_bytes())
    assert meta["round"] == "0" and "head.weight" in tensors
    assert not any("local_branch.in_proj" in name for name in tensors)


def test_revoking_a_site_locks_its_agent_out(live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    live = live_coordinator
    token_file = tmp_path / "graz.token"
    cli(live, "site", "enroll", "graz", "--token-file", str(token_file))
    site = live.client(token_file.read_text().strip())
    assert site.get("/api/v1/sites/me").status_code == 200
    code, out, _ = cli(live, "site", "revoke", "graz")
    assert code == 0 and "revoked 1 token" in out
    assert site.get("/api/v1/sites/me").status_code == 401
    code, out, _ = cli(live, "token", "list", "--json")
    (graz,) = [t for t in json.loads(out) if t["site"] == "graz"]
    assert graz["revoked_at"] is not None
    code, out, _ = cli(live, "site", "list", "--json")
    assert [s["token"] for s in json.loads(out) if s["name"] == "graz"] == ["revoked"]
    # enrolling again is refused (the site exists); a new token is the way back in
    assert cli(live, "site", "enroll", "graz")[0] == 1
    new_file = tmp_path / "graz-new.token"
    code, out, _ = cli(live, "site", "token", "graz", "--token-file", str(new_file))
    assert code == 0 and "older ones revoked" in out and new_file.stat().st_mode & 0o777 == 0o600
    assert live.client(new_file.read_text().strip()).get("/api/v1/sites/me").status_code == 200
    code, out, _ = cli(live, "site", "list")
    assert code == 0 and "live" in out
    # rotating again revokes the token just issued
    code, _, _ = cli(live, "site", "token", "graz", "--json")
    assert code == 0 and live.client(new_file.read_text().strip()).get("/api/v1/sites/me").status_code == 401


def test_without_a_token_the_cli_says_how_to_give_one(live_coordinator: LiveCoordinator) -> None:
    result = runner.invoke(app, ["study", "list"], env={"CARDIOFL_URL": live_coordinator.url, "CARDIOFL_TOKEN": ""})
    assert result.exit_code == 1
    assert result.stderr == "error: no token given: set CARDIOFL_TOKEN or pass --token\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("study", "show", "999"), "error: 404 not_found"),
        (("study", "start", "999"), "error: 404 not_found"),
        (("site", "revoke", "nobody"), "error: site 'nobody' has no live token"),
    ],
)
def test_api_errors_are_one_clear_line(live_coordinator: LiveCoordinator, args: tuple[str, ...], message: str) -> None:
    code, out, err = cli(live_coordinator, *args)
    assert code == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_a_viewer_cannot_create_studies(live_coordinator: LiveCoordinator) -> None:
    code, out, _ = cli(live_coordinator, "token", "create", "viewer", "--json")
    viewer = json.loads(out)["token"]
    code, _, err = cli(live_coordinator, "study", "create", str(EXAMPLE), token=viewer)
    assert code == 1 and err.startswith("error: 403")
    cli(live_coordinator, "site", "enroll", "lyon")
    code, out, _ = cli(live_coordinator, "site", "list", "--json", token=viewer)  # may list sites, not tokens
    assert code == 0 and [(s["name"], s["token"]) for s in json.loads(out)] == [("lyon", "?")]


def test_unreachable_coordinator_is_one_clear_line() -> None:
    result = runner.invoke(app, ["study", "list", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 1 and result.stderr.startswith("error: cannot reach the coordinator")


def test_example_study_config_is_valid() -> None:
    import tomllib

    from shared.terms import StudyTerms

    raw = tomllib.loads(EXAMPLE.read_text())
    raw.pop("name")
    config = StudyTerms.model_validate(raw)
    assert config.model.heads == "6:2" and config.training.lr == 0.1 and config.rounds == 50
