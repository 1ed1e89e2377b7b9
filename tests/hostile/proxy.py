"""A hostile coordinator: the real app behind an httpx transport that alters one thing in what one site receives.

`HostileTransport` wraps the in-process app's transport (a TestClient's). It records every request the
agent sends (method, path, body) and every answer of the task and secure-round endpoints, and lets an
alteration rewrite the JSON of `GET /api/v1/tasks/next` and `GET /api/v1/rounds/{id}/secagg` before the
agent reads it. Everything else (offers, approvals, downloads, uploads) passes through unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["Alteration", "Answer", "HostileTransport", "Sent"]

TASK_PATH = "/api/v1/tasks/next"
SECAGG_PATH = re.compile(r"^/api/v1/rounds/(\d+)/secagg$")

# Rewrites an answer's JSON (a task or a secure round view) in place of the coordinator; None: leave it as it is.
Alteration = Callable[[dict[str, Any]], dict[str, Any] | None]


@dataclass(frozen=True)
class Sent:
    """A request the agent sent."""

    method: str
    path: str
    body: bytes
    status: int  # the coordinator's answer


@dataclass(frozen=True)
class Answer:
    """The coordinator's answer to a task poll or a secure round read, as sent and as the agent received it."""

    path: str
    status: int
    original: dict[str, Any] | None
    received: dict[str, Any] | None

    @property
    def altered(self) -> bool:
        return self.original != self.received


@dataclass
class HostileTransport(httpx.BaseTransport):
    """The coordinator's transport, with `on_task` / `on_view` applied to the answers this site receives."""

    inner: httpx.BaseTransport
    on_task: Alteration | None = None
    on_view: Alteration | None = None
    sent: list[Sent] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()  # a streamed upload is joined once; the inner transport reads the joined bytes
        path = request.url.path
        response = self.inner.handle_request(request)
        self.sent.append(Sent(request.method, path, bytes(body), response.status_code))
        if request.method != "GET":
            return response
        if path == TASK_PATH:
            alteration = self.on_task
        elif SECAGG_PATH.match(path):
            alteration = self.on_view
        else:
            return response
        response.read()
        original = response.json() if response.status_code == 200 else None
        received = original
        if original is not None and alteration is not None:
            changed = alteration(json.loads(json.dumps(original)))  # a deep copy: the record keeps the original
            if changed is not None:
                received = changed
        self.answers.append(Answer(path, response.status_code, original, received))
        if received is original:
            return response
        headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() != "content-length"]
        return httpx.Response(response.status_code, headers=headers, content=json.dumps(received).encode())

    def close(self) -> None:  # the TestClient owns the inner transport
        pass

    # -- what the agent sent -----------------------------------------------------------------

    def posts(self, suffix: str) -> list[Sent]:
        return [s for s in self.sent if s.method == "POST" and s.path.endswith(suffix)]

    def gets(self, path: str) -> list[Sent]:
        return [s for s in self.sent if s.method == "GET" and s.path == path]

    def tasks(self) -> list[Answer]:
        return [a for a in self.answers if a.path == TASK_PATH]
