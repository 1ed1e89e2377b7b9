#!/usr/bin/env python3
"""Run the production compose files for real: PostgreSQL, the coordinator and two site agents, one tiny study.

Needs Docker and `docker compose` (the plugin) or `docker-compose` (Debian's 1.29), root (the
secret files are given to the containers' users), and Python's standard library only. Where Docker
is missing it says so and exits 0. The steps, as an operator would take them:

1. deploy/build-images.sh builds the images (cardiofl/postgres among them; --no-build skips it);
2. the secret files (PostgreSQL's password, the admin token) are written into a temporary folder
   and deploy/compose.coordinator.yaml starts, published on 127.0.0.1 at a free port; both
   services must become healthy;
3. `cardiofl data synth` (agent image) writes two synthetic sites; `cardiofl site enroll`, run in
   the coordinator's container with the admin token from its secret, enrols them; each site's
   token and store key (`cardiofl site keygen`) become its secret files, its site.toml its config;
4. deploy/compose.site.yaml starts twice, as two projects with their own env files, on the host's
   network; `cardiofl study create tests/containers/study.toml --start` runs in the coordinator's
   container and each site approves the study with `cardiofl site approve` in its agent's container;
5. the study must complete with both agents' updates in every round; PostgreSQL must hold it
   (psql in its container); no secret value may appear in `docker inspect` of any container; every
   container must be healthy, run as its non-root user with the compose file's restart policy,
   and fail to write to its read-only root file system.

Exit status 0 only when all of that holds. The projects are taken down with their volumes and
networks at the end, and the temporary folder removed; on failure the services' logs come first.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from run_study import SITES, docker, finished_study, health, log, running, wait_for

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
COORDINATOR_FILE = REPO / "deploy" / "compose.coordinator.yaml"
SITE_FILE = REPO / "deploy" / "compose.site.yaml"
UIDS = {"postgres": "999", "coordinator": "10001", "agent": "10001"}  # each service's user
AGENT_IMAGE = "cardiofl/site-agent:cpu"
SITE_CONFIG = "/etc/cardiofl/site.toml"  # where compose.site.yaml mounts the site's TOML file


def compose_command() -> list[str] | None:
    """`docker compose` where the plugin is installed, else `docker-compose`, else None."""
    for command in (["docker", "compose"], ["docker-compose"]):
        try:
            found = subprocess.run([*command, "version"], capture_output=True, check=False)
        except FileNotFoundError:
            continue
        if found.returncode == 0:
            return command
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_secret(path: Path, value: str, *, owner: int | None, mode: int) -> None:
    """One line, given to `owner` (a container's uid) with `mode`: compose bind-mounts it as it is."""
    path.write_text(value + "\n")
    if owner is not None:
        os.chown(path, owner, owner)
    path.chmod(mode)


class Project:
    """One compose project: a compose file, its env file, a project name."""

    def __init__(self, compose: list[str], name: str, file: Path, env_file: Path) -> None:
        self.name = name
        self.command = [*compose, "-p", name, "-f", str(file), "--env-file", str(env_file)]
        # Nothing from this shell's environment: the env file alone sets the compose file's variables.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CARDIOFL_", "COMPOSE_"))}

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> str:
        result = subprocess.run(
            [*self.command, *args], text=True, capture_output=True, env=self.env, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{self.name}: compose {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result.stdout.strip()

    def container(self, service: str) -> str:
        found = self("ps", "-q", service).split()
        if not found:
            raise RuntimeError(f"{self.name}: no container for {service}")
        return found[0]

    def down(self, failed: bool) -> None:
        if failed:
            print(f"----- {self.name}: logs (last 60 lines each) -----", flush=True)
            print(self("logs", "--no-color", "--tail", "60", check=False), flush=True)
        self("down", "--volumes", "--remove-orphans", "--timeout", "20", check=False)


class Deployment:
    """The temporary folder, the projects started, and the secret values to look for."""

    def __init__(self, compose: list[str], records: int) -> None:
        self.compose = compose
        self.records = records
        self.prefix = f"cardiofl-prod-{os.getpid()}"
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.projects: list[Project] = []
        self.secrets: dict[str, str] = {}  # what each secret file holds, by name
        self.url = ""

    def project(self, suffix: str, file: Path, settings: dict[str, str]) -> Project:
        env_file = self.root / f"{suffix}.env"
        env_file.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        project = Project(self.compose, f"{self.prefix}-{suffix}", file, env_file)
        self.projects.append(project)
        return project

    def api(self, path: str) -> Any:
        token = self.secrets["admin_token"]
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def cleanup(self, failed: bool) -> None:
        for project in reversed(self.projects):  # the sites first
            project.down(failed)
        shutil.rmtree(self.root, ignore_errors=True)


def healthy(container: str) -> bool:
    """Whether the running container's health check passes (RuntimeError once it stopped)."""
    return running(container) and health(container) == "healthy"


def as_admin(coordinator: str, command: str, stdin: str | None = None) -> str:
    """`command` in the coordinator's container, with the admin token read there from its secret."""
    script = f"CARDIOFL_TOKEN=$(cat /run/secrets/admin_token) && export CARDIOFL_TOKEN && {command}"
    result = subprocess.run(
        ["docker", "exec", "-i", coordinator, "sh", "-c", script], input=stdin, text=True, capture_output=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"in the coordinator: {command} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


def start_coordinator(run: Deployment) -> Project:
    folder = run.root / "coordinator-secrets"
    folder.mkdir(mode=0o700)
    run.secrets["postgres_password"] = secrets.token_hex(24)
    run.secrets["admin_token"] = secrets.token_urlsafe(32)
    # Read by both services' users (999 and 10001); the folder above is root's alone.
    write_secret(folder / "postgres_password", run.secrets["postgres_password"], owner=None, mode=0o444)
    write_secret(folder / "admin_token", run.secrets["admin_token"], owner=int(UIDS["coordinator"]), mode=0o400)

    port = free_port()
    settings = {"CARDIOFL_SECRETS_DIR": str(folder), "CARDIOFL_PUBLISH": f"127.0.0.1:{port}", "CARDIOFL_WORKERS": "2"}
    project = run.project("coordinator", COORDINATOR_FILE, settings)
    log(f"{project.name}: up (PostgreSQL, then the coordinator on 127.0.0.1:{port})")
    project("up", "-d")
    for service in ("postgres", "coordinator"):
        container = project.container(service)
        wait_for(f"{service} healthy", lambda c=container: healthy(c), 240)
    run.url = f"http://127.0.0.1:{port}"
    report = run.api("/api/v1/health")
    log(f"postgres and coordinator healthy; /api/v1/health: {report}")
    return project


def start_site(run: Deployment, coordinator: str, index: int, site: str) -> Project:
    folder = run.root / f"{site}-secrets"
    folder.mkdir(mode=0o700)
    os.chown(folder, int(UIDS["agent"]), int(UIDS["agent"]))  # keygen writes the key there as the agent
    enrolled = json.loads(as_admin(coordinator, f"cardiofl site enroll {site} --json"))
    run.secrets[f"{site} token"] = enrolled["token"]["token"]
    write_secret(folder / "site_token", enrolled["token"]["token"], owner=int(UIDS["agent"]), mode=0o400)
    keygen = ["cardiofl", "site", "keygen", "--out", "/out/store_key"]
    docker("run", "--rm", "--network", "none", "--read-only", "--user", UIDS["agent"], "-v", f"{folder}:/out",
           AGENT_IMAGE, *keygen)  # fmt: skip
    run.secrets[f"{site} store key"] = (folder / "store_key").read_text().strip()

    config = run.root / f"{site}.toml"
    config.write_text(
        f'name = "{site}"\n'
        f'coordinator_url = "{run.url}"\n'
        'device = "cpu"\n'
        "poll_interval_s = 1\n"
        "poll_wait_s = 5\n"
        "[[data]]\n"
        'kind = "challenge"\n'
        'path = "/data"\n'
    )
    config.chmod(0o644)
    settings = {
        "CARDIOFL_SITE_CONFIG": str(config),
        "CARDIOFL_SITE_SECRETS_DIR": str(folder),
        "CARDIOFL_SITE_DATA_DIR": str(run.root / "data" / f"site_{index:02d}"),
        "CARDIOFL_SITE_NETWORK_MODE": "host",  # the coordinator is published on this host's loopback address
    }
    project = run.project(site, SITE_FILE, settings)
    project("up", "-d")
    log(f"{project.name}: enrolled, store key made, agent up")
    return project


def complete_study(run: Deployment, coordinator: str, agents: list[str], timeout: float) -> int:
    """Create, start and approve the study; its id once it completed as it should."""
    create = "cat >/tmp/study.toml && exec cardiofl study create /tmp/study.toml --start --json"
    study_id = json.loads(as_admin(coordinator, create, stdin=(HERE / "study.toml").read_text()))["id"]
    log(f"study {study_id} started")

    def awaiting() -> bool:
        approvals = run.api(f"/api/v1/studies/{study_id}")["approvals"]
        return all(approvals.get(site) == "awaiting approval" for site in SITES)

    wait_for("agents await approval", awaiting, 180)
    for agent in agents:
        docker("exec", agent, "cardiofl", "site", "approve", str(study_id), "--yes", "--config", SITE_CONFIG)
    log(f"study {study_id} approved at {', '.join(SITES)}")

    completed = finished_study(run.api, study_id, timeout, [coordinator, *agents])
    log(f"study {study_id} completed: {len(completed)} rounds, each with updates from {', '.join(SITES)}")
    return study_id


def check_postgres(postgres: str, coordinator: str, study_id: int) -> None:
    """The coordinator's URL names PostgreSQL, and PostgreSQL holds the study and its updates."""
    environment = json.loads(docker("inspect", "--format", "{{json .Config.Env}}", coordinator))
    url = next((item.split("=", 1)[1] for item in environment if item.startswith("CARDIOFL_DATABASE_URL=")), "")
    if not url.startswith("postgresql"):
        raise RuntimeError(f"the coordinator's CARDIOFL_DATABASE_URL is {url!r}")
    query = (
        "SELECT s.status || ' ' || (SELECT count(*) FROM updates u JOIN rounds r ON r.id = u.round_id"
        f" WHERE r.study_id = s.id) FROM studies s WHERE s.id = {int(study_id)}"
    )
    answer = docker("exec", postgres, "psql", "--no-psqlrc", "-tA", "-d", "cardiofl", "-c", query)
    status, _, updates = answer.partition(" ")
    if status != "completed" or int(updates or 0) < len(SITES):
        raise RuntimeError(f"PostgreSQL holds study {study_id} as {answer!r}")
    log(f"PostgreSQL holds study {study_id}: {status}, {updates} updates")


def check_containers(run: Deployment, containers: dict[str, str]) -> None:
    """No secret in `docker inspect`; healthy, non-root, restarted unless stopped, read-only root."""
    for name, container in containers.items():
        inspected = docker("inspect", container)
        leaked = [what for what, value in run.secrets.items() if value in inspected]
        if leaked:
            raise RuntimeError(f"{name}: `docker inspect` shows {', '.join(leaked)}")
        wait_for(f"{name} healthy", lambda c=container: healthy(c), 180)
        (details,) = json.loads(inspected)
        if details["HostConfig"]["RestartPolicy"]["Name"] != "unless-stopped":
            raise RuntimeError(f"{name}: restart policy {details['HostConfig']['RestartPolicy']}")
        if not details["HostConfig"]["ReadonlyRootfs"]:
            raise RuntimeError(f"{name}: its root file system is writable")
        service = details["Config"]["Labels"].get("com.docker.compose.service", "")
        user = docker("exec", container, "id", "-u")
        if user != UIDS[service]:
            raise RuntimeError(f"{name} runs as uid {user}, not {UIDS[service]}")
        write = subprocess.run(["docker", "exec", container, "touch", "/usr/cardiofl-write-test"], capture_output=True)
        if write.returncode == 0:
            raise RuntimeError(f"{name} could write to its root file system")
    log(
        f"{len(containers)} containers: healthy, non-root, restart unless-stopped, read-only root, "
        f"none of {len(run.secrets)} secret values in `docker inspect`"
    )


def deploy(run: Deployment, timeout: float) -> None:
    """Everything but the clean-up; raises on the first thing that does not hold."""
    data = run.root / "data"
    data.mkdir()
    log(f"synthetic data: {len(SITES)} sites x {run.records} records")
    synth = ["cardiofl", "data", "synth", "--sites", str(len(SITES)), "--records", str(run.records), "--out", "/data"]
    isolated = ["run", "--rm", "--network", "none", "--read-only", "--user", "root"]
    docker(*isolated, "-v", f"{data}:/data", AGENT_IMAGE, *synth)
    for folder in [data, *data.iterdir()]:
        folder.chmod(0o755)  # a bind mount's folder keeps its mode: the agents (uid 10001) read it

    coordinator_project = start_coordinator(run)
    coordinator = coordinator_project.container("coordinator")
    postgres = coordinator_project.container("postgres")
    site_projects = [start_site(run, coordinator, index, site) for index, site in enumerate(SITES)]
    agents = [project.container("agent") for project in site_projects]

    study_id = complete_study(run, coordinator, agents, timeout)
    check_postgres(postgres, coordinator, study_id)
    containers = {"postgres": postgres, "coordinator": coordinator}
    containers |= {f"{site} agent": agent for site, agent in zip(SITES, agents, strict=True)}
    check_containers(run, containers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-build", action="store_true", help="use the images as they are")
    parser.add_argument("--records", type=int, default=100, help="synthetic records per site")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the study may take once started")
    args = parser.parse_args()

    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        log("skipped: Docker is not available")
        return 0
    compose = compose_command()
    if compose is None:
        log("FAILED: neither `docker compose` nor `docker-compose` is installed")
        return 1
    started = time.monotonic()
    if not args.no_build:
        log("deploy/build-images.sh")
        if subprocess.run([str(REPO / "deploy" / "build-images.sh")], cwd=REPO).returncode != 0:
            log("FAILED: deploy/build-images.sh")
            return 1
    log(f"compose: {' '.join(compose)}")

    run = Deployment(compose, args.records)
    deployed = time.monotonic()
    failed = True
    try:
        deploy(run, args.timeout)
        failed = False
    except (RuntimeError, TimeoutError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
        log(f"FAILED: {exc}")
    finally:
        run.cleanup(failed)
    now = time.monotonic()
    outcome = "failed" if failed else "passed"
    log(f"{outcome} in {now - started:.0f} s ({now - deployed:.0f} s from the built images to torn down)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
