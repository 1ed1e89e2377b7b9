import base64
import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cardiofl.cli import app
from site_agent.config import (
    AgentSettings,
    approvals_version_file,
    check_settings,
    load_settings,
    open_data,
    open_store,
    read_token,
)
from site_agent.data import ChallengeSource, ManifestSource, PtbxlSource
from site_agent.errors import ConfigError
from site_agent.store import SiteStore, generate_key, write_key_file
from tests.site_agent.data.records import make_record

runner = CliRunner()


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("CARDIOFL_"):
            monkeypatch.delenv(name)


def write_config(tmp_path: Path, **overrides: str) -> Path:
    data = tmp_path / "ecg"
    if not data.exists():
        for i in range(3):  # AFIB: enough for the agent's start-up check of its data
            make_record(data, f"r{i}", seed=i, n_samples=1000)
    key = tmp_path / "store.key"
    if not key.exists():
        write_key_file(key)
    (tmp_path / "token").write_text("site-token\n")
    values = {
        "name": '"lyon"',
        "coordinator_url": '"http://127.0.0.1:9"',
        "token_file": f'"{tmp_path / "token"}"',
        "store_key_file": f'"{key}"',
        "store_dir": f'"{tmp_path / "store"}"',
        "cache_dir": f'"{tmp_path / "cache"}"',
        "device": '"cpu"',
        **overrides,
    }
    lines = [f"{k} = {v}" for k, v in values.items() if v]
    lines += ["[[data]]", 'kind = "challenge"', f'path = "{data}"']
    path = tmp_path / "site.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_file_then_environment_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path)
    monkeypatch.setenv("CARDIOFL_SITE_POLL_WAIT_S", "7")
    settings = load_settings(config)
    assert settings.name == "lyon" and settings.poll_wait_s == 7.0 and settings.data[0].kind == "challenge"
    assert read_token(settings) == "site-token"
    assert len(check_settings(settings)) == 32


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"coordinator_url": ""}, "setting 'coordinator_url' (CARDIOFL_SITE_COORDINATOR_URL"),
        ({"coordinator_url": '"not a url"'}, "setting 'coordinator_url'"),
        ({"name": '"Lyon Hospital"'}, "setting 'name'"),
        ({"poll_wait_s": "-1"}, "setting 'poll_wait_s'"),
        ({"colour": '"blue"'}, "setting 'colour'"),
    ],
)
def test_invalid_settings_name_the_setting(tmp_path: Path, overrides: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        load_settings(write_config(tmp_path, **overrides))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"token_file": ""}, "setting 'token'"),
        ({"token_file": '"/nonexistent/token"'}, "setting 'token_file'"),
        ({"ca_bundle": '"/nonexistent/ca.pem"'}, "setting 'ca_bundle'"),
        (
            {"device": '"cuda:7"'} if not __import__("torch").cuda.is_available() else {"device": '"tpu"'},
            "setting 'device'",
        ),
        ({"store_key_file": '"/nonexistent/key"'}, "setting 'store_key' / 'store_key_file'"),
    ],
)
def test_startup_checks_name_the_setting(tmp_path: Path, overrides: dict[str, str], named: str) -> None:
    settings = load_settings(write_config(tmp_path, **overrides))
    with pytest.raises(ConfigError, match=named):
        check_settings(settings)


def test_missing_data_folder_is_named(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    shutil.rmtree(tmp_path / "ecg")
    settings = load_settings(config)
    check_settings(settings)  # the data are opened after the cheap checks, by open_data
    with pytest.raises(ConfigError, match=r"setting 'data.0.path' \(CARDIOFL_SITE_DATA or `data`.*does not exist"):
        open_data(settings)


def test_run_refuses_bad_config_with_exit_code_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["site", "run", "--config", str(write_config(tmp_path, coordinator_url=""))])
    assert result.exit_code == 2 and "coordinator_url" in result.stderr


def test_run_with_a_wrong_key_stops_and_leaves_the_store_untouched(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    store = SiteStore(tmp_path / "store", generate_key(), "lyon")  # made with another key
    store.save_local("1", 1, {"x": __import__("torch").ones(2)})
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "store").rglob("*") if p.is_file()}
    result = runner.invoke(app, ["site", "run", "--config", str(config)])
    assert result.exit_code == 3 and "does not open the store" in result.stderr
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "store").rglob("*") if p.is_file()}
    assert after == before


def test_the_approvals_version_is_kept_beside_the_key_file_or_else_beside_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path)
    settings = load_settings(config)
    assert approvals_version_file(settings) == tmp_path / "store.key.approvals-version"
    open_store(settings, check_settings(settings))
    assert (tmp_path / "store.key.approvals-version").is_file()  # outside the store: a copy of it leaves it behind
    monkeypatch.setenv("CARDIOFL_SITE_STORE_KEY", base64.urlsafe_b64encode(generate_key()).decode())
    from_environment = load_settings(config)  # the key file is not the key: the record goes beside the store
    assert approvals_version_file(from_environment) == (tmp_path / "store.approvals-version").resolve()
    chosen = load_settings(write_config(tmp_path, approvals_version_file=f'"{tmp_path / "keys" / "approvals"}"'))
    assert approvals_version_file(chosen) == tmp_path / "keys" / "approvals"
    check_settings(chosen)
    assert (tmp_path / "keys").is_dir()


def test_keygen_and_health(tmp_path: Path) -> None:
    key = tmp_path / "k" / "store.key"
    assert runner.invoke(app, ["site", "keygen", "--out", str(key)]).exit_code == 0
    again = runner.invoke(app, ["site", "keygen", "--out", str(key)])
    assert again.exit_code == 1 and "refusing to overwrite" in again.stderr
    heartbeat = tmp_path / "heartbeat"
    config = write_config(tmp_path, heartbeat_file=f'"{heartbeat}"')
    assert runner.invoke(app, ["site", "health", "--config", str(config)]).exit_code == 1
    heartbeat.write_text(f"{time.time() - 5:.0f}\n")
    assert runner.invoke(app, ["site", "health", "--config", str(config), "--max-age", "60"]).exit_code == 0
    assert runner.invoke(app, ["site", "health", "--config", str(config), "--max-age", "1"]).exit_code == 1


def test_sigterm_stops_a_polling_agent_cleanly(tmp_path: Path) -> None:
    config = write_config(tmp_path, poll_interval_s="0.2", max_backoff_s="0.5")
    agent = subprocess.Popen(
        [sys.executable, "-m", "cardiofl", "site", "run", "--config", str(config)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        lines = []
        while time.monotonic() < deadline:  # the coordinator is down: it backs off and keeps trying
            line = agent.stderr.readline()
            lines.append(line)
            if "coordinator unreachable" in line:
                break
        agent.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            agent.send_signal(signal.SIGTERM)  # a second one, as a process group's stop can bring
        _, rest = agent.communicate(timeout=20)
    finally:
        agent.kill()
    assert agent.returncode == 0
    started = "".join(lines)  # its data were opened and summarised before the first poll
    assert started.index("data.0 found 3, loaded 3 (") < started.index("site lyon polling")
    assert rest.count("received SIGTERM; stopping") == 1 and "stopped" in rest
    assert "Traceback" not in rest and "StopRequested" not in rest


def test_the_example_site_config_is_valid_and_documents_every_setting() -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "site.example.toml"
    settings = load_settings(example)
    challenge, ptbxl, manifest = settings.data
    assert (challenge.kind, ptbxl.kind, manifest.kind) == ("challenge", "ptbxl", "manifest")
    assert isinstance(manifest, ManifestSource) and manifest.label_columns == ("dx",)
    text = example.read_text()
    options = {*AgentSettings.model_fields, *ChallengeSource.model_fields, *PtbxlSource.model_fields}
    missing = {name for name in options | set(ManifestSource.model_fields) if not re.search(rf"\b{name}\b", text)}
    assert not missing
