"""`experiment run --backend ray`: the local backend's records from a real Ray cluster, a killed worker included."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.experiment.config import ExperimentConfig, load_experiment
from cardiofl.experiment.grid import Placement, finished_runs, run_experiment
from cardiofl.experiment.progress import GridTally
from cardiofl.experiment.ray_common import absolute_paths, ray_session, torch_threads
from cardiofl.experiment.ray_sites import RaySites
from cardiofl.experiment.runner import load_sites, simulate_study
from shared.terms import StudyTerms
from tests.bench.test_benchmarks import load_bench
from tests.cardiofl.experiment.test_runner import CPU, records_by_run, tiny_experiment

RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or RAY is None, reason='Ray is not installed (pip install "cardiofl[ray]")'
)


def test_paths_become_absolute_on_the_driver(tmp_path: Path) -> None:
    config = ExperimentConfig.model_validate(
        {
            "name": "paths",
            "cache_dir": "cache",
            "sites": [
                {"name": "a", "data": [{"kind": "challenge", "path": "data/a", "split_file": "/srv/split.csv"}]},
                {"name": "b", "data": [{"kind": "challenge", "path": str(tmp_path / "b")}]},
            ],
        }
    )
    moved = absolute_paths(config, base=tmp_path)
    assert moved.cache_dir == tmp_path / "cache"
    first, second = (site.data[0] for site in moved.sites)
    assert (first.path, first.split_file, second.path) == (tmp_path / "data/a", Path("/srv/split.csv"), tmp_path / "b")
    assert type(first) is type(config.sites[0].data[0]) and first.kind == "challenge"  # the source's own class
    assert absolute_paths(moved, base=Path("/elsewhere")) == moved  # nothing relative is left


def test_the_cli_names_what_is_missing_or_inconsistent(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    inconsistent = runner.invoke(app, ["experiment", "run", "cpu", "--address", "127.0.0.1:6379"])
    assert inconsistent.exit_code == 2 and "--backend ray" in inconsistent.output
    both = runner.invoke(app, ["experiment", "run", "cpu", "--site-parallelism", "ray", "--jobs", "2"])
    assert both.exit_code == 2 and "--jobs" in both.output
    with pytest.raises(ValueError, match="--jobs"):
        Placement(jobs=2, ray_address="local", runs_on_ray=True)
    with pytest.raises(ValueError, match="address"):
        Placement(sites_on_ray=True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    for asked in (["--backend", "ray"], ["--site-parallelism", "ray"]):
        missing = runner.invoke(app, ["experiment", "run", "cpu", *asked])
        assert missing.exit_code == 2 and 'pip install "cardiofl[ray]"' in missing.output


OBJECT_STORE_BYTES = 100 << 20  # Ray's default is 30 % of memory; a tiny grid's models need a few MB


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ray_node(arguments: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`ray start ... --block` in a process group of its own (stopped by that group, never by `ray stop`)."""
    assert RAY is not None
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}  # the fixture's token (RAY_AUTH_*) included
    with log.open("wb") as output:
        return subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", *arguments],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _stop(node: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the node's process group, then SIGKILL to what is left of it (the node and its children)."""
    with_group = node.pid
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 15)):
        try:
            os.killpg(with_group, sig)
        except ProcessLookupError:
            return
        try:
            node.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A head (2 CPUs) and a worker node (1 CPU) on 127.0.0.1: the head's address.

    Token authentication with a token of its own, in the nodes' environment and this process's (the
    driver's): neither a token file a local Ray left in the home folder nor Ray's default matters.
    """
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    saved = {name: os.environ.get(name) for name in auth}
    os.environ.update(auth)
    try:
        yield from _cluster()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _cluster() -> Iterator[str]:
    folder = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths must stay short
    port = _free_port()
    ports = {
        "--port": port,
        "--ray-client-server-port": _free_port(),
        "--dashboard-agent-listen-port": _free_port(),
        "--dashboard-agent-grpc-port": _free_port(),
        "--metrics-export-port": _free_port(),
        "--runtime-env-agent-port": _free_port(),
    }
    head_arguments = ["--head", "--num-cpus", "2", "--include-dashboard", "false", "--temp-dir", str(folder)]
    head_arguments += ["--object-store-memory", str(OBJECT_STORE_BYTES)]
    head_arguments += [f"{option}={value}" for option, value in ports.items()]
    nodes = [_ray_node(head_arguments, folder / "head.log")]
    address = f"127.0.0.1:{port}"
    try:
        node_ports = [f"{option}={_free_port()}" for option in list(ports)[2:]]
        worker = ["--address", address, "--num-cpus", "1", "--object-store-memory", str(OBJECT_STORE_BYTES)]
        worker += node_ports
        _wait_for_cpus(address, nodes, folder, 2)
        nodes.append(_ray_node(worker, folder / "node.log"))
        _wait_for_cpus(address, nodes, folder, 3)
        yield address
    finally:
        for node in reversed(nodes):
            _stop(node)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_driver(ray_cluster: str) -> Iterator[str]:
    """The test process connected to the cluster once: one Ray job, whose workers serve the tests that follow.

    The commands under test find Ray connected and leave the connection as it is (ray_common.ray_session).
    """
    import ray

    ray.init(address=ray_cluster, log_to_driver=False, configure_logging=False)
    try:
        yield ray_cluster
    finally:
        ray.shutdown()


WAIT_FOR_CPUS = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
while ray.cluster_resources().get("CPU", 0) < int(sys.argv[2]):
    time.sleep(0.2)
"""


def _wait_for_cpus(address: str, nodes: list[subprocess.Popen[bytes]], folder: Path, cpus: int) -> None:
    """Until the cluster at `address` has `cpus` CPUs, asked by a driver process of its own (90 s at most)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if any(node.poll() is not None for node in nodes):
            logs = "\n".join(path.read_text(errors="replace")[-2000:] for path in folder.glob("*.log"))
            raise RuntimeError(f"a Ray node exited:\n{logs}")
        try:
            waited = subprocess.run([sys.executable, "-c", WAIT_FOR_CPUS, address, str(cpus)], timeout=60, check=False)
        except subprocess.TimeoutExpired:
            continue
        if waited.returncode == 0:
            return
        time.sleep(1)  # the head is not answering yet
    raise TimeoutError(f"the Ray cluster at {address} did not reach {cpus} CPUs")


def _worker_pids() -> list[int]:
    """Ray worker processes running a run of the grid now (Ray titles them after the task)."""
    found = subprocess.run(["pgrep", "-f", "ray::cardiofl-run"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


@needs_ray
def test_a_grid_on_a_ray_cluster_writes_the_local_records_even_when_a_worker_dies(
    tmp_path: Path, ray_cluster: str
) -> None:
    config = tiny_experiment(tmp_path, privacy={"min_records": 3})
    alone, on_ray = tmp_path / "alone.jsonl", tmp_path / "ray.jsonl"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a Ray task's: one CPU asked, one torch thread
    try:
        run_experiment(config, alone, runtime=CPU)
    finally:
        torch.set_num_threads(threads)
    killed: list[int] = []

    def kill_a_worker() -> None:  # the first run's worker, half a second into its run
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            if pids := _worker_pids():
                time.sleep(0.5)
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.05)

    killer = threading.Thread(target=kill_a_worker, daemon=True)
    killer.start()
    on_the_cluster = Placement(ray_address=ray_cluster, runs_on_ray=True)
    ran = run_experiment(config, on_ray, runtime=CPU, placement=on_the_cluster)
    killer.join()
    assert len(killed) == 1  # Ray ran that run again
    assert sorted(key.id for key in ran) == sorted(key.id for key in config.runs())
    assert records_by_run(on_ray) == records_by_run(alone)  # every metric to the bit, the killed run's retry too
    assert finished_runs(on_ray) == {key.id for key in config.runs()}
    assert run_experiment(config, on_ray, runtime=CPU, placement=on_the_cluster) == []  # nothing left to run


DP = {"noise_multiplier": 1.1, "clip_norm": 0.05, "delta": 1e-5}
SECURE = {"min_records": 1, "secure_aggregation": {"phase_timeout_s": 30.0}}
# studies whose theta^g must not change when their sites run as Ray tasks: the change of each to the base study
# (FedDualAtt's split at 6:2); each algorithm and each privacy setting in one study at least
SITE_PARALLEL_STUDIES: dict[str, dict[str, object]] = {
    "FedDualAtt": {},
    "Scaffold, secure": {"algorithm": {"name": "scaffold", "params": {"server_lr": 0.5}}, "privacy": SECURE},
    "Ditto, central DP": {
        "algorithm": {"name": "ditto"},
        "aggregation": {"name": "equal"},
        "privacy": {"min_records": 1, "dp": DP},
    },
    "FedDualAtt, secure, distributed DP": {
        "aggregation": {"name": "equal"},
        "privacy": {**SECURE, "dp": {**DP, "mode": "distributed"}},
    },
}


@needs_ray
def test_sites_as_ray_tasks_release_the_sequential_runners_models_bit_for_bit(tmp_path: Path, ray_driver: str) -> None:
    config = absolute_paths(tiny_experiment(tmp_path, synthetic={"sites": 3, "records_per_site": 30, "seed": 5}))
    data = load_sites(config)
    base = config.study(config.runs()[0]).model_dump(mode="json")
    studies = {
        name: StudyTerms.model_validate({**base, "min_sites": 2, **change})
        for name, change in SITE_PARALLEL_STUDIES.items()
    }
    grid = config.model_copy(update={"heads": ["6:2"], "rounds": 1})  # two runs: seeds 0 and 1
    alone, spread = tmp_path / "alone.jsonl", tmp_path / "spread.jsonl"
    with torch_threads(1):  # a site task's: one CPU asked, one torch thread
        in_turn = {name: list(simulate_study(study, data, CPU)) for name, study in studies.items()}
        run_experiment(grid, alone, runtime=CPU)
    with ray_session(ray_driver) as ray:
        sites = RaySites(ray, config)
        for name, study in studies.items():
            n_classes = study.model.config().n_classes
            as_tasks = list(simulate_study(study, data, CPU, sites=sites))
            assert [o.kind for o in as_tasks] == ["train", "train", "evaluate"], name
            for one, other in zip(in_turn[name], as_tasks, strict=True):
                assert one.global_model.keys() == other.global_model.keys()
                differ = [n for n in one.global_model if not torch.equal(one.global_model[n], other.global_model[n])]
                assert not differ, f"{name}, round {one.round}: {differ[:3]} differ"
                assert one.record(n_classes) == other.record(n_classes), f"{name}, round {one.round}"
        # a grid whose runs go on here, their sites as tasks: the driver's own steps at a task's threads
        placement = Placement(ray_address=ray_driver, sites_on_ray=True)
        tally = GridTally(total=2, done=0)
        run_experiment(grid, spread, runtime=CPU, placement=placement, tally=tally)
    assert records_by_run(spread) == records_by_run(alone)
    assert (tally.done, tally.running, tally.failed, tally.queued) == (2, 0, 0, 0)


@needs_ray
def test_the_cli_runs_each_run_as_a_task_and_its_sites_as_tasks_too(tmp_path: Path, ray_driver: str) -> None:
    config = tmp_path / "sites.toml"
    config.write_text(
        'name = "sites"\npreset = "tiny"\nheads = ["6:2"]\nseeds = [0, 1]\nrounds = 1\ndevice = "cpu"\n'
        f'cache_dir = "{tmp_path / "cache"}"\n[privacy]\nmin_records = 3\n'
        "[synthetic]\nsites = 3\nrecords_per_site = 30\nseed = 5\n"
        '[training]\noptimizer = "adam"\nlr = 0.003\nbatch_size = 8\nmax_steps = 2\n'
    )
    alone, nested = tmp_path / "alone.jsonl", tmp_path / "nested.jsonl"
    with torch_threads(1):
        run_experiment(load_experiment(str(config)), alone, runtime=CPU)
    arguments = ["--results", str(nested), "--no-report", "--address", ray_driver, "--backend", "ray"]
    done = CliRunner().invoke(app, ["experiment", "run", str(config), "--site-parallelism", "ray", *arguments])
    assert done.exit_code == 0, done.output
    said = " ".join(done.output.split())  # each finished run is said with the grid's tally
    assert "finished · 1/2 done · 1 running · 0 failed · 0 queued · ETA" in said, said
    assert "finished · 2/2 done · 0 running · 0 failed · 0 queued · ETA 0:00:00" in said
    assert records_by_run(nested) == records_by_run(alone)


@needs_ray
def test_the_ray_benchmark_prints_both_figures(
    tmp_path: Path, ray_driver: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench/ray_grid.py at its smallest, in this process on this module's cluster: no timing asserted.

    `--cpus 1` is what a cluster of the benchmark's own would have; this module's has 3 (2 should its
    worker node drop out under the suite's load, which is not what this test is about).
    """
    bench = load_bench("ray_grid", monkeypatch)
    out = tmp_path / "ray_grid.json"
    results = bench.main(
        ["--grid-runs", "2", "--grid-rounds", "1", "--sites", "2", "--site-rounds", "2", "--records", "30",
         "--repeats", "1", "--cpus", "1", "--workdir", str(tmp_path / "w"), "--out", str(out)]
    )  # fmt: skip
    stdout = capsys.readouterr().out
    assert "ratio Ray grid / local grid:" in stdout and "(target <= 1.1)" in stdout
    assert "speed-up sites as Ray tasks / in turn:" in stdout and "(target >= 1.7)" in stdout
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    grid, sites = results["grid"], results["sites"]
    assert results["cpus"] in {2, 3} and grid["runs"] == 2 and len(grid["ratios"]) == 1 and grid["ratio"] > 0
    assert sites["sites"] == 2 and sites["theta_identical"] is True  # the same theta^g whichever way
    assert sites["in_turn_round_s"] > 0 and sites["as_tasks_round_s"] > 0
    assert len(list((tmp_path / "w").glob("*.jsonl"))) == 2  # each grid into a results file of its own
