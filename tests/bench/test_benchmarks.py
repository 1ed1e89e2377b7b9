"""Each benchmark runs at a tiny size, prints its ratio line and writes valid JSON; no timing is asserted."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(name: str, *args: str) -> str:
    """Stdout of `bench/<name>.py args` run as its own process (as from the README)."""
    done = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def load_bench(name: str, monkeypatch: pytest.MonkeyPatch):
    """bench/<name>.py as a module, with its sibling benchlib importable."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_aggregation_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "aggregation.json"
    stdout = run_bench(
        "aggregation", "--presets", "tiny", "--sites", "2,3", "--repeats", "2", "--copy-mib", "16",
        "--workdir", str(tmp_path / "w"), "--out", str(out),
    )  # fmt: skip
    assert "ratio aggregation read / memory copy:" in stdout and "target >= 0.5" in stdout
    results = json.loads(out.read_text())
    assert results["copy_gb_s"] > 0
    assert [(row["preset"], row["sites"]) for row in results["rows"]] == [("tiny", 2), ("tiny", 3)]
    for row in results["rows"]:
        assert row["ratio_to_copy"] > 0 and row["rss_peak_mb"] >= row["rss_baseline_mb"] > 0
        # the best pass is at least as fast as the median and the cold first pass of the process
        best = row["ratio_to_copy"]
        assert best >= row["median_ratio_to_copy"] > 0 and best >= row["cold_ratio_to_copy"] > 0
        assert row["result_s"] > 0
    assert list((tmp_path / "w").glob("*.db")) == []  # each K's database is removed after it is measured


@pytest.mark.postgres
def test_aggregation_benchmark_on_postgresql(tmp_path: Path) -> None:
    from sqlalchemy import create_engine, text

    from tests.coordinator.conftest import POSTGRES_URL, _postgres_problem

    problem = _postgres_problem()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL is unreachable ({problem}); CI must run the PostgreSQL tests")
        pytest.skip(f"PostgreSQL is unreachable ({problem})")
    out = tmp_path / "aggregation.json"
    stdout = run_bench(
        "aggregation", "--database", POSTGRES_URL, "--presets", "tiny", "--sites", "2", "--repeats", "1",
        "--copy-mib", "16", "--out", str(out),
    )  # fmt: skip
    assert stdout.startswith("database: postgresql;")
    results = json.loads(out.read_text())
    assert results["database"] == "postgresql" and [row["sites"] for row in results["rows"]] == [2]
    assert results["rows"][0]["ratio_to_copy"] > 0
    engine = create_engine(POSTGRES_URL)
    with engine.connect() as connection:  # the benchmark's schema is dropped afterwards
        left = connection.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'bench_aggregation_%'"))
        assert left.scalar() == 0
    engine.dispose()


def test_round_overhead_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "round_overhead.json"
    stdout = run_bench(
        "round_overhead", "--preset", "tiny", "--sites", "2", "--rounds", "2",
        "--workdir", str(tmp_path / "w"), "--out", str(out),
    )  # fmt: skip
    assert "ratio wire / must move:" in stdout and "ratio round time ours / Flower:" in stdout
    results = json.loads(out.read_text())
    ours = [row for row in results["rows"] if row["system"] == "cardiofl"]
    assert [row["sites"] for row in ours] == [2] and len(ours[0]["round_s"]) == 2
    # Two sites download and upload theta^g each round: at least what must move went over the wire.
    assert ours[0]["wire_bytes_per_round"] >= ours[0]["must_move_bytes_per_round"] == 4 * results["model_bytes"]
    assert ours[0]["server_peak_rss"] > 0
    if importlib.util.find_spec("flwr") is None:
        assert results["flower_skipped"].startswith("flwr is not installed")
        assert "Flower half skipped: flwr is not installed" in stdout
    else:
        flower = [row for row in results["rows"] if row["system"] == "flower"]
        assert results["flower_skipped"] is None and [row["sites"] for row in flower] == [2]
        assert len(flower[0]["round_s"]) == 2 and ours[0]["time_over_flower"] > 0


def test_serving_benchmark_moves_every_byte_and_says_what_it_skipped(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    stdout = run_bench("serving", "--megabytes", "3", "--sites", "2", "--repeats", "1", "--out", str(out))
    results = json.loads(out.read_text())
    ways = [row["way"] for row in results["rows"]]
    assert ways[0] == "uvicorn views" and set(ways) | set(results["skipped"]) == {
        "uvicorn views", "granian path-send", "nginx X-Accel-Redirect",
    }  # fmt: skip
    if importlib.util.find_spec("granian") is None:
        assert results["skipped"]["granian path-send"].startswith("granian is not installed")
    # Every transfer moved exactly the body's bytes (the benchmark stops otherwise); the work on them was timed.
    assert set(results["byte_work"]) == {"sha256", "spool", "database"}
    assert all(seconds > 0 for seconds in results["byte_work"].values())
    assert results["round_floor_cpu_s"] >= 2 * results["byte_work"]["spool"] + results["byte_work"]["database"]
    assert (
        "ratio server CPU per site and round (a model sent, one received), best other over uvicorn views:"
        in (stdout.strip().splitlines()[-1])
    )


def test_digest_benchmark_times_sha256_beside_blake3_and_a_rounds_share(tmp_path: Path) -> None:
    out = tmp_path / "digest.json"
    stdout = run_bench("digest", "--sizes", "1,2", "--repeats", "1", "--sites", "4", "--out", str(out))
    results = json.loads(out.read_text())
    names = ["sha256"] if results["skipped"] else ["sha256", "blake3 1 thread", "blake3 all cores"]
    assert [(row["size"], row["digest"]) for row in results["rows"]] == [(s, n) for s in ("1", "2") for n in names]
    for row in results["rows"]:
        assert row["bytes"] == int(row["size"]) * 1_000_000 and row["wall_s"] > 0 and row["gb_per_s"] > 0
    assert [share["digest"] for share in results["round"]] == names
    assert all(share["bytes_per_round"] == 5_000_000 for share in results["round"])
    sha = results["round"][0]
    assert sha["share_of_round_cpu"] == pytest.approx(sha["cpu_s_per_round"] / 1.65)
    lines = stdout.strip().splitlines()
    assert lines[-2].startswith("size 1: ratio sha256 over blake3: ")
    assert lines[-1].startswith("size 2: ratio sha256 over blake3: ")


def test_digest_benchmark_says_when_blake3_is_absent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    digest = load_bench("digest", monkeypatch)
    monkeypatch.setattr(digest.importlib.util, "find_spec", lambda name: None)
    results = digest.main(["--sizes", "1", "--repeats", "1", "--out", str(tmp_path / "digest.json")])
    assert [row["digest"] for row in results["rows"]] == ["sha256"] and set(results["skipped"]) == {
        "blake3 1 thread", "blake3 all cores",
    }  # fmt: skip
    printed = capsys.readouterr().out
    assert "blake3 1 thread: skipped: the blake3 package is not installed" in printed
    assert printed.strip().splitlines()[-1] == "size 1: ratio sha256 over blake3: n/a (blake3 not installed)"


def test_secure_round_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    problem = load_bench("secure_round", monkeypatch).secure_missing()
    if problem is not None:
        pytest.skip(f"cardiofl's secure rounds cannot run from this tree: {problem}")
    out = tmp_path / "secure_round.json"
    stdout = run_bench(
        "secure_round", "--preset", "tiny", "--sites", "3", "--rounds", "2", "--no-flower",
        "--workdir", str(tmp_path / "w"), "--out", str(out),
    )  # fmt: skip
    assert "ratio secure / plain round:" in stdout and "target <= 2.0" in stdout
    assert "ratio secure round ours / Flower SecAgg+: n/a (Flower skipped)" in stdout
    results = json.loads(out.read_text())
    assert results["secure_skipped"] is None and results["flower_skipped"] == "--no-flower given"
    rows = {(row["system"], row["mode"]): row for row in results["rows"]}
    assert set(rows) == {("cardiofl", "plain"), ("cardiofl", "secure")}, results["failed"]
    plain, secure = rows["cardiofl", "plain"], rows["cardiofl", "secure"]
    # K = 3: both others are neighbours, t = 2; Flower's num_shares counts the client itself
    assert (secure["neighbours"], secure["threshold"], secure["flower_num_shares"]) == (2, 2, 3)
    assert len(secure["round_s"]) == len(plain["round_s"]) == 2 and secure["secure_over_plain"] > 0
    # each phase of a timed secure round, as one site saw it: its own moves in order, every cost measured
    assert list(secure["phases"]) == ["advertise", "share", "masked upload", "consistency", "reveal", "result"]
    assert all(cost["wall_s"] > 0 and cost["cpu_s"] >= 0 for cost in secure["phases"].values())
    assert "phases" not in plain and "K=3 secure phases, wall s / CPU s of one site since its previous move:" in stdout
    # the masked upload is one 8-byte ring word per parameter, beside the same download
    assert secure["wire_bytes_per_round"] > plain["wire_bytes_per_round"] >= plain["must_move_bytes_per_round"]


def test_secure_round_parameters_and_why_flower_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("secure_round", monkeypatch)
    assert bench.secure_parameters(4) == {"neighbours": 3, "threshold": 3, "flower_num_shares": 4}
    # a complete graph up to 100 sites, a sparse one above; t = (k + m) // 2 + 1 (m = c in a complete graph,
    # 64 of the 66 colluders among a site's 128 neighbours at K = 200)
    assert bench.secure_parameters(16) == {"neighbours": 15, "threshold": 11, "flower_num_shares": 16}
    assert bench.secure_parameters(200) == {"neighbours": 128, "threshold": 97, "flower_num_shares": 129}
    assert bench.flower_missing(tmp_path) == (
        f"flower-superlink, flower-supernode, flwr, flwr-serverapp, flwr-clientapp not in {tmp_path}"
    )
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        bench.importlib.util, "find_spec", lambda name, *a: None if name == "flwr" else real_find_spec(name, *a)
    )
    assert bench.flower_missing(None).startswith("flwr is not installed (pip install -e '.[bench]', or --flower-bin")


@pytest.mark.slow
def test_flower_secaggplus_echo_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("secure_round", monkeypatch)
    problem = bench.flower_missing(None)
    if problem is not None:
        pytest.skip(f"Flower is not installed beside this interpreter: {problem}")
    arrays = tmp_path / "theta.safetensors"
    arrays.write_bytes(bench.preset_state("tiny"))
    args = bench.parse_args(["--preset", "tiny", "--flower-rounds", "2", "--timeout", "600"])
    args.rounds = args.flower_rounds
    settings = "secure=true num-shares=3 reconstruction-threshold=2"
    row = bench.run_flower(3, args, tmp_path / "flower", arrays, run_config=settings)
    assert len(row["round_s"]) == 2 and row["s_per_round"] > 0
    # the echoed arrays come back through SecAgg+'s quantisation (2^22 levels over [-8, 8]) unchanged
    assert 0 < row["max_abs_error"] < 1e-3


def test_training_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    bench = load_bench("training", monkeypatch)
    out = tmp_path / "training.json"
    results = bench.main(
        ["--presets", "tiny", "--records", "12", "--batch-size", "4", "--steps", "2", "--repeats", "1",
         "--device", "cpu", "--workdir", str(tmp_path / "w"), "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (row,) = results["rows"]
    assert row["preset"] == "tiny" and row["steps"] == 2 and row["batch_size"] == 4
    assert row["bare_samples_per_s"] > 0 and row["loop_samples_per_s"] > 0
    assert "ratio training loop overhead over bare forward/backward:" in capsys.readouterr().out


def test_dp_noise_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    bench = load_bench("dp_noise", monkeypatch)
    out = tmp_path / "dp_noise.json"
    results = bench.main(["--presets", "tiny", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (row,) = results["rows"]
    assert row["preset"] == "tiny" and row["values"] > 1000 and row["discrete_s"] > 0 and row["normal_s"] > 0
    assert row["sigma_steps"] == round(1.0 * (0.1 * 2**24 + (math.isqrt(row["values"] - 1) + 1) / 2))
    assert "ratio exact discrete noise over float normal (tiny):" in capsys.readouterr().out


def test_cli_startup_benchmark_times_each_command_beside_import_torch(tmp_path: Path) -> None:
    out = tmp_path / "cli_startup.json"
    stdout = run_bench("cli_startup", "--runs", "1", "--out", str(out))
    assert "ratio cardiofl --version over import torch:" in stdout and "target < 0.5 s" in stdout
    results = json.loads(out.read_text())
    assert [row["command"] for row in results["rows"]] == [
        "cardiofl --version", "cardiofl --help", "cardiofl study list --help", "cardiofl site list --help",
        "cardiofl study list", "cardiofl study show 1", "cardiofl study watch 1", "cardiofl site list",
        'python -c "import torch"', 'python -c "pass"',
    ]  # fmt: skip
    for row in results["rows"]:
        assert len(row["runs_s"]) == 1 and row["p90_s"] >= row["median_s"] > 0 and row["over_import_torch"] > 0
    assert results["version_median_s"] == results["rows"][0]["median_s"] and results["target_version_s"] == 0.5
    reads = results["rows"][4:8]
    assert results["slowest_read_median_s"] == max(row["median_s"] for row in reads)
    assert "slowest read command: cardiofl " in stdout


def test_summary_table_joins_the_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    run_all = load_bench("run_all", monkeypatch)

    def peak(value: float) -> dict[str, float]:
        return {"server_peak_rss": value}

    examples = {
        "data_loading": {"ratio_reparse_over_cache": 31.5},
        "aggregation": {
            "rows": [
                {"preset": "paper", "sites": k, "ratio_to_copy": r, "rss_peak_mb": 700.0, "model_mb": 93.9}
                for k, r in ((4, 0.9), (16, 0.8))
            ]
        },
        "round_overhead": {
            "model_bytes": 93_900_000,
            "flower_skipped": None,
            "rows": [
                {"system": "cardiofl", "sites": 4, "time_over_flower": 0.05, "wire_over_must_move": 1.0, **peak(9e8)},
                {"system": "flower", "sites": 4},
                {"system": "cardiofl", "sites": 8, "time_over_flower": 0.12, "wire_over_must_move": 1.0, **peak(2e9)},
            ],
        },
        "serving": {
            "rows": [{"way": "uvicorn views", "site_round_vs_views": 1.0},
                     {"way": "granian path-send", "site_round_vs_views": 1.19}],
            "skipped": {"nginx X-Accel-Redirect": "nginx is not installed"},
        },
        "secure_round": {
            "secure_skipped": None,
            "flower_skipped": None,
            "rows": [
                {"system": "cardiofl", "mode": "plain", "sites": 4},
                {"system": "cardiofl", "mode": "secure", "sites": 4, "secure_over_plain": 1.6,
                 "secure_over_flower_secure": 0.05},
                {"system": "cardiofl", "mode": "secure", "sites": 16, "secure_over_plain": 2.4,
                 "secure_over_flower_secure": 0.6},
            ],
        },
        "scale": {
            "rows": [
                {"database": "sqlite", "sites": 8, "cpu_s_per_site": 0.05, "errors": 0, "status_p99_s": 0.1},
                {"database": "sqlite", "sites": 128, "cpu_s_per_site": 0.06, "errors": 0, "status_p99_s": 0.9},
                {"database": "postgresql", "sites": 128, "cpu_s_per_site": 0.2, "errors": 2, "status_p99_s": 1.2},
                {"database": "postgresql", "sites": 8, "cpu_s_per_site": 0.1, "errors": 0, "status_p99_s": 0.1},
            ]
        },
        "training": {"rows": [{"preset": "small", "device": "cpu (CPU, fp32)", "overhead_percent": 3.2}]},
        "dp_noise": {"rows": [{"preset": "paper", "discrete_per_normal": 9.1}]},
        "cli_startup": {"version_median_s": 0.31, "target_version_s": 0.5},
        "ray_grid": {"grid": {"runs": 8, "ratio": 1.04},
                     "sites": {"sites": 4, "speedup": 1.9, "theta_identical": False}},
    }  # fmt: skip
    for name, result in examples.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    rows = run_all.main(["--table-only", "--results", str(tmp_path)])
    verdicts = {row["figure"]: row["met"] for row in rows}
    assert verdicts == {
        "cache epoch vs WFDB re-parse": "yes",
        "paper, K=4/16: read / memory copy": "yes",
        "paper: peak RSS over K": "yes",
        "K=4: s/round ours / Flower": "yes",
        "K=4: wire / bytes that must move": "yes",
        "K=8: s/round ours / Flower": "NO",
        "K=8: wire / bytes that must move": "yes",
        "coordinator peak RSS over K": "NO",  # 900 MB at K=4 but 2000 MB at K=8
        "granian path-send / uvicorn views: server CPU per model sent + received": "",  # a choice, no target
        "nginx X-Accel-Redirect": "",  # skipped, with the reason
        "K=4: s/round secure / plain": "yes",
        "K=4: secure s/round ours / Flower SecAgg+": "yes",
        "K=16: s/round secure / plain": "NO",
        "K=16: secure s/round ours / Flower SecAgg+": "NO",
        "sqlite, K=128 over K=8: CPU per site": "yes",  # 1.2x
        "sqlite, K=8/128: errors": "yes",
        "sqlite, K=128: GET /status p99": "yes",
        "postgresql, K=128 over K=8: CPU per site": "NO",  # 2.0x
        "postgresql, K=8/128: errors": "NO",
        "postgresql, K=128: GET /status p99": "NO",
        "small (cpu (CPU, fp32)): loop over bare fwd/bwd": "yes",
        "paper: exact discrete / float normal": "",  # no target: the price of exact noise, shown
        "cardiofl --version, median wall": "yes",
        "8-run grid: Ray / local --jobs 2": "yes",
        "K=4: round, sites as tasks vs in turn": "NO",  # fast, but theta^g was not the sequential runner's
    }
    assert "=== summary" in capsys.readouterr().out


def test_round_overhead_says_why_flower_is_skipped_when_flwr_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("round_overhead", monkeypatch)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        bench.importlib.util, "find_spec", lambda name, *a: None if name == "flwr" else real_find_spec(name, *a)
    )
    assert bench.flower_missing() == "flwr is not installed (pip install -e '.[bench]')"


def test_gpu_benchmark_runs_on_the_cpu_without_an_mfu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    stdout = run_bench(
        "gpu", "--preset", "tiny", "--batch-size", "4", "--steps", "2", "--repeats", "1", "--records", "40",
        "--demo-sites", "0", "--workdir", str(tmp_path / "w"), "--out", str(out),
    )  # fmt: skip
    assert "ratio training loop overhead over bare forward/backward:" in stdout and "target <= 5%" in stdout
    assert "ratio model FLOP utilisation: n/a" in stdout
    results = json.loads(out.read_text())
    assert results["device"].startswith("cpu") and results["mfu"] is None and results["demo_round"] is None
    assert results["loop_samples_per_s"] > 0 and results["bare_samples_per_s"] > 0
    # FlopCounterMode's count of the tiny preset, forward and backward: positive and per sample
    assert 0.001 < results["train_gflop_per_sample"] < 1.0


def test_gpu_benchmark_knows_the_bf16_peak_and_reads_the_agents_device(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = load_bench("gpu", monkeypatch)
    line = "INFO study 1 round 1: training on cuda:0 (NVIDIA H200, torch.bfloat16 autocast) (load factor 1.00)"
    assert gpu.trained_on(line) == ["cuda:0 (NVIDIA H200, torch.bfloat16 autocast)"]
    cpu = gpu.resolve_runtime("cpu")
    assert gpu.peak_tflops(cpu, None) is None and gpu.peak_tflops(cpu, 123.0) == 123.0
    assert dict(gpu.BF16_PEAK_TFLOPS)["H200"] == 989.4


def test_scale_benchmark_speaks_the_protocol_over_mutual_tls_and_ends_with_the_growth_line(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    stdout = run_bench(
        "scale", "--sites", "2,3", "--preset", "tiny", "--rounds", "2", "--databases", "sqlite", "--mutual-tls",
        "--poll-wait", "2", "--workdir", str(tmp_path / "w"), "--out", str(out),
    )  # fmt: skip
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"per-site CPU growth: \d+\.\d\dx", last), last
    results = json.loads(out.read_text())
    assert [(row["database"], row["sites"]) for row in results["rows"]] == [("sqlite", 2), ("sqlite", 3)]
    for row in results["rows"]:
        assert row["errors"] == 0, row["error_examples"]
        assert row["mutual_tls"] is True and row["completed"]
        assert (tmp_path / "w" / f"sqlite-{row['sites']}" / "client" / "client.pem").exists()  # every client shows it
        assert len(row["round_s"]) == 1 and row["cpu_s_per_site"] > 0  # round 2 timed, round 1 a warm-up
        assert row["poll_p99_s"] >= row["poll_p50_s"] > 0 and row["upload_p50_s"] > 0 and row["download_p50_s"] > 0
        assert row["status_p99_s"] is not None and "db_rows_per_site" not in row  # counted on PostgreSQL only
    ratio = results["rows"][1]["cpu_s_per_site"] / results["rows"][0]["cpu_s_per_site"]
    assert last == f"per-site CPU growth: {ratio:.2f}x"


def test_scale_percentiles_and_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("scale", monkeypatch)
    assert bench.percentile([], 99) is None
    assert bench.percentile([3.0, 1.0, 2.0], 50) == 2.0 and bench.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    rows = [
        {"database": "sqlite", "sites": 8, "cpu_s_per_site": 0.1},
        {"database": "sqlite", "sites": 128, "cpu_s_per_site": 0.12},
        {"database": "postgresql", "sites": 128, "cpu_s_per_site": 0.3},
        {"database": "postgresql", "sites": 8, "cpu_s_per_site": 0.2},
    ]
    assert bench.growth(rows) == pytest.approx(1.5)  # the worse of the two databases
    assert bench.growth(rows[:1]) is None
