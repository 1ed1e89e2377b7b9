"""Slow and idle clients against `cardiofl coordinator serve`: others' requests still answer; late headers are cut."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import ADMIN_TOKEN
from tests.coordinator.conftest import wait_serving

CARDIOFL = str(Path(sys.executable).parent / "cardiofl")
ECHO_AGENT = Path(__file__).resolve().parents[2] / "bench" / "echo_agent.py"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
IDLE_CONNECTIONS = 200
PROMPT_S = 2.0  # what "answers promptly" means here, on two shared cores


@contextmanager
def serving(tmp_path: Path, header_timeout: float) -> Iterator[tuple[str, int]]:
    """`cardiofl coordinator serve --header-timeout` on a new SQLite database: (base URL, port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {name: value for name, value in os.environ.items() if not name.startswith("CARDIOFL_")}
    env |= {"CARDIOFL_DATABASE_URL": f"sqlite:///{tmp_path / 'coordinator.db'}", "CARDIOFL_ADMIN_TOKEN": ADMIN_TOKEN}
    env |= {"CARDIOFL_TICK_INTERVAL_S": "0.5"}
    log = tmp_path / "serve.log"
    command = [CARDIOFL, "coordinator", "serve", "--port", str(port), "--header-timeout", str(header_timeout)]
    with log.open("wb") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=output, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_serving(lambda: httpx.get(f"{base}/api/v1/health", timeout=1), server, log.read_text)
        yield base, port
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def dribble(port: int, data: bytes, stop: threading.Event, every_s: float = 1.0, first: bytes = b"") -> socket.socket:
    """A connection that sends `first`, then `data` one byte every `every_s` seconds from a thread, until `stop`."""
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(first)

    def send() -> None:
        for byte in data:
            if stop.wait(every_s):
                return
            try:
                connection.send(bytes([byte]))
            except OSError:
                return

    threading.Thread(target=send, daemon=True).start()
    return connection


def status_line(connection: socket.socket) -> bytes:
    """The first line of the next whole answer on `connection` (its header, then Content-Length bytes of body)."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += connection.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += connection.recv(65536)
    return head.split(b"\r\n")[0]


def closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the server closes `connection` within `seconds` (it reads end of stream, or a reset)."""
    connection.settimeout(seconds)
    try:
        while connection.recv(4096):
            continue
    except TimeoutError:
        return False
    except OSError:  # reset
        return True
    return True


def a_study_through(base: str, tmp_path: Path) -> float:
    """Seconds that one echo agent takes through a 2-round study of the tiny model (it downloads and uploads)."""
    with httpx.Client(base_url=base, headers=ADMIN, timeout=60) as admin:
        token = admin.post("/api/v1/sites", json={"name": "lyon"}).json()["token"]["token"]
        config = {"model": {"preset": "tiny", "heads": "6:2"}, "sites": ["lyon"], "rounds": 2}
        study = admin.post("/api/v1/studies", json={"name": "beside-slow-clients", "config": config}).json()["id"]
        agent = [
            sys.executable,
            str(ECHO_AGENT),
            "--url",
            base,
            "--token",
            token,
            "--log",
            str(tmp_path / "agent.json"),
        ]
        started = time.monotonic()
        with subprocess.Popen(agent, cwd=ECHO_AGENT.parent) as process:
            while set(admin.get(f"/api/v1/studies/{study}").json()["approvals"].values()) != {"approved"}:
                assert process.poll() is None and time.monotonic() - started < 120
                time.sleep(0.2)
            assert admin.post(f"/api/v1/studies/{study}/start").status_code == 200
            assert process.wait(timeout=120) == 0
        assert admin.get(f"/api/v1/studies/{study}").json()["status"] == "completed"
        return time.monotonic() - started


def test_idle_and_slow_clients_hold_up_neither_the_status_nor_a_sites_uploads(tmp_path: Path) -> None:
    stop = threading.Event()
    with serving(tmp_path, header_timeout=300) as (base, port), ExitStack() as held:
        idle = [held.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(IDLE_CONNECTIONS)]
        header = b"GET /api/v1/status HTTP/1.1\r\nHost: coordinator\r\nX-Slow: " + b"x" * 1000
        slow_header = held.enter_context(dribble(port, header, stop))
        body = b'{"name": "' + b"s" * 1000 + b'"}'
        start = f"POST /api/v1/sites HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n"
        start += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        slow_body = held.enter_context(dribble(port, body, stop, first=start.encode()))  # the header whole
        held.enter_context(dribble(port, b"", stop))  # (a connection that sends nothing at all)
        try:
            for _ in range(3):
                began = time.monotonic()
                assert httpx.get(f"{base}/api/v1/status", headers=ADMIN, timeout=30).status_code == 200
                assert time.monotonic() - began < PROMPT_S
                time.sleep(0.5)
            study_s = a_study_through(base, tmp_path)  # a site registers, approves, downloads and uploads twice
            began = time.monotonic()
            assert httpx.get(f"{base}/api/v1/status", headers=ADMIN, timeout=30).status_code == 200
            assert time.monotonic() - began < PROMPT_S
            # The slow ones are still connected (the deadline is 300 s here): they were there all along.
            assert not closed_within(slow_header, 0.1) and not closed_within(slow_body, 0.1)
            assert not closed_within(idle[0], 0.1)
        finally:
            stop.set()
    assert study_s < 60


@pytest.mark.parametrize("deadline", [2.0])
def test_a_late_header_is_cut_at_the_deadline_and_a_kept_alive_connection_is_not(
    tmp_path: Path, deadline: float
) -> None:
    stop = threading.Event()
    with serving(tmp_path, header_timeout=deadline) as (base, port), ExitStack() as held:
        began = time.monotonic()
        idle = held.enter_context(socket.create_connection(("127.0.0.1", port)))
        slow = held.enter_context(dribble(port, b"GET /api/v1/health HTTP/1.1\r\nHost: c\r\n" * 10, stop, 0.2))
        kept = held.enter_context(socket.create_connection(("127.0.0.1", port)))
        request = b"GET /api/v1/health HTTP/1.1\r\nHost: c\r\n\r\n"
        kept.sendall(request)
        assert status_line(kept) == b"HTTP/1.1 200 OK"
        try:
            assert closed_within(idle, deadline + 3) and closed_within(slow, 3)
            assert deadline - 0.5 < time.monotonic() - began < deadline + 4
            # A connection idle after its answer is the keep-alive timeout's (65 s), not the header deadline's:
            kept.sendall(request)
            assert status_line(kept) == b"HTTP/1.1 200 OK"
            # ... and the next request's header, once begun, has the deadline again.
            kept.sendall(b"GET /api/v1/health HTTP/1.1\r\n")
            assert closed_within(kept, deadline + 3)
        finally:
            stop.set()
        assert httpx.get(f"{base}/api/v1/health", timeout=10).status_code == 200
