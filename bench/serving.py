"""Benchmark: the server's CPU to send and to receive a θ^g-sized body over 127.0.0.1, for each way to serve it.

It decides how the coordinator serves θ^g_t. K clients (httpx, as the agents) download the same
model at once, then upload a body of the same size; the CPU of every server process (the whole
process tree, nginx's master and worker included) is read from /proc before and after.

- `uvicorn views`: what the coordinator does: one copy of the model in memory, sent as 1 MiB
  `memoryview` slices of it (coordinator/api/routes/global_models.py) under uvicorn.
- `granian path-send`: a file beside the database row, sent by Granian through the ASGI path-send
  extension (Starlette's `FileResponse` hands the path to the server, which sends the file itself).
- `nginx X-Accel-Redirect`: nginx in front of uvicorn; the app answers with the file's path and nginx
  sends it with `sendfile`. Everything else goes through nginx too, so the uploads are received
  twice (nginx proxies them to uvicorn): that row's upload figure says what this costs.

Each row is skipped, with the reason, where its server is not installed (`pip install granian`;
Debian's `nginx-light`). The last line is `ratio server CPU per site and round (a model sent and
one received), best other over uvicorn views: <ratio>` (above 1: the coordinator's own way is the
cheapest for a round, which sends K models and receives K).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import RESULTS_DIR, cpu_seconds, descendants, print_table, write_results  # noqa: E402

from coordinator.api.routes.global_models import _slices  # noqa: E402
from site_agent.client import UPLOAD_PIECE_BYTES, upload_pieces  # noqa: E402

MODEL_FILE_ENV = "CARDIOFL_SERVING_BENCH_FILE"


def create_app() -> Any:
    """The served app: the model from memory as views, from its file by path-send, or named for nginx."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    path = Path(os.environ[MODEL_FILE_ENV])
    data = path.read_bytes()

    async def views(_: Request) -> Response:
        headers = {"Content-Length": str(len(data))}
        return StreamingResponse(_slices(data), media_type="application/octet-stream", headers=headers)

    async def file(_: Request) -> Response:
        return FileResponse(path, media_type="application/octet-stream")

    async def accel(_: Request) -> Response:
        return Response(headers={"X-Accel-Redirect": f"/files/{path.name}"})

    async def receive(request: Request) -> Response:
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
        return PlainTextResponse(str(received))

    routes = [Route("/views", views), Route("/file", file), Route("/accel", accel)]
    return Starlette(routes=[*routes, Route("/upload", receive, methods=["POST"])])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(url: str, timeout_s: float = 30.0) -> None:
    """Return once `url` answers at all; RuntimeError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and of its live descendants."""
    total = 0.0
    for member in [pid, *descendants(pid)]:
        try:
            total += cpu_seconds(member)
        except OSError:
            continue
    return total


def download(url: str) -> int:
    """Fetch `url` as an agent does (httpx, streamed), keeping nothing; the bytes received."""
    received = 0
    with httpx.Client(timeout=120.0) as client, client.stream("GET", url) as response:
        response.raise_for_status()
        for chunk in response.iter_raw(UPLOAD_PIECE_BYTES):
            received += len(chunk)
    return received


def upload(url: str, data: bytes) -> int:
    """Send `data` as an agent sends its update (site_agent.client.upload_pieces); the size echoed."""
    with httpx.Client(timeout=120.0) as client:
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(data))}
        response = client.post(url, content=upload_pieces(data), headers=headers)
        response.raise_for_status()
        return int(response.text)


def server_cpu_per_body(
    pids: list[int], transfer: Callable[[], int], expected: int, sites: int, repeats: int
) -> list[float]:
    """Per repeat: the servers' CPU seconds per body while `sites` clients each move one body at once."""
    per_body = []
    for _ in range(repeats):
        before = sum(tree_cpu(pid) for pid in pids)
        with ThreadPoolExecutor(sites) as pool:
            sizes = list(pool.map(lambda _: transfer(), range(sites)))
        if sizes != [expected] * sites:
            raise RuntimeError(f"moved {sizes} bytes, expected {expected} each")
        per_body.append((sum(tree_cpu(pid) for pid in pids) - before) / sites)
    return per_body


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    client_max_body_size 0;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location /files/ {{ internal; alias {files}/; }}
        location / {{
            proxy_pass http://127.0.0.1:{upstream};
            proxy_http_version 1.1;
            proxy_request_buffering off;
        }}
    }}
}}
"""


class Servers:
    """The servers of one run, stopped together."""

    def __init__(self, work: Path, model: Path) -> None:
        self.work, self.model, self.processes = work, model, []
        self.env = {**os.environ, MODEL_FILE_ENV: str(model), "PYTHONPATH": str(Path(__file__).resolve().parent)}

    def start(self, command: list[str], name: str) -> subprocess.Popen:
        """Run `command` in the work folder, logging to `name`.log."""
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.work)
        self.processes.append(process)
        return process

    def uvicorn(self) -> tuple[int, int]:
        """The app under uvicorn: its port and pid."""
        port = free_port()
        command = [sys.executable, "-m", "uvicorn", "serving:create_app", "--factory", "--port", str(port)]
        process = self.start([*command, "--host", "127.0.0.1", "--log-level", "warning"], f"uvicorn-{port}")
        wait_for(f"http://127.0.0.1:{port}/upload")
        return port, process.pid

    def granian(self) -> tuple[int, int]:
        """The app under Granian, one worker: its port and the pid of its process tree."""
        port = free_port()
        command = [sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--workers", "1"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "serving:create_app"]
        process = self.start(command, f"granian-{port}")
        wait_for(f"http://127.0.0.1:{port}/upload")
        return port, process.pid

    def nginx(self, nginx: str, upstream: int) -> tuple[int, int]:
        """An nginx in front of the uvicorn on `upstream`: its port and the pid of its master."""
        port = free_port()
        for folder in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.work / folder).mkdir(exist_ok=True)
        conf = self.work / "nginx.conf"
        conf.write_text(NGINX_CONF.format(work=self.work, port=port, upstream=upstream, files=self.model.parent))
        process = self.start([nginx, "-c", str(conf), "-p", str(self.work), "-g", "user root;"], "nginx")
        wait_for(f"http://127.0.0.1:{port}/upload")
        return port, process.pid

    def stop(self) -> None:
        """Stop every server started (SIGTERM, then SIGKILL after 10 s)."""
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every available way, the same model and the same K; medians of the repeats."""
    model = work / "files" / "model.safetensors"
    model.parent.mkdir()
    data = os.urandom(args.megabytes * 1_000_000)
    model.write_bytes(data)
    os.chmod(work, 0o755)  # nginx's worker reads the file as its own user
    servers = Servers(work, model)
    skipped: dict[str, str] = {}
    ways: list[tuple[str, str, str, list[int]]] = []  # name, server, download path, the server's pids
    try:
        port, pid = servers.uvicorn()
        ways.append(("uvicorn views", f"http://127.0.0.1:{port}", "/views", [pid]))
        if importlib.util.find_spec("granian") is None:
            skipped["granian path-send"] = "granian is not installed (pip install granian)"
        else:
            granian_port, granian_pid = servers.granian()
            ways.append(("granian path-send", f"http://127.0.0.1:{granian_port}", "/file", [granian_pid]))
        nginx = shutil.which("nginx", path=f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin")
        if nginx is None:
            skipped["nginx X-Accel-Redirect"] = "nginx is not installed (Debian: apt-get install nginx-light)"
        else:
            nginx_port, nginx_pid = servers.nginx(nginx, port)
            ways.append(("nginx X-Accel-Redirect", f"http://127.0.0.1:{nginx_port}", "/accel", [nginx_pid, pid]))
        rows = []
        for name, base, path, pids in ways:
            moves = {"send": partial(download, base + path), "receive": partial(upload, base + "/upload", data)}
            row: dict[str, Any] = {"way": name}
            for figure, move in moves.items():
                per_body = server_cpu_per_body(pids, move, len(data), args.sites, args.repeats)
                row[f"{figure}_cpu_s"] = statistics.median(per_body)
            rows.append(row)
    finally:
        servers.stop()
    baseline = rows[0]
    for each in rows:
        each["site_round_cpu_s"] = each["send_cpu_s"] + each["receive_cpu_s"]  # a site's download and upload
        for figure in ("send", "receive", "site_round"):
            base = baseline[f"{figure}_cpu_s"]  # 0 at tiny sizes: below /proc's 10 ms tick
            each[f"{figure}_vs_views"] = each[f"{figure}_cpu_s"] / base if base else None
    work_per_model = byte_work(data, work, args.repeats)
    return {
        "megabytes": args.megabytes,
        "sites": args.sites,
        "repeats": args.repeats,
        "rows": rows,
        "skipped": skipped,
        "byte_work": work_per_model,
    }


def byte_work(data: bytes, work: Path, repeats: int) -> dict[str, float]:
    """CPU seconds per model of the coordinator's own work on the bytes, in this process, medians of `repeats`.

    `sha256`: an upload's digest alone. `spool`: an upload written into the blob store as it is
    (sha256, block checksums, the page cache; into a recycled spare file after the first).
    `database`: θ^g_t written into a fresh, migrated SQLite database (the record of every model).
    """
    from coordinator.db import make_engine, make_sessionmaker
    from coordinator.migrate import upgrade_database
    from coordinator.models import Blob
    from coordinator.storage.blobs import put_blob, sha256_of
    from coordinator.storage.update_files import FileBlobStore

    store = FileBlobStore(work / "store", spare_bytes=2 * len(data))
    engine = make_engine(f"sqlite:///{work / 'coordinator.db'}")
    upgrade_database(engine)
    sessions = make_sessionmaker(engine)
    views = list(upload_pieces(data))
    figures: dict[str, list[float]] = {"sha256": [], "spool": [], "database": []}
    for _ in range(repeats):
        started = time.process_time()
        digest = sha256_of(data)
        figures["sha256"].append(time.process_time() - started)
        started = time.process_time()
        with store.incoming(len(data)) as blob:
            blob.write_all(views, finish=True)
            store.add(blob)
        figures["spool"].append(time.process_time() - started)
        store.delete(digest)  # kept as a spare: the next upload is written over it
        with sessions() as session:
            started = time.process_time()
            put_blob(session, data, digest)
            session.commit()
            figures["database"].append(time.process_time() - started)
            session.query(Blob).filter(Blob.sha256 == digest).delete()
            session.commit()
    engine.dispose()
    return {name: statistics.median(values) for name, values in figures.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=94, help="body size in MB (default 94: the paper θ^g)")
    parser.add_argument("--sites", type=int, default=4, help="clients moving a body at once (default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of K transfers per way (default 5)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "serving.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print the table and the ratio line, write the JSON results."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cardiofl-serving-") as folder:
        results = measure(args, Path(folder))
    print(f"body {args.megabytes} MB, K = {args.sites} at once, medians of {args.repeats}; server CPU s per body")
    columns = [("way", "way"), ("send_cpu_s", "send CPU s"), ("send_vs_views", "send / views")]
    columns += [("receive_cpu_s", "receive CPU s"), ("receive_vs_views", "receive / views")]
    columns += [("site_round_cpu_s", "both CPU s"), ("site_round_vs_views", "both / views")]
    print_table(results["rows"], columns)
    for way, why in results["skipped"].items():
        print(f"{way}: skipped: {why}")
    work, views, k = results["byte_work"], results["rows"][0], args.sites
    print(
        "the coordinator's work on the bytes, CPU s per model: "
        + ", ".join(f"{name} {seconds:.3f}" for name, seconds in work.items())
    )
    floor = k * (views["send_cpu_s"] + views["receive_cpu_s"] + work["spool"]) + work["database"]
    results["round_floor_cpu_s"] = floor
    print(
        f"a K = {k} round's bytes under uvicorn, aggregation aside (K sent, K received and spooled, θ^g_t stored): "
        f"{floor:.2f} s of CPU"
    )
    others = [row["site_round_vs_views"] for row in results["rows"][1:] if row["site_round_vs_views"] is not None]
    results["best_other_ratio"] = min(others) if others else None
    write_results(args.out, results)
    shown = f"{min(others):.2f}" if others else "n/a (no other server measured)"
    print(f"ratio server CPU per site and round (a model sent, one received), best other over uvicorn views: {shown}")
    return results


if __name__ == "__main__":
    main()
