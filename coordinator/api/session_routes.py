"""Routes whose plain (sync) endpoints give their database sessions back as they return, in their own thread.

FastAPI validates what a sync endpoint returns in a second trip to the request threads, and closes the
endpoint's session (`SessionDep`) only after that. Under a burst of requests that outnumbers the
threads (128 sites asking for their studies at once), the endpoints that had returned waited for a
thread while holding their connections, and the endpoints holding every thread waited for a
connection: the pool ran dry until its 30 s timeout answered 500. Closing the sessions an endpoint
was given as it returns keeps each connection inside the one thread hop that uses it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi.routing import APIRoute
from sqlalchemy.orm import Session

__all__ = ["SessionReleasingRoute", "releasing_sessions"]


def releasing_sessions(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """`endpoint`, closing every Session it is given once it returns or raises (the dependency's close is then a no-op).

    What it returns must not read the database afterwards: the routes return response models, not rows.
    """

    @functools.wraps(endpoint)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in (*args, *kwargs.values()):
                if isinstance(value, Session):
                    value.close()

    return call


class SessionReleasingRoute(APIRoute):
    """An APIRoute whose sync endpoint is wrapped by `releasing_sessions`; async endpoints are left as they are."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not any(kind(endpoint) for kind in _NOT_PLAIN):
            endpoint = releasing_sessions(endpoint)
        super().__init__(path, endpoint, **kwargs)


# Endpoints the wrapper must leave alone: async ones, and generators, whose sessions are used after the call returns.
_NOT_PLAIN = (inspect.iscoroutinefunction, inspect.isgeneratorfunction, inspect.isasyncgenfunction)
