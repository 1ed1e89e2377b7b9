"""Benchmark: one plain round of an N MB theta^g with 2 sites, each transfer's connection cut once at a fraction of it.

The model: the built-in dual-attention network (shared/model/network.py) at the `small` preset's
sizes with its feed-forward layers widened (ffn_mult) until theta^g, all float32, is about N MB
(at least the `small` network's 1.9 MB). A study's terms name models only as presets, so the run
writes a throwaway plug-in into its folder, a distribution laid out as a wheel installs one (its
module, METADATA, entry_points.txt and RECORD), registering that config as preset `bench_big`,
and puts it on the PYTHONPATH of the coordinator and the agents.

`cardiofl coordinator serve` (SQLite) and 2 echo agents (bench/echo_agent.py: poll, download
theta^g, upload the same tensors, through site_agent.client.CoordinatorClient, whose downloads
resume by Range and uploads by upload sessions) run a study of one round. Each agent talks to the
coordinator through a relay of its own on 127.0.0.1, which cuts the connection of the first message
each way whose body is at least half of theta^g (the agent's download of theta^g, its upload) once
--cut of its body has passed. The relays count every byte they take from either side, heads
included, from the study's start until both agents have finished: the polls, the resumptions and
the final evaluation round count too, and so do the bytes taken from a sender but dropped at a cut.

Prints the payload (the whole bodies of the 4 transfers), bytes sent (what the relays took from the
senders), `bytes sent / payload: X.XXX` (target <= 1.1 at --cut 0.5), the peak RSS of the coordinator
and of an agent, and the wall time from the study's start until both agents finished. Writes JSON
(default bench/results/big_model.json).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import httpx
from benchlib import RESULTS_DIR, in_workdir, memory_of, write_results
from round_overhead import free_port, stop, wait_until

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = RESULTS_DIR / "big_model.json"
SITES = 2
TARGET_RATIO = 1.1
PRESET = "bench_big"
PLUGIN = "cardiofl_bench_big_model"
HEAD_END = b"\r\n\r\n"
RECV_BYTES = 64 << 10
MAX_HEAD = 64 << 10
Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, ...] = ("up", "down")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=100.0, help="size of theta^g in MB (default 100)")
    parser.add_argument("--cut", type=float, default=0.5, help="fraction of each transfer before its cut (0.5)")
    parser.add_argument("--resume-delay-s", type=float, default=1.0, help="agents' first wait before resuming")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for the round")
    parser.add_argument("--workdir", type=Path, help="where the database, plug-in and logs go (default: temporary)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    if not 0.0 < args.cut < 1.0:
        parser.error("--cut must be a fraction strictly between 0 and 1")
    return args


# --- the model -----------------------------------------------------------------------------------------------


def theta_bytes(ffn_mult: int, **fields: Any) -> int:
    """Bytes of the tensors of theta^g (FedAvg) of the `small` network with feed-forward width ffn_mult * D.

    `fields` replace more of the `small` preset's sizes (bench/big_round.py widens D too).
    """
    from shared.algorithms.registry import exchange_of, parsed_params
    from shared.terms import AlgorithmSpec
    from shared.terms.model_config import SMALL

    algorithm = AlgorithmSpec()
    config = replace(SMALL, ffn_mult=ffn_mult, **fields)
    schema = exchange_of(config, algorithm.name, parsed_params(algorithm)).global_schema()
    return sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in schema.values())


def sized(megabytes: float, **fields: Any) -> tuple[int, int]:
    """(ffn_mult, theta^g's tensor bytes) nearest `megabytes` MB (10^6 bytes): theta^g grows linearly in ffn_mult."""
    one = theta_bytes(1, **fields)
    step = theta_bytes(2, **fields) - one
    ffn_mult = max(1, round((megabytes * 1e6 - one) / step) + 1)
    return ffn_mult, one + (ffn_mult - 1) * step


def install_plugin(root: Path, ffn_mult: int, **fields: Any) -> Path:
    """A distribution registering preset `bench_big`, laid out in `root` as a wheel installs it; `root`.

    `fields` replace more of the `small` preset's sizes besides ffn_mult.
    """
    root.mkdir(parents=True, exist_ok=True)
    module = root / f"{PLUGIN}.py"
    module.write_text(
        '"""Preset bench_big: the small network with wider feed-forward layers (bench/big_model.py)."""\n\n'
        "from dataclasses import replace\n\nfrom shared.terms.model_config import SMALL\n\n"
        f"BENCH_BIG = replace(SMALL, ffn_mult={ffn_mult}{''.join(f', {k}={v!r}' for k, v in fields.items())})\n"
    )
    info = root / f"{PLUGIN}-{ffn_mult}.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: {ffn_mult}.0\n")
    (info / "entry_points.txt").write_text(f"[cardiofl.models]\n{PRESET} = {PLUGIN}:BENCH_BIG\n")
    lines = []
    for path in (module, info / "METADATA", info / "entry_points.txt"):
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        lines.append(f"{path.relative_to(root).as_posix()},sha256={digest},{path.stat().st_size}")
    (info / "RECORD").write_text("\n".join([*lines, f"{info.name}/RECORD,,"]) + "\n")
    return root


# --- the relay -----------------------------------------------------------------------------------------------


class Relay:
    """127.0.0.1:`port` forwarded to `target`; the first message each way with a body of `big` bytes or more is cut.

    The cut falls once `fraction` of that message's body has been forwarded: both sides of its
    connection are closed. `read` counts the bytes taken from each side, `forwarded` those passed on;
    `transfers` holds the body length of the message cut each way.
    """

    def __init__(self, target: tuple[str, int], *, big: int, fraction: float) -> None:
        self.target, self.big, self.fraction = target, big, fraction
        self.read: dict[Direction, int] = dict.fromkeys(DIRECTIONS, 0)
        self.forwarded: dict[Direction, int] = dict.fromkeys(DIRECTIONS, 0)
        self.transfers: dict[Direction, int] = {}
        self.unframed = 0  # streams whose messages could not be told apart (no Content-Length): never cut
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        """The relay's address as an http URL."""
        return f"http://127.0.0.1:{self.port}"

    def counters(self) -> dict[str, int]:
        """Bytes read and forwarded so far, per direction."""
        with self._lock:
            return {f"{what}_{way}": getattr(self, what)[way] for what in ("read", "forwarded") for way in DIRECTIONS}

    def close(self) -> None:
        """Stop accepting and close every connection."""
        _close(self._listener, *self._sockets)

    def arm(self, direction: Direction, length: int) -> int | None:
        """For a message of `length` body bytes going `direction`: how many of them pass before its cut, or None."""
        with self._lock:
            if length < self.big or direction in self.transfers:
                return None
            self.transfers[direction] = length
            return int(self.fraction * length)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, direction: Direction) -> None:
        """Copy `source` to `sink` until either closes, or until the cut of a message in this stream."""
        framer = _Framer(self, direction)
        while True:
            try:
                data = source.recv(RECV_BYTES)
            except OSError:
                data = b""
            if not data:
                _close(source, sink)
                return
            keep = framer.feed(data)
            send = data if keep is None else data[:keep]
            try:
                sink.sendall(send)
            except OSError:
                keep = 0
            with self._lock:
                self.read[direction] += len(data)
                self.forwarded[direction] += len(send)
            if keep is not None:
                _close(source, sink)
                return


class _Framer:
    """The HTTP/1.1 messages of one stream, told apart by their heads and Content-Length."""

    def __init__(self, relay: Relay, direction: Direction) -> None:
        self.relay, self.direction = relay, direction
        self.head = bytearray()
        self.left = 0  # body bytes of the current message still to come
        self.cut_left: int | None = None  # the cut falls when `left` comes down to this
        self.lost = False

    def feed(self, data: bytes) -> int | None:
        """How many bytes of `data` pass before the cut, if it falls in them; None: all pass."""
        pos = 0
        while pos < len(data) and not self.lost:
            if self.left > 0:
                take = min(self.left, len(data) - pos)
                if self.cut_left is not None and self.left - take <= self.cut_left:
                    return pos + self.left - self.cut_left
                self.left -= take
                pos += take
                continue
            start = len(self.head)
            self.head += data[pos:]
            end = self.head.find(HEAD_END, max(0, start - len(HEAD_END) + 1))
            if end < 0:
                self.lost = len(self.head) > MAX_HEAD
                return None
            pos += end + len(HEAD_END) - start
            self.left = self._body_length(bytes(self.head[:end]))
            self.head.clear()
            keep = self.relay.arm(self.direction, self.left)
            self.cut_left = None if keep is None else self.left - keep
            if self.cut_left is not None and self.cut_left == self.left:
                return pos
        return None

    def _body_length(self, head: bytes) -> int:
        """The body length a message head announces; 0 for none, and the stream lost when it cannot tell."""
        lines = head.decode("latin-1").split("\r\n")
        fields = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
        status = re.match(r"HTTP/1\.[01] (\d{3})", lines[0])
        if status is not None and (status[1][0] == "1" or status[1] in ("204", "304")):
            return 0
        if "content-length" in fields:
            return int(fields["content-length"])
        if status is None and "transfer-encoding" not in fields:
            return 0  # a request without a body
        self.lost = True
        with self.relay._lock:
            self.relay.unframed += 1
        return 0


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


# --- the run -------------------------------------------------------------------------------------------------


def start_coordinator(folder: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int, str]:
    """`cardiofl coordinator serve` on SQLite in `folder`, answering health checks: (process, port, admin token)."""
    from coordinator.config import generate_admin_token

    for leftover in folder.glob("coordinator.db*"):  # a --workdir used before
        leftover.unlink()
    port, admin_token = free_port(), generate_admin_token()
    env = env | {"CARDIOFL_DATABASE_URL": f"sqlite:///{folder / 'coordinator.db'}", "CARDIOFL_ADMIN_TOKEN": admin_token}
    serve = [sys.executable, "-m", "cardiofl", "coordinator", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with (folder / "coordinator.log").open("w") as log:
        coordinator = subprocess.Popen(serve, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)

    def healthy() -> bool:
        if coordinator.poll() is not None:
            raise SystemExit(f"the coordinator exited with {coordinator.returncode}; see {folder / 'coordinator.log'}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, 120, "the coordinator")
    return coordinator, port, admin_token


def checked(response: httpx.Response) -> Any:
    """The JSON of an answer below 400; SystemExit naming the request otherwise."""
    if response.status_code >= 400:
        raise SystemExit(f"{response.request.method} {response.request.url}: {response.status_code} {response.text}")
    return response.json()


def start_agents(
    folder: Path, env: dict[str, str], relays: list[Relay], tokens: list[str], resume_delay_s: float
) -> list[subprocess.Popen[bytes]]:
    """One echo agent per token, each through its relay; each stops after the study's final evaluation task."""
    agents: list[subprocess.Popen[bytes]] = []
    for index, (relay, token) in enumerate(zip(relays, tokens, strict=True)):
        command = [sys.executable, str(BENCH_DIR / "echo_agent.py"), "--url", relay.url, "--token", token]
        command += ["--num-examples", str(100 + index), "--log", str(folder / f"agent-{index}.json")]
        command += ["--resume-delay-s", str(resume_delay_s)]
        with (folder / f"agent-{index}.log").open("w") as log:
            agents.append(subprocess.Popen(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT))
    return agents


def failed(agents: list[subprocess.Popen[bytes]], folder: Path) -> str:
    """The last lines of the logs of the agents that exited with an error ('' when none did)."""
    return "".join(
        f"\nagent {index} exited {agent.returncode}:\n"
        + "\n".join((folder / f"agent-{index}.log").read_text(errors="replace").splitlines()[-10:])
        for index, agent in enumerate(agents)
        if agent.returncode not in (None, 0)
    )


def run_round(args: argparse.Namespace, folder: Path, big: int) -> dict[str, Any]:
    """The coordinator, 2 relays and 2 echo agents through one round: what the relays and processes measured."""
    plugin = install_plugin(folder / "plugin", args.ffn_mult)
    env = {name: value for name, value in os.environ.items() if not name.startswith("CARDIOFL_")}
    env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")]))}
    coordinator, port, admin_token = start_coordinator(folder, env)
    relays = [Relay(("127.0.0.1", port), big=big, fraction=args.cut) for _ in range(SITES)]
    processes = [coordinator]
    try:
        admin = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {admin_token}"})
        admin.timeout = httpx.Timeout(600.0)
        names = [f"site{index:03d}" for index in range(SITES)]
        tokens = [checked(admin.post("/api/v1/sites", json={"name": name}))["token"]["token"] for name in names]
        config = {"model": {"preset": PRESET}, "sites": names, "rounds": 1, "min_sites": SITES}
        study = checked(admin.post("/api/v1/studies", json={"name": "big-model", "config": config}))["id"]
        agents = start_agents(folder, env, relays, tokens, args.resume_delay_s)
        processes += agents

        def approved() -> bool:
            if failed(agents, folder):
                raise SystemExit(f"an agent exited early{failed(agents, folder)}")
            return set(checked(admin.get(f"/api/v1/studies/{study}"))["approvals"].values()) == {"approved"}

        wait_until(approved, 300, "the agents to approve the study")
        time.sleep(1.0)  # let the agents reach their long-polls
        before = [relay.counters() for relay in relays]
        coordinator_start_peak = memory_of(coordinator.pid)["peak"]
        began = time.monotonic()
        checked(admin.post(f"/api/v1/studies/{study}/start"))
        wait_until(lambda: all(agent.poll() is not None for agent in agents), args.timeout, "the agents to finish")
        wall_s = time.monotonic() - began
        coordinator_peak = memory_of(coordinator.pid)["peak"]
        status = checked(admin.get(f"/api/v1/studies/{study}"))["status"]
        after = [relay.counters() for relay in relays]
    finally:
        stop(processes)
        for relay in relays:
            relay.close()
    if status != "completed" or failed(agents, folder):
        raise SystemExit(f"the study did not complete (status {status}); see {folder}{failed(agents, folder)}")
    logs = [json.loads((folder / f"agent-{index}.json").read_text()) for index in range(SITES)]
    return {
        "wall_s": wall_s,
        "counted": {key: sum(a[key] - b[key] for a, b in zip(after, before, strict=True)) for key in after[0]},
        "transfers": [relay.transfers.get(way, 0) for relay in relays for way in DIRECTIONS],
        "unframed_streams": sum(relay.unframed for relay in relays),
        "coordinator_peak_rss": coordinator_peak,
        "coordinator_peak_rss_before_start": coordinator_start_peak,
        "agent_peak_rss": [log[-1]["peak_rss"] for log in logs],
    }


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Size the model, run the round, and work out the ratio."""
    args.ffn_mult, model = sized(args.megabytes)
    measured = run_round(args, folder, big=model // 2)
    cuts = sum(1 for length in measured["transfers"] if length)
    if cuts != 2 * SITES:
        raise SystemExit(f"{cuts} of {2 * SITES} transfers were cut ({measured['unframed_streams']} streams unframed)")
    counted = measured.pop("counted")
    payload = sum(measured["transfers"])
    sent = counted["read_up"] + counted["read_down"]
    return {
        "megabytes": args.megabytes,
        "cut": args.cut,
        "sites": SITES,
        "ffn_mult": args.ffn_mult,
        "theta_bytes": model,
        "payload_bytes": payload,
        "bytes_sent": sent,
        "bytes_delivered": counted["forwarded_up"] + counted["forwarded_down"],
        "sent_over_payload": sent / payload,
        **{f"{key}_bytes": value for key, value in counted.items()},
        **measured,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print its figures and ratio, write the JSON results."""
    args = parse_args(argv)
    results = in_workdir(args.workdir, lambda folder: run(args, folder))
    print(
        f"theta^g {results['theta_bytes'] / 1e6:.1f} MB (small network, ffn_mult {results['ffn_mult']}), "
        f"{SITES} sites, each download and upload cut once at {args.cut:.0%}"
    )
    print(f"payload: {results['payload_bytes'] / 1e6:.1f} MB (4 transfers' bodies)")
    print(
        f"bytes sent: {results['bytes_sent'] / 1e6:.1f} MB (taken from the senders by the relays, heads, polls "
        f"and bytes lost at the cuts included); delivered {results['bytes_delivered'] / 1e6:.1f} MB"
    )
    coordinator, agent = results["coordinator_peak_rss"] / 1e6, results["agent_peak_rss"][0] / 1e6
    print(f"peak RSS: coordinator {coordinator:.0f} MB, agent {agent:.0f} MB")
    print(f"wall time: {results['wall_s']:.1f} s from the study's start until both agents finished")
    print(f"bytes sent / payload: {results['sent_over_payload']:.3f} (target <= {TARGET_RATIO})")
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
