"""Real TLS handshakes on 127.0.0.1: `coordinator serve --mutual-tls` with its CA, and agents from site kits."""

from __future__ import annotations

import datetime as dt
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.demo import free_port
from coordinator.pki.tls import TlsFolder, init_folder, issue_server, issue_site
from shared.tls import certificate_pem, load_private_key, new_private_key, private_key_pem, write_private, write_public
from site_agent.client import CoordinatorClient
from site_agent.config import load_settings, read_token
from site_agent.data.synthetic import generate_sites
from site_agent.errors import ConfigError, CoordinatorUnavailable
from site_agent.store import write_key_file
from site_agent.tls import AgentTls, http_client
from tests.conftest import ADMIN_TOKEN
from tests.coordinator.conftest import wait_serving
from tests.e2e.conftest import LiveCoordinator

CARDIOFL = str(Path(sys.executable).parent / "cardiofl")  # the installed console script
PAST = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)  # certificates issued then for a day have expired


@dataclass
class Live:
    """A coordinator under mutual TLS in a subprocess, and what its admin holds."""

    url: str
    folder: TlsFolder
    env: dict[str, str]  # the admin's CARDIOFL_* on the coordinator's host
    admin: httpx.Client  # with a client certificate, as every caller needs one
    data: list[Path]
    root: Path
    process: subprocess.Popen[bytes]

    def cli(self, *args: str) -> str:
        result = CliRunner().invoke(app, list(args), env=self.env)
        assert result.exit_code == 0, result.output
        return result.output

    def kit(self, name: str, client_cert: str = "issue") -> Path:
        """A site kit as the admin makes it, completed the way the site does (store key, [[data]])."""
        kit = self.root / name
        args = ["--out", str(kit), "--url", self.url, "--client-cert", client_cert]
        self.cli("coordinator", "tls", "site-kit", name, *args)
        write_key_file(kit / "store.key")
        with (kit / "site.toml").open("a") as config:
            config.write("poll_interval_s = 0.5\nauto_approve = true\n")
            config.write(f'[[data]]\nkind = "challenge"\npath = "{self.data[0]}"\n')
        return kit


def _client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("tls")
    folder = init_folder(root / "ca", ["127.0.0.1", "localhost"])
    key = new_private_key()  # the admin's own client certificate: mutual TLS asks every caller for one
    write_private(root / "admin.key", private_key_pem(key))
    write_public(root / "admin.pem", certificate_pem(issue_site(folder, "admin", key.public_key())))
    port = free_port()
    env = {"CARDIOFL_DATABASE_URL": f"sqlite:///{root / 'coordinator.db'}", "CARDIOFL_TLS_DIR": str(folder.path)}
    serve_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_")},
        **env,
        "CARDIOFL_ADMIN_TOKEN": ADMIN_TOKEN,
        "CARDIOFL_TICK_INTERVAL_S": "1",
        "CARDIOFL_TASK_POLL_INTERVAL_S": "0.2",
    }
    log = root / "serve.log"
    with log.open("wb") as output:
        command = [CARDIOFL, "coordinator", "serve", "--port", str(port), "--mutual-tls"]
        process = subprocess.Popen(
            command, env=serve_env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"https://127.0.0.1:{port}"
    admin = httpx.Client(
        base_url=url,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        verify=_client_context(folder.ca_cert, root / "admin.pem", root / "admin.key"),
    )
    try:
        wait_serving(lambda: admin.get("/api/v1/health", timeout=1), process, log.read_text, seconds=60)
        data = generate_sites(root / "ecg", n_sites=2, records_per_site=20, seed=3)
        yield Live(url, folder, env, admin, data, root, process)
    finally:
        admin.close()
        _stop(process)


def _agent(live: Live, kit: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`cardiofl site run --config kit/site.toml`, as the site's operator starts it."""
    log = kit / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_")} | {"OMP_NUM_THREADS": "1"}
    with log.open("wb") as output:
        command = [CARDIOFL, "site", "run", "--config", str(kit / "site.toml"), *args]
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    return process, log


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _site_client(kit: Path, **changes: Path | None) -> CoordinatorClient:
    """The agent's client, built as `cardiofl site run` builds it from the kit's site.toml."""
    settings = load_settings(kit / "site.toml", **changes)
    http = http_client(str(settings.coordinator_url), read_token(settings), settings.tls)
    return CoordinatorClient(http, poll_wait_s=0.0, tls=settings.tls)


def _refusal(client: CoordinatorClient) -> str:
    with pytest.raises(CoordinatorUnavailable) as refused:
        client.own_site()
    return str(refused.value)


def _expired_certificate(live: Live, kit: Path) -> Path:
    """A certificate over the kit's key that expired weeks ago."""
    key = load_private_key(kit / "client.key")
    expired = issue_site(live.folder, kit.name, key.public_key(), days=1, now=PAST)
    path = kit / "expired.pem"
    write_public(path, certificate_pem(expired))
    return path


def test_agents_from_site_kits_train_a_round_over_mutual_tls(live: Live) -> None:
    lyon = live.kit("lyon", "issue")  # key and certificate made on the CA's host
    oslo = live.kit("oslo", "csr")  # the site's key stays at the site: only a request travels
    request = live.root / "oslo.csr"
    live.cli("site", "tls", "request", "--config", str(oslo / "site.toml"), "--out", str(request))
    live.cli("coordinator", "tls", "sign", str(request), "--site", "oslo", "--out", str(oslo / "client.pem"))
    (oslo / "site.toml").write_text((oslo / "site.toml").read_text().replace(str(live.data[0]), str(live.data[1])))

    config = {
        "model": {"preset": "tiny", "heads": "6:2"},
        "sites": ["lyon", "oslo"],
        "rounds": 1,
        "round_deadline_s": 120.0,
        "training": {"lr": 0.05, "batch_size": 8, "max_steps": 2},
    }
    study = live.admin.post("/api/v1/studies", json={"name": "over mTLS", "config": config}).json()["id"]
    assert live.admin.post(f"/api/v1/studies/{study}/start").status_code == 200
    agents = [_agent(live, kit, "--max-rounds", "1") for kit in (lyon, oslo)]
    try:
        for process, log in agents:
            assert process.wait(timeout=180) == 0, log.read_text()
            assert "the coordinator knows this token as site" in log.read_text()
    finally:
        for process, _ in agents:
            _stop(process)
    give_up = time.monotonic() + 30
    while (first := live.admin.get(f"/api/v1/studies/{study}/rounds").json()["data"][0])["status"] != "completed":
        assert time.monotonic() < give_up, first
        time.sleep(0.2)
    assert sorted(update["site"] for update in first["updates"]) == ["lyon", "oslo"]


def test_refused_handshakes_say_why_in_one_line(live: Live) -> None:
    kit = live.kit("graz")
    assert _site_client(kit).own_site() == "graz"

    other = init_folder(live.root / "other-ca", ["127.0.0.1"])
    foreign_key = new_private_key()  # a certificate from another CA, for the same name
    write_private(kit / "foreign.key", private_key_pem(foreign_key))
    foreign = certificate_pem(issue_site(other, "graz", foreign_key.public_key()))
    write_public(kit / "foreign.pem", foreign)
    messages = {
        "wrong CA": _refusal(_site_client(kit, ca_bundle=other.ca_cert)),
        "no client certificate": _refusal(_site_client(kit, client_cert=None, client_key=None)),
        "expired": _refusal(_site_client(kit, client_cert=_expired_certificate(live, kit))),
        "foreign": _refusal(_site_client(kit, client_cert=kit / "foreign.pem", client_key=kit / "foreign.key")),
    }
    assert "TLS: the coordinator's certificate is not signed by a CA in setting 'ca_bundle'" in messages["wrong CA"]
    assert "requires a client certificate (mutual TLS)" in messages["no client certificate"]
    assert "client certificate CN=graz" in messages["expired"] and "has expired" in messages["expired"]
    assert "revoked or is not from its CA" in messages["foreign"]
    assert all(message.count("\n") == 0 for message in messages.values())


def test_agents_log_or_exit_with_the_reason(live: Live) -> None:
    wrong_ca = live.kit("wien")
    (wrong_ca / "ca.pem").write_bytes(init_folder(live.root / "wien-ca", ["127.0.0.1"]).ca_cert.read_bytes())
    no_cert = live.kit("bern", "none")
    expired = live.kit("rome")
    _expired_certificate(live, expired).replace(expired / "client.pem")

    runs = {kit.name: _agent(live, kit) for kit in (wrong_ca, no_cert, expired)}
    expected = {
        "wien": "TLS: the coordinator's certificate is not signed by a CA in setting 'ca_bundle'",
        "bern": "TLS: the coordinator drops this agent's connections after the TLS handshake: it requires a client",
    }
    try:
        assert runs["rome"][0].wait(timeout=60) == 2  # checked at start: it never reaches the network
        text = runs["rome"][1].read_text()
        assert "error: setting 'client_cert': this site's client certificate CN=rome" in text and "has expired" in text
        give_up = time.monotonic() + 60
        while not all(line in runs[name][1].read_text() for name, line in expected.items()):
            assert all(runs[name][0].poll() is None for name in expected), {n: runs[n][1].read_text() for n in runs}
            assert time.monotonic() < give_up, {name: runs[name][1].read_text() for name in expected}
            time.sleep(0.2)
    finally:
        for process, _ in runs.values():
            _stop(process)
    for name, line in expected.items():
        text = runs[name][1].read_text()
        logged = next(entry for entry in text.splitlines() if line in entry)  # the reason is on the warning's line
        assert "WARNING site_agent.loop: coordinator unreachable (asking which site this token is: " in logged
        assert "Traceback" not in text and runs[name][0].returncode == 0


def test_a_revoked_certificate_is_refused_without_restarting_anything(live: Live) -> None:
    zurich, basel = live.kit("zurich"), live.kit("basel")
    client, bystander = _site_client(zurich), _site_client(basel)
    assert client.own_site() == "zurich" and bystander.own_site() == "basel"
    out = live.cli("coordinator", "tls", "revoke", "--site", "zurich")
    assert "revoked CN=zurich" in out
    give_up = time.monotonic() + 10
    while True:  # the coordinator reads the new CRL at its next handshake (checked at most once a second)
        try:
            client.own_site()
        except CoordinatorUnavailable as exc:
            assert "it refuses this site's client certificate CN=zurich" in str(exc)
            break
        assert time.monotonic() < give_up, "the revoked certificate is still accepted"
        time.sleep(0.2)
    assert bystander.own_site() == "basel"  # the same client, the same coordinator process
    assert live.process.poll() is None


def test_the_server_certificate_is_renewed_under_running_agents(live: Live) -> None:
    kit = live.kit("turku")
    client = _site_client(kit)
    assert client.own_site() == "turku"
    issue_server(live.folder, ["127.0.0.1"], days=1, now=PAST)  # as if the admin had let it expire
    give_up = time.monotonic() + 10
    while True:
        try:
            client.own_site()
        except CoordinatorUnavailable as exc:
            assert "the coordinator's certificate has expired" in str(exc) and "tls renew --server" in str(exc)
            break
        assert time.monotonic() < give_up, "the expired certificate was never served"
        time.sleep(0.2)
    out = live.cli("coordinator", "tls", "renew", "--server", "--host", "127.0.0.1", "--host", "localhost")
    assert "serves it from its next TLS handshake" in out
    served = x509.load_pem_x509_certificate(live.folder.server_cert.read_bytes())
    give_up = time.monotonic() + 10
    while True:  # the agent's client, unchanged, is back in
        try:
            assert client.own_site() == "turku"
            break
        except CoordinatorUnavailable:
            assert time.monotonic() < give_up, "the renewed certificate was never served"
            time.sleep(0.2)
    pem = ssl.get_server_certificate(("127.0.0.1", int(live.url.rsplit(":", 1)[1])))
    assert x509.load_pem_x509_certificate(pem.encode()).serial_number == served.serial_number


def test_the_agent_refuses_unusable_tls_files_at_start(live: Live) -> None:
    kit = live.kit("riga")
    settings = load_settings(kit / "site.toml")
    settings.tls.check("riga")
    with pytest.raises(ConfigError, match="is not site 'oslo'"):
        settings.tls.check("oslo")
    other = live.kit("kyiv")
    with pytest.raises(ConfigError, match="is not the key of CN=riga"):
        AgentTls(settings.ca_bundle, settings.client_cert, other / "client.key").check("riga")
    with pytest.raises(ConfigError, match="setting 'ca_bundle': .* holds no PEM certificate"):
        AgentTls(kit / "token", settings.client_cert, settings.client_key).check("riga")
    with pytest.raises(ConfigError, match="has expired"):
        AgentTls(settings.ca_bundle, _expired_certificate(live, kit), settings.client_key).check("riga")


def _health(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The coordinator image's HEALTHCHECK command, with the container's CARDIOFL_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_")}
    command = [sys.executable, "-m", "coordinator.healthcheck"]
    return subprocess.run(command, env=clean | env, capture_output=True, text=True, timeout=30)


def test_the_container_health_check_speaks_mutual_tls(live: Live) -> None:
    port = live.url.rsplit(":", 1)[1]
    tls = {"CARDIOFL_PORT": port, "CARDIOFL_TLS_DIR": str(live.folder.path)}
    assert _health({**tls, "CARDIOFL_TLS_MUTUAL": "true"}).returncode == 0  # the server's own certificate
    refused = _health(tls)  # no client certificate: the coordinator drops the connection
    assert refused.returncode == 1 and refused.stderr.startswith("unhealthy:")
    plain = _health({"CARDIOFL_PORT": port})  # plain HTTP to an HTTPS port
    assert plain.returncode == 1 and plain.stderr.startswith("unhealthy:")
    assert _health({**tls, "CARDIOFL_TLS_MUTUAL": "true", "CARDIOFL_PORT": str(free_port())}).returncode == 1


def test_people_use_the_cli_under_mutual_tls_with_a_client_certificate(live: Live) -> None:
    person = live.root / "ana"
    out = live.cli("coordinator", "tls", "client", "ana", "--out", str(person))
    assert "CARDIOFL_CLIENT_CERT" in out and (person / "client.key").stat().st_mode & 0o777 == 0o600
    env = {"CARDIOFL_URL": live.url, "CARDIOFL_TOKEN": ADMIN_TOKEN, "CARDIOFL_CA_BUNDLE": str(person / "ca.pem")}
    with_cert = env | {
        "CARDIOFL_CLIENT_CERT": str(person / "client.pem"),
        "CARDIOFL_CLIENT_KEY": str(person / "client.key"),
    }
    listed = CliRunner().invoke(app, ["site", "list", "--json"], env=with_cert)
    assert listed.exit_code == 0, listed.output
    refused = CliRunner().invoke(app, ["site", "list"], env=env)  # no client certificate: dropped
    assert refused.exit_code == 1 and "cannot reach the coordinator" in refused.output
    half = CliRunner().invoke(app, ["site", "list"], env=env | {"CARDIOFL_CLIENT_CERT": str(person / "client.pem")})
    assert half.exit_code == 2 and "CARDIOFL_CLIENT_KEY" in half.output
    assert "ana" in live.cli("coordinator", "tls", "list")


def test_the_container_health_check_over_plain_http(live_coordinator: LiveCoordinator) -> None:
    assert _health({"CARDIOFL_PORT": live_coordinator.url.rsplit(":", 1)[1]}).returncode == 0
