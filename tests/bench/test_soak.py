"""bench/soak.py at a tiny size (a sample per round, its lines, the checks failing on a leak); scale.py on mTLS."""

import json
import re
from pathlib import Path

import pytest

from tests.bench.test_benchmarks import load_bench, run_bench


def test_soak_benchmark_samples_every_round_and_prints_the_slope(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # 4 rounds say nothing of a slope or of descriptors (the pool and sockets still come and go):
    # those limits are lifted here (`make soak`, which CI runs, holds them); the sizes, the process and
    # the output are checked as there.
    stdout = run_bench(
        "soak", "--rounds", "4", "--warmup", "1", "--max-slope-mb", "1000", "--max-fd-growth", "1000",
        "--workdir", str(tmp_path / "w"), "--out", str(out),
    )  # fmt: skip
    assert re.search(r"^coordinator RSS slope: -?\d+\.\d{3} MB per 100 rounds$", stdout, re.M), stdout
    assert re.search(r"^open fds: first \d+, last \d+, most \d+$", stdout, re.M), stdout
    assert "database size: first" in stdout and "blob directory: most" in stdout and "FAILED" not in stdout
    results = json.loads(out.read_text())
    assert results["failures"] == [] and results["rounds"] == 4 and results["sites"] == 4
    assert [entry["round"] for entry in results["samples"]] == list(range(5))  # round 0: the study's start
    for entry in results["samples"]:
        assert entry["rss"] > 0 and entry["fds"] > entry["db_handles"] > 0 and entry["db_bytes"] > 0
    figures = results["figures"]
    assert figures["db_bytes_last"] >= figures["db_bytes_first"] and figures["s_per_100_rounds"] > 0
    assert figures["blob_bytes_max"] <= figures["blob_allowed_bytes"]


def test_soak_fails_on_a_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    soak = load_bench("soak", monkeypatch)
    args = soak.parse_args(["--rounds", "100"])
    assert args.warmup == 16  # a sixth

    def samples(rss_per_round: int, fds_per_round: float, db_per_round: int = 150_000) -> list[dict]:
        return [
            {"round": r, "t_s": r * 0.2, "rss": (500 << 20) + r * rss_per_round, "fds": 40 + int(r * fds_per_round),
             "db_handles": 15, "db_bytes": (2 << 20) + r * db_per_round, "wal_bytes": 0, "blob_bytes": 500_000}
            for r in range(101)
        ]  # fmt: skip

    assert soak.judge(samples(0, 0), args, 121_000)["failures"] == []
    leaking = soak.judge(samples(12_000, 0.2), args, 121_000)  # 1.1 MB per 100 rounds, a descriptor every 5
    assert [failure.split()[0] for failure in leaking["failures"]] == ["RSS", "open"]
    assert 1.0 < leaking["figures"]["rss_slope_mb_per_100_rounds"] < 1.2
    growing = soak.judge(samples(0, 0, 500_000), args, 121_000)  # more than a model and its rows per round
    assert [failure.split()[1] for failure in growing["failures"]] == ["database"]
