"""The agent's loop: poll, back off while the coordinator is unreachable, stop cleanly on request."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from shared.tensors.codec import PayloadError
from site_agent.backoff import exponential, jitter
from site_agent.errors import CoordinatorUnavailable, IntegrityError, TaskRejected, Unauthorized
from site_agent.training import TrainingInterrupted
from site_agent.worker import SiteWorker

__all__ = ["run"]

log = logging.getLogger(__name__)


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
    token of another site stops it (WrongSite, not caught). A store error (wrong key, tampered
    file) is not caught either: the agent must stop rather than overwrite anything.
    """

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
            log.warning("coordinator unreachable (%s); retrying in about %.0fs", exc, delay)
        except Unauthorized as exc:
            delay = max_backoff_s
            log.error(
                "the coordinator refused this site's token (%s): was it revoked or rotated? retrying in about %.0fs",
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
            waiting = not worked
        if heartbeat is not None:
            heartbeat.parent.mkdir(parents=True, exist_ok=True)
            heartbeat.write_text(f"{time.time():.0f}\n")
        if max_rounds is not None and worker.rounds_done >= max_rounds:
            log.info("trained %d round(s); stopping as asked", worker.rounds_done)
            return
        if delay:
            stop.wait(jitter(delay))
