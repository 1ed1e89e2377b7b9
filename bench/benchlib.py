"""What the benchmarks share: the copy-bandwidth baseline, memory readings, a coordinator study to load, output."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
T = TypeVar("T")


def in_workdir(workdir: Path | None, run: Callable[[Path], T]) -> T:
    """`run(folder)` in `workdir` (created when missing), or in a temporary folder removed afterwards."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        return run(workdir)
    with tempfile.TemporaryDirectory() as tmp:
        return run(Path(tmp))


def timings(function: Callable[[], object], repeats: int) -> list[float]:
    """Wall time of each of `repeats` runs of `function()`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return times


def median_time(function: Callable[[], object], repeats: int) -> float:
    """Median wall time of `function()` over `repeats` runs."""
    return statistics.median(timings(function, repeats))


def best_time(function: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of `function()` over `repeats` runs (interference on a shared machine only adds)."""
    return min(timings(function, repeats))


def copy_bandwidth(nbytes: int = 512 * MIB, repeats: int = 5) -> float:
    """Bytes per second that one numpy copy moves between two buffers far larger than the CPU caches.

    Both buffers are touched first, so the timing sees memory traffic, not page faults; the best of
    `repeats` copies counts, as for the figures compared with it.
    """
    import numpy as np

    source = np.ones(nbytes, dtype=np.uint8)
    target = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(target, source)
    return nbytes / best_time(lambda: np.copyto(target, source), repeats)


def memory_of(pid: int | str = "self") -> dict[str, int]:
    """Resident memory of a process in bytes: now (`rss`) and its peak so far (`peak`, VmHWM)."""
    fields = {"VmRSS": "rss", "VmHWM": "peak"}
    found: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            found[fields[key]] = int(value.split()[0]) * 1024
    return found


def cpu_seconds(pid: int | str = "self") -> float:
    """User plus system CPU time a process has used so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree_peak(pid: int) -> int:
    """Sum of the peak resident memory of `pid` and of its live descendants, in bytes (0 once gone)."""
    total = 0
    for member in [pid, *descendants(pid)]:
        try:
            total += memory_of(member)["peak"]
        except (OSError, KeyError):
            continue
    return total


def descendants(pid: int) -> list[int]:
    """Live descendants of `pid` (children, grandchildren ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment holds `name=value` (those whose /proc/PID/environ this user may read)."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environment = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if wanted in environment.split(b"\0"):
            found.append(int(entry))
    return found


def loopback_bytes() -> int:
    """Bytes sent over the loopback interface since boot (every local TCP byte, headers included)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmitted bytes
    return 0


def write_results(out: Path, results: dict[str, Any]) -> None:
    """Write the results as JSON and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    """Rows as an aligned text table; `columns` are (key, heading)."""
    cells = [[heading for _, heading in columns]]
    for row in rows:
        cells.append([_cell(row.get(key)) for key, _ in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for index, line in enumerate(cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "" if value is None else str(value)


def start_bench_study(sessions: Any, *, preset: str, sites: int, rounds: int, deadline_s: float = 3600.0) -> dict:
    """Enrol `sites` sites and start a study of `preset` over them, through the coordinator's own functions.

    Returns the study id, the first round's id, and each site's name, id and token.
    """
    from coordinator.db import utc_now
    from coordinator.models import Role, Round
    from coordinator.sites.access import enrol_site
    from coordinator.sites.security import Principal
    from coordinator.studies.lifecycle import create_study, start_study
    from shared.terms import ModelSpec, StudyTerms

    admin = Principal(Role.ADMIN, actor="bench")
    enrolled = []
    with sessions() as session:
        for index in range(sites):
            site, token, secret = enrol_site(session, name=f"site{index:03d}", by=admin)
            enrolled.append({"name": site.name, "site_id": site.id, "token_id": token.id, "token": secret})
        terms = StudyTerms(
            model=ModelSpec(preset=preset, heads="6:2"),
            sites=[site["name"] for site in enrolled],
            rounds=rounds,
            min_sites=sites,
            round_deadline_s=deadline_s,
        )
        study = create_study(session, name=f"bench-{preset}-{sites}", terms=terms, by=admin)
        start_study(session, study_id=study.id, by=admin, now=utc_now())
        round_id = session.query(Round.id).filter(Round.study_id == study.id, Round.number == 1).scalar()
    return {"study_id": study.id, "round_id": round_id, "sites": enrolled}


def echo_update(global_model: bytes, num_examples: int, round_: int = 1) -> bytes:
    """An update body that sends back the tensors of `global_model` with n_k = `num_examples`.

    The round goes into the metrics so that every round's upload is new bytes, as trained ones would
    be: the coordinator stores each distinct body once, and an echo of an earlier body costs nothing.
    """
    from shared.tensors.codec import tensor_views
    from shared.tensors.update_body import encode_update
    from shared.wire.protocol import UpdateMeta, UpdateMetrics

    metrics = UpdateMetrics(loss=0.5, echo_round=round_)
    meta = UpdateMeta(num_examples=num_examples, metrics=metrics, train_seconds=0.0)
    return encode_update(tensor_views(global_model), meta)
