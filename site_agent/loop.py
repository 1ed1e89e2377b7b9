"""The agent's loop: poll, back off while the coordinator is unreachable, stop cleanly on request."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from shared.tensors.codec import PayloadError
from site_agent.backoff import exponential, jitter
from site_agent.errors import CoordinatorUnavailable, IntegrityError, TaskRejected, TokenRefused, Unauthorized
from site_agent.memory import hand_back_idle_memory
from site_agent.training import TrainingInterrupted
from site_agent.worker import SiteWorker

__all__ = ["Heartbeat", "run"]

log = logging.getLogger(__name__)


class Heartbeat:
    """The heartbeat file: the time of the last poll, also touched while a task trains and while backing off."""

    def __init__(self, path: Path | None, every_s: float) -> None:
        self.path, self.every_s = path, every_s

    def beat(self) -> None:
        """Write the time now (whole, then renamed over the old one: a reader never sees half of it)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(self.path.name + ".part")
        part.write_text(f"{time.time():.0f}\n")
        part.replace(self.path)

    def rest(self, stop: threading.Event, seconds: float) -> None:
        """Wait `seconds` (or until `stop`), beating every `every_s`: an agent backing off is alive."""
        end = time.monotonic() + seconds
        while not stop.is_set() and (left := end - time.monotonic()) > 0:
            if stop.wait(min(left, self.every_s)):
                return
            self.beat()

    def while_busy(self, worker: SiteWorker, done: threading.Event) -> threading.Thread:
        """A thread beating every `every_s` while the worker handles a task (a round that trains for long)."""

        def keep() -> None:
            while not done.wait(self.every_s):
                if worker.busy:
                    self.beat()

        thread = threading.Thread(target=keep, name="heartbeat", daemon=True)
        thread.start()
        return thread


def run(
    worker: SiteWorker,
    stop: threading.Event,
    *,
    poll_interval_s: float = 5.0,
    max_backoff_s: float = 300.0,
    heartbeat: Path | None = None,
    max_rounds: int | None = None,
) -> None:
    """Poll until `stop` is set (or `max_rounds` trained); back off only while the coordinator fails.

    First it asks the coordinator which site its token is (waiting for it like any poll), and a
    token of another site stops it (WrongSite, not caught), as does a token it refuses (TokenRefused:
    401, revoked or unknown). A store error (wrong key, tampered file) is not caught either: the agent
    must stop rather than overwrite anything. The heartbeat file is touched after every poll, and
    every `poll_interval_s` while a task trains or the agent backs off (Heartbeat).
    """
    beats = Heartbeat(heartbeat, poll_interval_s)
    done = threading.Event()
    if heartbeat is not None:
        beats.while_busy(worker, done)
    try:
        _loop(worker, stop, beats, poll_interval_s, max_backoff_s, max_rounds)
    finally:
        done.set()


def _loop(
    worker: SiteWorker,
    stop: threading.Event,
    beats: Heartbeat,
    poll_interval_s: float,
    max_backoff_s: float,
    max_rounds: int | None,
) -> None:
    """The polls of `run`."""

    def fresh_backoff() -> Iterator[float]:
        return exponential(poll_interval_s, factor=2.0, max_delay=max_backoff_s)

    failures = fresh_backoff()
    checked = False  # the token was found to be this site's
    settled = False
    waiting = False  # said once that there is nothing to do, until there is
    while not stop.is_set():
        delay = 0.0
        try:
            if not checked:  # once the coordinator answers: is the token this site's?
                worker.client.check_site(worker.site)
                checked = True
                log.info("the coordinator knows this token as site %s", worker.site)
            if not settled:  # after a restart: finish uploads that were pending when we stopped
                for study in worker.store.pending_studies():
                    worker.resend_pending(study)
                settled = True
            worked = worker.poll_once()
        except TrainingInterrupted as exc:
            log.info("stopping: %s; the round will be trained again after a restart", exc)
            return
        except CoordinatorUnavailable as exc:
            delay = next(failures)
            settled = False  # an upload refused for now (e.g. 503 buffer_releasing) is sent again first
            log.warning("coordinator unreachable (%s); retrying in about %.0fs", exc, delay)
        except TokenRefused:  # 401: no retry makes a revoked or unknown token good again
            raise
        except Unauthorized as exc:
            delay = max_backoff_s
            log.error(
                "the coordinator refused a request of this site (%s); retrying in about %.0fs",
                exc,
                delay,
            )
        except TaskRejected as exc:
            delay = poll_interval_s
            log.warning("task refused by the coordinator: %s", exc)
        except (IntegrityError, PayloadError) as exc:
            delay = next(failures)
            log.error("bad data from the coordinator (%s); retrying in about %.0fs", exc, delay)
        else:
            failures = fresh_backoff()
            delay = 0.0 if worked else poll_interval_s
            if not worked and not waiting:
                log.info("waiting: no task for site %s (no open study, or not selected this round)", worker.site)
                hand_back_idle_memory()  # the last round's buffers, kept for a next one that is not coming yet
            waiting = not worked
        beats.beat()
        if max_rounds is not None and worker.rounds_done >= max_rounds:
            log.info("trained %d round(s); stopping as asked", worker.rounds_done)
            return
        if delay:
            beats.rest(stop, jitter(delay))
