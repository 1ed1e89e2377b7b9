"""How far a grid is: runs done, running, failed and queued, the ETA at the pace so far, the cluster's dashboard."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["GridTally"]


@dataclass
class GridTally:
    """The runs of one `experiment run`: what the runner tells it as runs start, finish and fail.

    `running` is what runs at once: one in this process, the worker processes' (--jobs) or, on Ray, as
    many as the cluster's resources fit, each with the runs left. The ETA is the pace of this call (its
    elapsed time per run ended here, done or failed) times the runs left, so it counts the parallelism.
    """

    total: int
    done: int  # runs finished, those finished before this call included
    say: Callable[[str], None] = lambda line: None  # a line for the user: a failed run, the dashboard
    running: int = 0
    failed: int = 0
    ended_here: int = 0
    started: float = field(default_factory=time.monotonic)
    dashboard: str | None = None

    @property
    def queued(self) -> int:
        """Runs not started yet."""
        return max(0, self.total - self.done - self.failed - self.running)

    def cluster(self, dashboard: str) -> None:
        """The Ray cluster's dashboard, said once."""
        self.dashboard = dashboard
        self.say(f"Ray dashboard: {dashboard}")

    def run_finished(self, run: str) -> None:
        """A run's records are written: said with the tally (a batch job's log shows no live bar)."""
        self.done += 1
        self.ended_here += 1
        self.say(f"run {run} finished · {self.line()}")

    def run_failed(self, run: str, error: BaseException) -> None:
        """A run ended in `error` (after its retries): said, counted, the grid goes on."""
        self.failed += 1
        self.ended_here += 1
        self.say(f"run {run} failed: {type(error).__name__}: {error} · {self.line()}")

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at this call's pace; None before a run has ended here."""
        if not self.ended_here:
            return None
        elapsed = (time.monotonic() if now is None else now) - self.started
        return elapsed / self.ended_here * (self.total - self.done - self.failed)

    def line(self, now: float | None = None) -> str:
        """E.g. "5/8 done · 2 running · 1 failed · 0 queued · ETA 0:04:10"."""
        left = self.eta(now)
        eta = "ETA --" if left is None else f"ETA {timedelta(seconds=round(left))}"
        parts = [f"{self.done}/{self.total} done", f"{self.running} running", f"{self.failed} failed"]
        return " · ".join([*parts, f"{self.queued} queued", eta])
