"""Children that end with the process that started them, however it ends (SIGKILL included), on Linux.

The demo starts a coordinator and site agents in sessions of their own (so
Ctrl-C reaches the parent alone, which then stops them in order). Were the parent killed outright,
nothing would stop them: they would keep a port and the demo's database open. On Linux each child
asks the kernel for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), and exits at once if the
parent is already gone by then; elsewhere the children are left as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent"]

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for Popen that makes the child get SIGTERM when this process dies; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child runs no loader between fork and exec

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            return  # the kernel refused: the child is left as it would be without this guard
        if os.getppid() != parent:  # the parent died before the request was made
            os._exit(1)

    return arm
