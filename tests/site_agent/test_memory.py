"""A site agent keeps a round's model-sized buffers for the next round and hands them back when idle (memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Run in a process of its own: malloc's settings are the whole process's, and a test worker's must not change.
_MEASURE = """
import json, resource
from site_agent.memory import hand_back_idle_memory, keep_model_buffers

def faults_of(size):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(size)  # written whole (zero-filled), then freed
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

size = 94_000_000  # the paper model's theta^g
default = faults_of(size)
kept = keep_model_buffers()
faults_of(size)  # the heap grows to hold it
again = faults_of(size)
handed_back = hand_back_idle_memory()
after_hand_back = faults_of(size)
print(json.dumps(dict(default=default, kept=kept, again=again, handed_back=handed_back, after=after_hand_back)))
"""


def test_a_freed_model_buffer_is_reused_without_faulting_its_pages_in_again() -> None:
    measured = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, check=True)
    found = json.loads(measured.stdout)
    if not found["kept"]:
        pytest.skip("the C library is not glibc: malloc keeps its own thresholds")
    if found["default"] < 1_000:
        pytest.skip(f"a 94 MB block took only {found['default']} page faults (huge pages): nothing to save here")
    assert found["again"] < found["default"] / 20  # the block freed last round, reused: its pages stayed
    assert found["handed_back"] and found["after"] > found["default"] / 2  # idle: the pages went back
