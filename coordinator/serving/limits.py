"""How long a client may take to send a request's header (coordinator.serving.header_deadline), without uvicorn.

The command line reads these at start, before uvicorn is imported; the serving processes read the
deadline from CARDIOFL_HEADER_TIMEOUT_S, which `cardiofl coordinator serve --header-timeout` sets.
"""

from __future__ import annotations

import os

__all__ = ["HEADER_TIMEOUT_ENV", "HEADER_TIMEOUT_S", "HTTP_PROTOCOL", "header_timeout_s"]

HEADER_TIMEOUT_S = 30.0  # a header comes in one or two packets; 30 s leaves room for a saturated hospital link
HEADER_TIMEOUT_ENV = "CARDIOFL_HEADER_TIMEOUT_S"
HTTP_PROTOCOL = "coordinator.serving.header_deadline:HeaderDeadlineProtocol"  # uvicorn's `http` (workers import it)


def header_timeout_s() -> float:
    """The deadline in force: CARDIOFL_HEADER_TIMEOUT_S when set to a positive number, else HEADER_TIMEOUT_S."""
    try:
        value = float(os.environ.get(HEADER_TIMEOUT_ENV, ""))
    except ValueError:
        return HEADER_TIMEOUT_S
    return value if value > 0 else HEADER_TIMEOUT_S
