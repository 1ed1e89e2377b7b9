"""The coordinator's server process: how much of a request body it reads ahead of the app."""

import subprocess
import sys

import pytest
from uvicorn.protocols.http import flow_control, h11_impl, httptools_impl

from coordinator.serving.process import RECEIVE_BUFFER_BYTES, widen_receive_buffer


@pytest.fixture
def protocols(monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The two HTTP protocols of uvicorn, their receive limits restored after the test."""
    for protocol in (h11_impl, httptools_impl):
        monkeypatch.setattr(protocol, "HIGH_WATER_LIMIT", protocol.HIGH_WATER_LIMIT)
    return h11_impl, httptools_impl


def test_both_protocols_read_megabytes_of_a_body_ahead_not_uvicorns_64_kib(protocols: tuple) -> None:
    assert flow_control.HIGH_WATER_LIMIT == 64 * 1024  # uvicorn's own, which a model upload outruns
    widen_receive_buffer(RECEIVE_BUFFER_BYTES)
    assert [protocol.HIGH_WATER_LIMIT for protocol in protocols] == [RECEIVE_BUFFER_BYTES] * 2
    assert RECEIVE_BUFFER_BYTES >= 1 << 20


def test_a_uvicorn_that_no_longer_reads_the_limit_is_said_not_ignored(
    protocols: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(httptools_impl, "HIGH_WATER_LIMIT")
    with pytest.raises(RuntimeError, match="httptools_impl no longer reads HIGH_WATER_LIMIT"):
        widen_receive_buffer(RECEIVE_BUFFER_BYTES)


RELEASE_SCRIPT = """
import sys
from coordinator.serving.process import bound_heap_growth, release_free_heap

def rss_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

if sys.argv[1] == "served":
    assert bound_heap_growth()
blocks = [bytearray(512 * 1024) for _ in range(96)]  # 48 MiB in blocks under the mmap threshold: on the heap
for block in blocks:
    block[::4096] = b"x" * len(block[::4096])  # touched: resident
held = rss_mib()
del blocks, block
freed = rss_mib()
released = release_free_heap()
print(held, freed, rss_mib(), released)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc and /proc are Linux's")
def test_a_served_process_hands_the_heap_a_round_freed_back_to_the_system() -> None:
    def run(mode: str) -> tuple[float, float, float, bool]:
        done = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT, mode], capture_output=True, text=True, check=True)
        held, freed, after, released = done.stdout.split()
        return float(held), float(freed), float(after), released == "True"

    held, freed, after, released = run("served")
    assert released and freed > held - 8  # kept: under the 64 MiB trim threshold a served process keeps
    assert after < freed - 40  # handed back, not kept until the heap tops 64 MiB of free blocks
    assert run("library")[3] is False  # a process that keeps malloc's defaults is left as it is
