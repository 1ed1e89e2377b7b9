"""How far a grid is: runs done, running, failed and queued, the ETA at the pace so far, the cluster's dashboard."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["GridTally"]


@dataclass
class GridTally:
    """The runs of one `experiment run`: what the runner tells it as runs finish and fail.

    `slots` is how many runs go at once: one in this process, the worker processes (--jobs) or, on Ray,
    as many as the cluster's resources fit; `running` is as many of the runs left. The ETA is the pace
    of this call (its elapsed time per run ended here, done or failed) times the runs left, so it counts
    the parallelism.
    """

    total: int
    done: int  # runs finished, those finished before this call included
    say: Callable[[str], None] = lambda line: None  # a line for the user: a run ended, the dashboard
    slots: int = 0  # runs at once; 0 before the runs start
    failed: int = 0
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._done_before = self.done

    @property
    def left(self) -> int:
        """Runs not ended yet: running or queued."""
        return self.total - self.done - self.failed

    @property
    def running(self) -> int:
        """Runs under way: as many of those left as there are slots."""
        return min(self.slots, self.left)

    @property
    def queued(self) -> int:
        """Runs not started yet."""
        return self.left - self.running

    @property
    def ended_here(self) -> int:
        """Runs that ended in this call, done or failed."""
        return self.done - self._done_before + self.failed

    def cluster(self, dashboard: str) -> None:
        """The Ray cluster's dashboard, said once."""
        self.say(f"Ray dashboard: {dashboard}")

    def run_finished(self, run: str) -> None:
        """A run's records are written: said with the tally (a batch job's log shows no live bar)."""
        self.done += 1
        self.say(f"run {run} finished · {self.line()}")

    def run_failed(self, run: str, error: BaseException) -> None:
        """A run ended in `error` (after its retries): said, counted, the grid goes on."""
        self.failed += 1
        self.say(f"run {run} failed: {type(error).__name__}: {error} · {self.line()}")

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at this call's pace; None before a run has ended here."""
        if not self.ended_here:
            return None
        elapsed = (time.monotonic() if now is None else now) - self.started
        return elapsed / self.ended_here * self.left

    def line(self, now: float | None = None) -> str:
        """E.g. "5/8 done · 2 running · 1 failed · 0 queued · ETA 0:04:10"."""
        left = self.eta(now)
        eta = "ETA --" if left is None else f"ETA {timedelta(seconds=round(left))}"
        parts = [f"{self.done}/{self.total} done", f"{self.running} running", f"{self.failed} failed"]
        return " · ".join([*parts, f"{self.queued} queued", eta])
