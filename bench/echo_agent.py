"""A site agent that does no training: it polls, downloads theta^g, and uploads the same tensors with its n_k.

The round-overhead and secure-round benchmarks run K of these as separate processes against a real
coordinator. A task of a secure round (task.secure) is answered as the site agent answers it
(site_agent.secure_round.SecureRound): advertise, then step through the phases, polling the round
every --secure-poll-s seconds while it has nothing for this site, until the round has ended.
Each task's arrival time and the bytes its CoordinatorClient moved so far are written to --log
(JSON) after every task, with the agent's peak RSS at the end; the agent exits after the study's final
evaluation task or --tasks tasks. A cut download or upload resumes as the site agent's does (the
client's Range requests and upload sessions), first waiting --resume-delay-s.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from benchlib import echo_update

from shared.privacy.signing import SiteIdentity
from shared.study.description import describe_study
from shared.tensors.codec import tensor_views
from shared.tensors.update_body import encode_update
from shared.wire.protocol import ApprovalReport, TaskSpec, UpdateMeta, UpdateMetrics
from site_agent.client import CoordinatorClient
from site_agent.memory import keep_model_buffers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="coordinator base URL")
    parser.add_argument("--token", required=True, help="the site's token")
    parser.add_argument("--num-examples", type=int, default=100, help="n_k sent with every update")
    parser.add_argument("--tasks", type=int, default=1000, help="stop after this many tasks")
    parser.add_argument("--log", type=Path, required=True, help="JSON file: one entry per task")
    parser.add_argument("--secure-poll-s", type=float, default=0.1, help="pause between reads of a secure round")
    parser.add_argument("--resume-delay-s", type=float, default=1.0, help="first wait before a cut transfer resumes")
    return parser.parse_args(argv)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss() -> int:
    """The peak resident memory of the process so far, in bytes (Linux counts ru_maxrss in kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextmanager
def _timed(steps: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    steps[name] = time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    """Answer tasks until the final evaluation task (or --tasks) is done."""
    args = parse_args(argv)
    keep_model_buffers()  # the heap a site agent's process runs with (site_agent/cli/app.py)
    # Calls besides the long-poll and the transfers (which set their own) wait up to 60 s: on a loaded
    # machine a coordinator busy with K sites' uploads may take seconds to answer, and this agent does not retry.
    http = httpx.Client(base_url=args.url, headers={"Authorization": f"Bearer {args.token}"}, timeout=60.0)
    client = CoordinatorClient(http, poll_wait_s=30.0, resume_delay_s=args.resume_delay_s)
    meta = UpdateMeta(num_examples=args.num_examples, metrics=UpdateMetrics(loss=0.5), train_seconds=0.0)
    entries: list[dict[str, float | int | str]] = []
    identity = SiteIdentity.generate()  # as an agent at its first start: secure studies' terms name its key
    client.register_signing_key(identity.public_hex())
    approve_offered(client)
    while len(entries) < args.tasks:
        task = client.next_task()
        if task is None:
            continue
        entries.append(
            {
                "round": task.round,
                "kind": task.kind,
                "received": time.time(),
                "bytes_sent": client.bytes_sent,
                "bytes_received": client.bytes_received,
                "cpu_s": _cpu_seconds(),
            }
        )
        steps: dict[str, float] = {}
        if task.secure is not None:
            with _timed(steps, "secure_s"):
                reads, phases = secure_echo(client, task, args.num_examples, args.secure_poll_s, identity)
            entries[-1].update(steps, secure_reads=reads, phases=phases)
            args.log.write_text(json.dumps(entries))
            if task.kind == "evaluate":
                break
            continue
        if task.kind == "evaluate":  # statistics only, no tensors
            body = encode_update({}, meta)
        else:
            with _timed(steps, "download_s"):
                model = client.download(task.global_model_url, task.global_model_sha256)
            with _timed(steps, "encode_s"):
                body = echo_update(model, args.num_examples, task.round)
        with _timed(steps, "upload_s"):
            client.upload(task.update_url, body)
        entries[-1].update(steps)
        args.log.write_text(json.dumps(entries))
        if task.kind == "evaluate":
            break
    entries.append(
        {
            "round": -1,
            "kind": "done",
            "received": time.time(),
            "bytes_sent": client.bytes_sent,
            "bytes_received": client.bytes_received,
            "cpu_s": _cpu_seconds(),
            "peak_rss": _peak_rss(),
        }
    )
    args.log.write_text(json.dumps(entries))


SECURE_PHASES = ("advertise", "share", "masked upload", "consistency", "reveal", "result")


def secure_echo(
    client: CoordinatorClient, task: TaskSpec, num_examples: int, poll_s: float, identity: SiteIdentity
) -> tuple[int, dict[str, dict[str, float]]]:
    """Take part in a secure round with theta^g as this site's tensors until it ends; the reads it took, and its phases.

    Per phase of SECURE_PHASES: this site's wall and CPU seconds from its previous move to this one (waiting included).
    """
    from site_agent.local_round import LocalRoundResult
    from site_agent.secure_round import SecureRound
    from site_agent.task_check import check_task

    phases: dict[str, dict[str, float]] = {}
    wall, cpu = time.perf_counter(), _cpu_seconds()

    def moved(phase: str) -> None:
        nonlocal wall, cpu
        phases[phase] = {"wall_s": time.perf_counter() - wall, "cpu_s": _cpu_seconds() - cpu}
        wall, cpu = time.perf_counter(), _cpu_seconds()

    metrics = UpdateMetrics(loss=0.5, echo_round=task.round)
    meta = UpdateMeta(num_examples=num_examples, metrics=metrics, train_seconds=0.0)
    model = client.download(task.global_model_url, task.global_model_sha256) if task.kind == "train" else None
    shared = tensor_views(model) if model is not None else {}  # the final evaluation round sums statistics only
    spec = check_task(task, task.terms, task.site)  # the round as the terms make it, as an agent derives it
    result = LocalRoundResult(shared=shared, local={}, meta=meta)
    secure = SecureRound(task, spec, "bench", result, identity, base=shared)  # theta^g unchanged: a zero change
    secure.advertise(client)
    moved(SECURE_PHASES[0])  # with theta^g's download and the round's keys

    def send(body: bytes | bytearray) -> None:
        client.upload(task.update_url, body)

    reads = 0
    while not secure.finished:
        reads += 1
        if secure.step(client, send):
            moved(SECURE_PHASES[min(len(phases), len(SECURE_PHASES) - 1)])
        else:
            time.sleep(poll_s)
    return reads, phases


def approve_offered(client: CoordinatorClient) -> None:
    """Approve every study offered to this site once there is one, as a site agent with auto_approve does."""
    while not (offers := client.offers()):
        time.sleep(0.2)
    for offer in offers:
        digest = describe_study(offer, offer.site).digest()
        client.report_approval(offer.study_id, ApprovalReport(state="approved", digest=digest))


if __name__ == "__main__":
    main(sys.argv[1:])
