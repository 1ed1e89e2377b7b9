"""The demo's children end with the demo, even when it is killed with SIGKILL (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PARENT = """
import sys, time
from pathlib import Path
from cardiofl.demo import Processes
logs = Path(sys.argv[1])
child = Processes().start("child", [sys.executable, "-c", "import time; time.sleep(120)"], {}, logs / "child.log")
(logs / "child.pid").write_text(str(child.pid))
time.sleep(120)
"""


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def started_child(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A parent that started one child through the demo's Processes, and that child's pid."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 60
    while not (tmp_path / "child.pid").exists():
        assert time.monotonic() < deadline and parent.poll() is None, "the parent did not start its child"
        time.sleep(0.1)
    return parent, int((tmp_path / "child.pid").read_text())


def test_a_child_of_the_demo_ends_when_the_demo_is_killed(tmp_path: Path) -> None:
    parent, child = started_child(tmp_path)
    assert running(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 15
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = running(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the child outlived the killed demo"


def test_a_child_keeps_its_own_session(tmp_path: Path) -> None:
    parent, child = started_child(tmp_path)
    try:
        assert os.getsid(child) == child != os.getsid(parent.pid)  # Ctrl-C at the terminal reaches the demo alone
    finally:
        os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
