"""Two coordinator replicas on one PostgreSQL behind HAProxy: one is killed mid-round, then while it aggregates.

Real processes on 127.0.0.1: `cardiofl coordinator serve` twice (as on two hosts: the same database
and blob directory, each its own port), HAProxy with deploy/haproxy.cfg in front, and two site agents
(`cardiofl site run`) that know only HAProxy's address. The test holds a share lock on the global models' table from
the moment round 1 opens: updates still come in, but the aggregator can store theta^g_1 only once it
is released. Replica a is killed with SIGKILL while the round is open, then started again as a
supervisor would; then the replica that claimed the aggregation is killed in the middle of it
(after the claim, before the result is stored, whichever replica it was) and the lock released.
The study must finish with every round's update of every site counted once and the survivor
having taken over the aggregation lease.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Connection, create_engine, text

from cardiofl.demo import DemoPlan, Processes, _write_site_config, _write_site_token, free_port, managed_processes
from coordinator.config import generate_admin_token
from site_agent.data.synthetic import generate_sites
from tests.coordinator.conftest import postgres_schema_url

HAPROXY_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
SITES = ["site-1", "site-2"]
ROUNDS = 2
LEASE_S = 3


def haproxy_or_skip() -> str:
    found = shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )  # fmt: skip
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("haproxy is required in CI (.ci/run installs Debian's haproxy package)")
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    return found


@pytest.fixture()
def database_url() -> Iterator[str]:
    yield from postgres_schema_url()


def wait_for(condition: Callable[[], object], timeout: float, what: str, processes: Processes, logs: Path) -> object:
    """Poll `condition` every 50 ms until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        processes.check_alive(logs)
        if found := condition():
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; logs in {logs}")


def _cardiofl(*args: str) -> list[str]:
    return [sys.executable, "-m", "cardiofl", *args]


def _round(db: Connection, study_id: int, number: int) -> tuple[int, str, datetime | None] | None:
    """(id, status, closed_at) of the newest attempt of round `number`."""
    row = db.execute(
        text(
            "SELECT id, status, closed_at FROM rounds WHERE study_id = :s AND number = :n ORDER BY attempt DESC LIMIT 1"
        ),
        {"s": study_id, "n": number},
    ).first()
    db.rollback()
    return (row[0], row[1], row[2]) if row is not None else None


def _updates(db: Connection, round_id: int) -> int:
    count = db.scalar(text("SELECT count(*) FROM updates WHERE round_id = :r"), {"r": round_id}) or 0
    db.rollback()
    return count


def _waiting_to_store(db: Connection) -> str | None:
    """The replica (its application_name) whose aggregation waits on a lock to store theta^g_t."""
    name = db.scalar(
        text(
            "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE 'replica-%' "
            "AND wait_event_type = 'Lock' AND query ILIKE '%global_models%'"
        )
    )
    db.rollback()
    return name


def _activity(db: Connection) -> list[tuple[str, str, str | None, str]]:
    """Every replica's connection: (name, state, what it waits for, its statement), for a failure's message."""
    rows = db.execute(
        text(
            "SELECT application_name, state, wait_event_type, left(query, 160) FROM pg_stat_activity "
            "WHERE application_name LIKE 'replica-%'"
        )
    ).all()
    db.rollback()
    return [tuple(row) for row in rows]


def test_killing_a_replica_mid_round_and_while_it_aggregates_loses_nothing(database_url: str, tmp_path: Path) -> None:
    haproxy = haproxy_or_skip()
    logs = tmp_path / "logs"
    logs.mkdir()
    admin_token = generate_admin_token()
    ports = {"a": free_port(), "b": free_port()}
    front = free_port()
    url = f"http://127.0.0.1:{front}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_")}
    coordinator_env = {
        **base,
        "CARDIOFL_ADMIN_TOKEN": admin_token,
        "CARDIOFL_BLOB_DIR": str(tmp_path / "blobs"),  # shared by both replicas
        "CARDIOFL_MIGRATE_ON_START": "false",  # migrated once, below
        "CARDIOFL_AGGREGATION_LEASE_S": str(LEASE_S),
        "CARDIOFL_TICK_INTERVAL_S": "1",
        "CARDIOFL_LOG_FORMAT": "json",
    }
    subprocess.run(
        _cardiofl("coordinator", "migrate"),
        env={**coordinator_env, "CARDIOFL_DATABASE_URL": database_url},
        check=True,
        capture_output=True,
    )

    def start_replica(processes: Processes, name: str) -> subprocess.Popen[bytes]:
        env = {**coordinator_env, "CARDIOFL_DATABASE_URL": f"{database_url}&application_name=replica-{name}"}
        serve = _cardiofl("coordinator", "serve", "--host", "127.0.0.1", "--port", str(ports[name]))
        child = processes.start(f"replica-{name}", serve, env, logs / f"replica-{name}-{time.monotonic_ns()}.log")
        return child

    engine = create_engine(database_url)
    with contextlib.ExitStack() as stack, managed_processes() as processes:
        db, locker = stack.enter_context(engine.connect()), stack.enter_context(engine.connect())
        replicas = {name: start_replica(processes, name) for name in ports}
        haproxy_env = {
            **base,
            "CARDIOFL_LISTEN": f"127.0.0.1:{front}",
            "CARDIOFL_REPLICA_A": f"127.0.0.1:{ports['a']}",
            "CARDIOFL_REPLICA_B": f"127.0.0.1:{ports['b']}",
        }
        processes.start("haproxy", [haproxy, "-db", "-f", str(HAPROXY_CONFIG)], haproxy_env, logs / "haproxy.log")
        admin = stack.enter_context(
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=30)
        )

        def healthy() -> bool:
            try:
                return (
                    all(
                        httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2).status_code == 200
                        for port in ports.values()
                    )
                    and admin.get("/api/v1/health").status_code == 200
                )
            except httpx.TransportError:
                return False

        wait_for(healthy, 60, "both replicas and HAProxy", processes, logs)

        plan = DemoPlan(workdir=tmp_path, sites=len(SITES), records_per_site=40)
        folders = generate_sites(tmp_path / "data", len(SITES), 40, 0)
        agent_env = {**base, "OMP_NUM_THREADS": "1"}
        for name, folder in zip(SITES, folders, strict=True):
            response = admin.post("/api/v1/sites", json={"name": name})
            assert response.status_code == 201, response.text
            token_file = _write_site_token(plan, name, response.json()["token"]["token"])
            config = _write_site_config(plan, name, [folder], url, token_file)
            processes.start(name, _cardiofl("site", "run", "--config", str(config)), agent_env, logs / f"{name}.log")
        terms = {
            "model": {"preset": "tiny", "heads": "6:2"},
            "sites": SITES,
            "rounds": ROUNDS,
            "min_sites": len(SITES),
            "round_deadline_s": 300,
            "training": {"optimizer": "adam", "lr": 0.003, "batch_size": 8, "max_steps": 2},
            "privacy": {"min_records": 1},
        }
        created = admin.post("/api/v1/studies", json={"name": "replicas", "config": terms})
        assert created.status_code == 201, created.text
        study_id = created.json()["id"]
        assert admin.post(f"/api/v1/studies/{study_id}/start").status_code == 200

        # Round 1, held: a share lock on the global models table lets updates in, keeps theta^g_1 from being stored.
        first = wait_for(
            lambda: (r := _round(db, study_id, 1)) and r[1] == "open" and r,
            180,
            "round 1 to open",
            processes,
            logs,
        )
        locker.execute(text("LOCK TABLE global_models IN SHARE MODE"))  # reads go on; storing theta^g waits
        # Replica a dies while the round is open (the agents' requests in flight to it fail), and comes back.
        open_before_kill = _round(db, study_id, 1)
        received_before_kill = _updates(db, first[0])
        os.killpg(replicas["a"].pid, signal.SIGKILL)
        replicas["a"].wait()
        processes.children = [(n, c) for n, c in processes.children if c is not replicas["a"]]
        replicas["a"] = start_replica(processes, "a")
        wait_for(healthy, 60, "replica a to be back", processes, logs)
        assert open_before_kill == (first[0], "open", None) and received_before_kill < len(SITES)

        # Whichever replica claimed round 1's aggregation dies in the middle of it.
        try:
            aggregating = wait_for(lambda: _waiting_to_store(db), 180, "a replica aggregating round 1", processes, logs)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nconnections: {_activity(db)}") from None
        victim = str(aggregating).removeprefix("replica-")
        assert _round(db, study_id, 1) == (first[0], "aggregating", None)  # claimed, not stored
        assert _updates(db, first[0]) == len(SITES)
        os.killpg(replicas[victim].pid, signal.SIGKILL)
        replicas[victim].wait()
        processes.children = [(n, c) for n, c in processes.children if c is not replicas[victim]]
        locker.commit()  # the survivor may store theta^g_1 once the dead replica's lease runs out

        def finished() -> str | None:
            status = admin.get(f"/api/v1/studies/{study_id}").json()["status"]
            return status if status in {"completed", "failed", "cancelled"} else None

        assert wait_for(finished, 300, "the study to finish", processes, logs) == "completed"
        rounds = admin.get(f"/api/v1/studies/{study_id}/rounds").json()["data"]
        audit = [
            (event["action"], event["round_id"], json.dumps(event.get("detail")))
            for event in admin.get(f"/api/v1/studies/{study_id}/audit").json()["data"]
        ]

    completed = [r for r in rounds if r["status"] == "completed"]
    assert sorted(r["number"] for r in completed) == list(range(1, ROUNDS + 2))  # and the final evaluation
    assert all(r["attempt"] == 1 for r in rounds)  # no round had to be tried again
    for r in completed:  # every site's update counted once, with weights that add up
        assert sorted(u["site"] for u in r["updates"]) == SITES, r
        if r["kind"] == "train":
            assert sum(u["weight"] for u in r["updates"]) == pytest.approx(1.0)
            assert r["global_model_sha256"] is not None
    with engine.connect() as check:
        stored = check.execute(
            text("SELECT round_number, count(*) FROM global_models WHERE study_id = :s GROUP BY round_number"),
            {"s": study_id},
        ).all()
        duplicates = check.scalar(
            text("SELECT count(*) FROM (SELECT round_id, site_id FROM updates GROUP BY 1, 2 HAVING count(*) > 1) d")
        )
    engine.dispose()
    assert sorted(stored) == [(t, 1) for t in range(ROUNDS + 1)]  # theta^g_0 ... theta^g_T, each once
    assert duplicates == 0
    claims = [action for action, round_id, _ in audit if round_id == first[0] and "aggregat" in action]
    assert claims[:2] == ["round.aggregating", "round.aggregation_taken_over"], audit  # the survivor took over
