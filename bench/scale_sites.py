"""The simulated sites of bench/scale.py: each speaks the site protocol as an agent does, and records its latencies."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from benchlib import echo_update

ANSWERS = {200, 201, 204, 304, 409}  # 409: an answer of the protocol (a round that closed meanwhile)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values`, by linear interpolation; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Recorder:
    """Latencies by (round, kind), errors, and when each round's first task arrived."""

    latencies: dict[tuple[int, str], list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: list[str] = field(default_factory=list)
    round_started: dict[int, float] = field(default_factory=dict)
    marks: dict[int, dict[str, float]] = field(default_factory=dict)  # round -> coordinator readings at its start

    @contextmanager
    def timed(self, round_: int, kind: str) -> Iterator[None]:
        """Record how long the block took as a `kind` latency of round `round_`."""
        start = time.perf_counter()
        yield
        self.latencies[round_, kind].append(time.perf_counter() - start)


class Site:
    """One simulated site: its token, and an HTTP client of its own (its own connections, as an agent has)."""

    def __init__(
        self,
        url: str,
        name: str,
        token: str,
        num_examples: int,
        poll_wait: float,
        interval: float,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """`verify`: the TLS context (CA, and a client certificate under mutual TLS) for an https `url`."""
        from shared.wire.protocol import PROTOCOL_HEADER, PROTOCOL_VERSION

        self.name, self.num_examples, self.poll_wait, self.interval = name, num_examples, poll_wait, interval
        headers = {"Authorization": f"Bearer {token}", PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
        self.http = httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(60.0), verify=verify)

    async def checked(self, recorder: Recorder, response: httpx.Response, what: str) -> httpx.Response:
        """The response, counted as an error when it is none of the protocol's answers."""
        if response.status_code not in ANSWERS:
            recorder.errors.append(f"{self.name} {what}: {response.status_code} {response.text[:200]}")
        return response

    async def call(self, recorder: Recorder, what: str, method: str, url: str, **options: Any) -> httpx.Response:
        """One request, retried as an agent retries (after `interval` s) while the coordinator is unavailable.

        Each dropped connection, 5xx or 429 counts as an error; the protocol's refusals are returned.
        """
        while True:
            try:
                response = await self.http.request(method, url, **options)
            except httpx.TransportError as exc:
                recorder.errors.append(f"{self.name} {what}: dropped: {type(exc).__name__}: {exc}")
            else:
                if response.status_code < 500 and response.status_code != 429:
                    return await self.checked(recorder, response, what)
                recorder.errors.append(f"{self.name} {what}: {response.status_code} {response.text[:200]}")
            await asyncio.sleep(self.interval)

    async def run(self, recorder: Recorder, on_round: Any) -> None:
        """Approve the study, then answer tasks until the final evaluation is uploaded."""
        from shared.privacy.signing import SiteIdentity
        from shared.study.description import describe_study
        from shared.wire.protocol import ApprovalReport, StudyOffer, TaskSpec

        key = {"public_key": SiteIdentity.generate().public_hex()}
        await self.call(recorder, "signing key", "PUT", "/api/v1/sites/me/signing-key", json=key)
        while True:  # as an agent with auto_approve: look for offers every `interval` s
            offers = (await self.call(recorder, "offers", "GET", "/api/v1/sites/me/studies")).json()["data"]
            if offers:
                break
            await asyncio.sleep(self.interval)
        for raw in offers:
            offer = StudyOffer.model_validate(raw)
            report = ApprovalReport(state="approved", digest=describe_study(offer, offer.site).digest())
            url = f"/api/v1/sites/me/studies/{offer.study_id}/approval"
            await self.call(recorder, "approval", "PUT", url, json=report.model_dump(mode="json"))
        round_ = 0
        while True:
            start = time.perf_counter()
            try:
                response = await self.http.get(
                    "/api/v1/tasks/next",
                    params={"wait": self.poll_wait},
                    timeout=httpx.Timeout(60.0, read=self.poll_wait + 60.0),
                )
            except httpx.TransportError as exc:
                recorder.errors.append(f"{self.name} poll: dropped: {type(exc).__name__}: {exc}")
                await asyncio.sleep(self.interval)
                continue
            await self.checked(recorder, response, "poll")
            if response.status_code != 200:
                if response.status_code == 204:  # no task: an agent then asks for its jobs outside rounds
                    await self.call(recorder, "jobs", "GET", "/api/v1/jobs")
                else:
                    await asyncio.sleep(self.interval)
                continue
            task = TaskSpec.model_validate_json(response.content)
            round_ = task.round
            recorder.latencies[round_, "poll"].append(time.perf_counter() - start)
            on_round(round_)
            if task.kind == "evaluate":
                await self.upload(recorder, task, round_, None)
                return
            with recorder.timed(round_, "download"):
                model = await self.download(recorder, task.global_model_url, task.global_model_sha256)
            await self.upload(recorder, task, round_, model)

    async def download(self, recorder: Recorder, url: str, sha256: str) -> bytes:
        """theta^g, its sha256 checked against the task's."""
        response = await self.call(recorder, "download", "GET", url)
        if hashlib.sha256(response.content).hexdigest() != sha256:
            recorder.errors.append(f"{self.name} download: sha256 differs from the announced {sha256}")
        return response.content

    async def upload(self, recorder: Recorder, task: Any, round_: int, model: bytes | None) -> None:
        """The same tensors back with n_k (statistics only in the final evaluation), timed."""
        from shared.tensors.update_body import encode_update
        from shared.wire.protocol import UpdateMeta, UpdateMetrics

        if model is None:
            meta = UpdateMeta(num_examples=self.num_examples, metrics=UpdateMetrics(loss=0.5), train_seconds=0.0)
            body = encode_update({}, meta)
        else:
            body = echo_update(model, self.num_examples, round_)
        with recorder.timed(round_, "upload"):  # the same bytes again get the first receipt
            await self.call(
                recorder,
                "upload",
                "POST",
                task.update_url,
                content=bytes(body),
                headers={"Content-Type": "application/octet-stream"},
                timeout=httpx.Timeout(60.0, write=600.0, read=600.0),
            )
