"""`cardiofl site health`: by default three polls old at most; the agent beats while it trains or backs off."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from typer.testing import CliRunner

from cardiofl.cli import app
from site_agent.config import health_limit, load_settings
from site_agent.loop import Heartbeat
from site_agent.worker import SiteWorker
from tests.site_agent.test_config import write_config

runner = CliRunner()


def health(config: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["site", "health", "--config", str(config), *args])
    return result.exit_code, result.output


def test_the_default_limit_is_three_polls_of_the_settings(tmp_path: Path) -> None:
    heartbeat = tmp_path / "heartbeat"
    config = write_config(tmp_path, heartbeat_file=f'"{heartbeat}"', poll_wait_s="20", poll_interval_s="5")
    assert health_limit(load_settings(config)) == 75.0
    heartbeat.write_text(f"{time.time() - 60:.0f}\n")
    code, output = health(config)
    assert code == 0 and output in ("ok: last poll 60s ago\n", "ok: last poll 61s ago\n")
    heartbeat.write_text(f"{time.time() - 300:.0f}\n")  # an agent stopped five minutes ago
    code, output = health(config)
    assert code == 1 and re.search(r"last poll 30[01]s ago \(more than 75s\)", output), output
    assert health(config, "--max-age", "600")[0] == 0  # asked for explicitly


def test_the_default_limit_is_never_under_30_seconds(tmp_path: Path) -> None:
    heartbeat = tmp_path / "heartbeat"
    config = write_config(tmp_path, heartbeat_file=f'"{heartbeat}"', poll_wait_s="1", poll_interval_s="1")
    assert health_limit(load_settings(config)) == 30.0
    heartbeat.write_text(f"{time.time() - 20:.0f}\n")
    assert health(config)[0] == 0
    heartbeat.write_text(f"{time.time() - 40:.0f}\n")
    assert health(config)[0] == 1


def test_the_agent_beats_while_it_backs_off(tmp_path: Path) -> None:
    path = tmp_path / "beat" / "heartbeat"
    beats = Heartbeat(path, every_s=0.05)
    started = time.monotonic()
    beats.rest(threading.Event(), 0.3)
    assert time.monotonic() - started >= 0.3
    assert abs(float(path.read_text()) - time.time()) <= 1.0
    stop = threading.Event()
    stop.set()
    path.unlink()
    beats.rest(stop, 10.0)  # a stop request ends the wait at once, unbeaten
    assert not path.exists()


def test_the_agent_beats_while_a_task_trains_and_only_then(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    worker = SimpleNamespace(busy=False)
    done = threading.Event()
    thread = Heartbeat(path, every_s=0.02).while_busy(cast(SiteWorker, worker), done)
    time.sleep(0.15)
    assert not path.exists()  # idle between polls: only the polls beat
    worker.busy = True
    deadline = time.monotonic() + 5
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists()
    done.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
