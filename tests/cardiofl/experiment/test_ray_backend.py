"""`experiment run --backend ray`: the local backend's records from a real Ray cluster, a killed worker included."""

from __future__ import annotations

import importlib.util
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
from cardiofl.experiment.config import ExperimentConfig
from cardiofl.experiment.grid import finished_runs, run_experiment
from cardiofl.experiment.ray_backend import absolute_paths
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
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    missing = runner.invoke(app, ["experiment", "run", "cpu", "--backend", "ray"])
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
    with_group = node.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(with_group, sig)
        except ProcessLookupError:
            return
        try:
            node.wait(timeout=15)
            return
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
    ran = run_experiment(config, on_ray, runtime=CPU, ray_address=ray_cluster)
    killer.join()
    assert len(killed) == 1  # Ray ran that run again
    assert sorted(key.id for key in ran) == sorted(key.id for key in config.runs())
    assert records_by_run(on_ray) == records_by_run(alone)  # every metric to the bit, the killed run's retry too
    assert finished_runs(on_ray) == {key.id for key in config.runs()}
    assert run_experiment(config, on_ray, runtime=CPU, ray_address=ray_cluster) == []  # nothing left to run
