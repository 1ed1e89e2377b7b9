#!/usr/bin/env python3
"""Run the built images for real: a coordinator and two site agents as containers, one tiny study.

`make containers` runs this after deploy/build-images.sh; it needs Docker and Python's standard
library only (not the project's virtual environment). Every container runs as the image's
non-root user on a read-only root file system, with a tmpfs on /tmp and named volumes where the
services write. Like deploy/compose.yaml, with SQLite instead of PostgreSQL and two sites:

1. `cardiofl data synth` (agent image) writes two synthetic sites into a volume;
2. the coordinator (its image's command: migrate, then serve) starts on a private network,
   published on 127.0.0.1 at a free port;
3. `cardiofl site enroll` (coordinator image) writes each site's token into a volume, and
   `cardiofl site keygen` (agent image) each site's store key into the site's volume;
4. the agents start; `cardiofl study create tests/containers/study.toml --start` starts the study;
   each site approves it with `cardiofl site approve` inside its agent's container;
5. the study is polled over the REST API with the admin token until it ends; it must complete with
   both agents' updates in every round, and every service container must then report `healthy`
   (the images' HEALTHCHECK commands, run every 2 s here), run as uid 10001 and fail to write to
   its root file system.

Exit status 0 only when all of that holds. Everything it made (containers, volumes, network) is
removed at the end; on failure the containers' logs are printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
SITES = ["site-1", "site-2"]
UID = "10001"  # the images' service user
T = TypeVar("T")


def log(message: str) -> None:
    print(f"[containers {time.strftime('%H:%M:%S')}] {message}", flush=True)


def docker(*args: str, check: bool = True) -> str:
    result = subprocess.run(["docker", *args], text=True, capture_output=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} ... failed ({result.returncode}):\n{result.stderr}")
    return result.stdout.strip()


def options(env: dict[str, str], mounts: list[str]) -> list[str]:
    """`-e NAME=value` and `-v volume:path` options."""
    found = [item for key, value in env.items() for item in ("-e", f"{key}={value}")]
    return found + [item for mount in mounts for item in ("-v", mount)]


class Run:
    """The containers, volumes and network of one run, all named after a unique prefix."""

    def __init__(self, coordinator_image: str, agent_image: str) -> None:
        self.prefix = f"cardiofl-ci-{os.getpid()}"
        self.network = self.prefix
        self.coordinator_image = coordinator_image
        self.agent_image = agent_image
        self.admin_token = secrets.token_urlsafe(32)
        self.containers: list[str] = []
        self.volumes: list[str] = []
        self.url = ""

    def volume(self, name: str) -> str:
        full = f"{self.prefix}-{name}"
        docker("volume", "create", full)
        self.volumes.append(full)
        return full

    def job(
        self,
        image: str,
        *command: str,
        env: dict[str, str] | None = None,
        mounts: list[str] | None = None,
        user: str | None = None,
    ) -> str:
        """A one-off command in a read-only container on the run's network; its output."""
        run = ["run", "--rm", "--read-only", "--tmpfs", "/tmp", "--network", self.network]
        run += ["--user", user] if user else []
        return docker(*run, *options(env or {}, mounts or []), image, *command)

    def service(self, name: str, image: str, env: dict[str, str], mounts: list[str], *extra: str) -> str:
        """A long-running container, read-only, health-checked every 2 s; reachable as `name`."""
        full = f"{self.prefix}-{name}"
        run = ["run", "--detach", "--name", full, "--network", self.network, "--network-alias", name]
        run += ["--read-only", "--tmpfs", "/tmp", "--health-interval", "2s", "--health-start-period", "60s"]
        docker(*run, *options(env, mounts), *extra, image)
        self.containers.append(full)
        return full

    def api(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.admin_token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def cleanup(self, failed: bool) -> None:
        for name in self.containers:
            if failed:
                print(f"----- docker logs {name} (last 80 lines) -----", flush=True)
                subprocess.run(["docker", "logs", "--tail", "80", name], check=False)
            docker("rm", "--force", "--volumes", name, check=False)
        for name in self.volumes:
            docker("volume", "rm", "--force", name, check=False)
        docker("network", "rm", self.network, check=False)


def wait_for(what: str, probe: Callable[[], T], timeout: float) -> T:
    """The first truthy value of `probe`, polled every second; errors count as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
            if value:
                return value
        except (OSError, RuntimeError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(1)


def running(container: str) -> bool:
    state = docker("inspect", "--format", "{{.State.Status}} (exit code {{.State.ExitCode}})", container)
    if not state.startswith("running"):
        raise RuntimeError(f"{container} stopped: {state}")
    return True


def health(container: str) -> str:
    """The container's health check status ("" when it has none)."""
    return docker("inspect", "--format", "{{if .State.Health}}{{.State.Health.Status}}{{end}}", container)


def published_url(container: str) -> str:
    host, port = docker("port", container, "8000/tcp").splitlines()[0].rsplit(":", 1)
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


def finished_study(api: Callable[[str], Any], study_id: int, timeout: float, containers: list[str]) -> list[dict]:
    """Follow the study until it ends (every container must keep running), then check it: its completed rounds.

    It must have completed its T rounds and the final evaluation, each with an update from every site.
    """
    deadline = time.monotonic() + timeout
    seen = None
    while True:
        for container in containers:
            running(container)
        study = api(f"/api/v1/studies/{study_id}")
        if (study["status"], study["completed_rounds"]) != seen:
            seen = (study["status"], study["completed_rounds"])
            log(f"study {study_id}: {study['status']}, {study['completed_rounds']} round(s) completed")
        if study["status"] in ("completed", "failed", "cancelled"):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"study {study_id} still {study['status']} after {timeout:.0f} s")
        time.sleep(2)

    rounds = api(f"/api/v1/studies/{study_id}/rounds")["data"]
    for item in rounds:
        sites = ", ".join(sorted(update["site"] for update in item["updates"]))
        log(f"  round {item['number']} ({item['kind']}): {item['status']}, updates from {sites}")
    if study["status"] != "completed":
        raise RuntimeError(f"study {study_id} ended {study['status']}")
    if study["completed_rounds"] < study["config"]["rounds"]:
        raise RuntimeError(f"study {study_id} completed only {study['completed_rounds']} rounds")
    completed = [item for item in rounds if item["status"] == "completed"]
    if not any(item["kind"] == "evaluate" for item in completed):
        raise RuntimeError(f"study {study_id}: no completed final evaluation round")
    if any(sorted(update["site"] for update in item["updates"]) != SITES for item in completed):
        raise RuntimeError(f"study {study_id}: a completed round lacks an agent's update")
    return completed


def study_run(run: Run, records: int, timeout: float) -> None:
    """Everything but the clean-up; raises on the first thing that does not hold."""
    docker("network", "create", run.network)
    data, tokens = run.volume("data"), run.volume("tokens")

    log(f"synthetic data: {len(SITES)} sites x {records} records")
    synth = ["cardiofl", "data", "synth", "--sites", str(len(SITES)), "--records", str(records), "--out", "/data"]
    run.job(run.agent_image, *synth, mounts=[f"{data}:/data"], user="root")

    log("coordinator: migrate, then serve (SQLite on its volume)")
    coordinator_env = {
        "CARDIOFL_DATABASE_URL": "sqlite:////var/lib/cardiofl/coordinator.db",
        "CARDIOFL_BLOB_DIR": "/var/lib/cardiofl/blobs",
        "CARDIOFL_ADMIN_TOKEN": run.admin_token,
        "CARDIOFL_WORKERS": "1",  # SQLite: one worker (PostgreSQL for more)
    }
    volume = run.volume("coordinator")
    mounts = [f"{volume}:/var/lib/cardiofl"]
    coordinator = run.service("coordinator", run.coordinator_image, coordinator_env, mounts, "-p", "127.0.0.1::8000")
    run.url = wait_for("published port", lambda: published_url(coordinator), 30)
    wait_for("coordinator answers", lambda: running(coordinator) and run.api("/api/v1/health"), 180)
    log(f"coordinator up at {run.url}")

    admin = {"CARDIOFL_URL": "http://coordinator:8000", "CARDIOFL_TOKEN": run.admin_token}
    enrol = " && ".join(f"cardiofl site enroll {site} --token-file /tokens/{site}" for site in SITES)
    script = f"{enrol} && chown -R {UID}:{UID} /tokens"
    run.job(run.coordinator_image, "sh", "-c", script, env=admin, mounts=[f"{tokens}:/tokens"], user="root")
    log(f"enrolled {', '.join(SITES)}")

    agents = []
    key = "/var/lib/cardiofl/keys/store.key"
    for index, site in enumerate(SITES):
        store = run.volume(site)
        run.job(run.agent_image, "cardiofl", "site", "keygen", "--out", key, mounts=[f"{store}:/var/lib/cardiofl"])
        agent_env = {
            "CARDIOFL_SITE_NAME": site,
            "CARDIOFL_SITE_COORDINATOR_URL": "http://coordinator:8000",
            "CARDIOFL_SITE_TOKEN_FILE": f"/run/cardiofl/tokens/{site}",
            "CARDIOFL_SITE_STORE_KEY_FILE": key,
            "CARDIOFL_SITE_DATA": json.dumps([{"kind": "challenge", "path": f"/data/site_{index:02d}"}]),
            "CARDIOFL_SITE_DEVICE": "auto",
            "CARDIOFL_SITE_POLL_INTERVAL_S": "1",
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // len(SITES))),  # the agents share the cores
        }
        mounts = [f"{data}:/data:ro", f"{tokens}:/run/cardiofl/tokens:ro", f"{store}:/var/lib/cardiofl"]
        agents.append(run.service(site, run.agent_image, agent_env, mounts))
    log("agents started")

    study_file = [f"{HERE / 'study.toml'}:/etc/cardiofl/study.toml:ro"]
    create = ["cardiofl", "study", "create", "/etc/cardiofl/study.toml", "--start", "--json"]
    study_id = json.loads(run.job(run.coordinator_image, *create, env=admin, mounts=study_file))["id"]
    log(f"study {study_id} started")

    # Each site's operator approves the study inside its agent's container, as a hospital would,
    # once the agents have said they await it (the coordinator offers them no task until then).
    def awaiting() -> bool:
        approvals = run.api(f"/api/v1/studies/{study_id}")["approvals"]
        return all(approvals.get(site) == "awaiting approval" for site in SITES)

    wait_for("agents await approval", awaiting, 120)
    for container in agents:
        docker("exec", container, "cardiofl", "site", "approve", str(study_id), "--yes")
    log(f"study {study_id} approved at {', '.join(SITES)}")

    finished_study(run.api, study_id, timeout, [coordinator, *agents])

    for container in [coordinator, *agents]:
        wait_for(f"{container} healthy", lambda c=container: health(c) == "healthy", 60)
        user = docker("exec", container, "id", "-u")
        if user != UID:
            raise RuntimeError(f"{container} runs as uid {user}, not {UID}")
        write = subprocess.run(["docker", "exec", container, "touch", "/opt/cardiofl/x"], capture_output=True)
        if write.returncode == 0:
            raise RuntimeError(f"{container} could write to its root file system")
    log(f"study {study_id} completed; every container healthy, uid {UID}, read-only root file system")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator-image", default=os.environ.get("COORDINATOR_IMAGE", "cardiofl/coordinator"))
    parser.add_argument("--agent-image", default=os.environ.get("AGENT_IMAGE", "cardiofl/site-agent"))
    parser.add_argument("--records", type=int, default=100, help="synthetic records per site")
    parser.add_argument("--timeout", type=float, default=480, help="seconds the study may take once started")
    args = parser.parse_args()

    run = Run(args.coordinator_image, args.agent_image)
    started = time.monotonic()
    failed = True
    try:
        study_run(run, args.records, args.timeout)
        failed = False
    except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as exc:
        log(f"FAILED: {exc}")
    finally:
        run.cleanup(failed)
    log(f"{'failed' if failed else 'passed'} in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
