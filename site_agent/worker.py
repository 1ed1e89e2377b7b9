"""The agent's work for one poll: finish a pending upload, or train for the next task and upload.

Consent: the agent trains only for studies its operator approved (site_agent/approvals.py). Before
each poll it reports its state on every open study that lists it, so the coordinator offers tasks
of approved studies alone. Every task is checked against the terms the operator approved
(site_agent/task_check.py); one of another study, or whose terms or round facts disagree with
them, is declined with the reason (POST decline_url, the coordinator's `task.declined`), and
nothing is trained or sent for it; the store keeps the last declines, for the approval page.

Crash safety: the trained phi_k and the exact upload bytes are written to the encrypted store
before sending; phi_k is committed only once the coordinator acknowledged the upload. A restarted
agent re-sends a pending upload (same bytes, so the coordinator's answer is the same receipt)
instead of retraining, and a round the coordinator did not accept never changes phi_k.

Each task's round is a workflow chosen once (site_agent/site_rounds.py: plain training, the final
evaluation, or either under secure aggregation); the worker gives it its inputs and delivers through it.
The upload is sent from the bytes just encoded; the store's copy is read back only after a restart.

Secure rounds (site_agent/secure_round.py): after training the worker advertises and keeps the
round's state; each later poll advances its phase by one step instead of asking for a new task,
until the round has ended. The masked upload goes through the same pending-update path.

Jobs (site_agent/jobs.py: a survey, an external validation, an evaluation) are asked for only in a
poll that found no task, one job per poll, so training rounds keep the agent's attention.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from shared.errors import MetricsError
from shared.logs import log_context
from shared.privacy.signing import fingerprint
from shared.study.rules import algorithm_exchange
from shared.tensors.codec import content_digest
from shared.tensors.update_body import encode_update
from shared.wire.protocol import PROTOCOL_VERSION, RoundKind, TaskSpec
from shared.wire.urls import decline_url
from site_agent.approvals import Approvals, approved_terms, record_task_decline
from site_agent.client import CoordinatorClient
from site_agent.data import SiteData
from site_agent.data.config import DataSourceConfig
from site_agent.device import Runtime
from site_agent.downloads import download_global, download_initial_local
from site_agent.errors import TaskMismatch, TaskRejected, TaskUnreadable
from site_agent.identity import site_identity
from site_agent.jobs import JobRunner
from site_agent.ledger import record_revealed, record_use, revealed_attempt, used_from
from site_agent.local_round import LocalRoundResult, LocalRoundSpec
from site_agent.secure_round import SecureRound
from site_agent.site_rounds import RoundInputs, SiteRound, site_round_for
from site_agent.store import PendingUpdate, SiteStore, StoreError
from site_agent.task_check import check_task, replay_problem
from site_agent.training import Progress

__all__ = ["SiteWorker"]

log = logging.getLogger(__name__)


class SiteWorker:
    """Turns tasks into uploads for one site; holds no loop and no sleeps (see site_agent.loop)."""

    def __init__(
        self,
        *,
        site: str,
        client: CoordinatorClient,
        store: SiteStore,
        data: Callable[[], SiteData],
        runtime: Runtime,
        progress_bar: bool | None = None,
        stop: threading.Event | None = None,
        auto_approve: bool = False,
        sources: Sequence[DataSourceConfig] = (),
        studies_command: str = "cardiofl site studies",
    ) -> None:
        self.site, self.client, self.store, self.runtime = site, client, store, runtime
        self.approvals = Approvals(store, auto_approve=auto_approve, studies_command=studies_command)
        self._open_data = data
        self._data: SiteData | None = None
        self.progress_bar = progress_bar
        self.stop = stop
        self.rounds_done = 0
        self.busy = False  # True while a task is handled: a stop request then waits for a step boundary
        self.secure: SecureRound | None = None  # a secure round this site takes part in, until it ends
        self.declined: dict[int, str] = {}  # round attempt id -> why this site declined its task
        self.identity = site_identity(store)  # the site's long-term signing key, made at its first start
        self.registered = False  # the coordinator has the identity's public key
        self.jobs = JobRunner(  # surveys, external validations, evaluations (`sources`: what a survey counts)
            site=site,
            client=client,
            store=store,
            approvals=self.approvals,
            data=lambda: self.data,
            runtime=runtime,
            sources=sources,
        )

    def register_identity(self) -> None:
        """Register the site's signing key with the coordinator (once; the same key again is a no-op)."""
        if self.registered:
            return
        try:
            self.client.register_signing_key(self.identity.public_hex())
            log.info("this site's signing key: fingerprint %s", fingerprint(self.identity.public_hex()))
        except TaskRejected as exc:  # another key is registered for this site: its secure rounds will be declined
            log.error("the coordinator refused this site's signing key (%s): secure studies cannot run here", exc)
        self.registered = True

    @property
    def data(self) -> SiteData:
        """The site's data, opened (and cached) on first use."""
        if self._data is None:
            self._data = self._open_data()
        return self._data

    # -- pending uploads -------------------------------------------------------------------

    def resend_pending(self, study: str) -> bool:
        """Re-send a pending upload of `study` from the store (after a restart); True when one was settled.

        An upload whose study's approval was revoked meanwhile stays in the store, unsent.
        """
        pending = self.store.load_pending(study)
        if pending is None:
            return False
        if self.store.load_approval(study) is None:
            log.warning("study %s round %d: the pending upload stays unsent: not approved", study, pending.round)
            return False
        self._settle(study, pending.round, str(pending.meta["update_url"]), pending.upload, resuming=True)
        return True

    def _settle(self, study: str, round_: int, url: str, body: bytes | bytearray, *, resuming: bool = False) -> None:
        """Upload a pending update's bytes: commit phi_k once accepted, discard the update when refused.

        `resuming` (a pending upload re-sent): the upload goes on from the bytes the coordinator holds of it.
        """
        try:
            receipt = self.client.upload(url, body, resuming=resuming)
        except TaskRejected as exc:
            log.warning("study %s round %d: pending upload refused (%s); discarding it", study, round_, exc)
            self.store.discard_pending(study)
            return
        self.store.commit_pending(study)
        log.info("study %s round %d: pending upload accepted (%s); phi_k committed", study, round_, receipt.sha256)

    # -- tasks -----------------------------------------------------------------------------

    def poll_once(self) -> bool:
        """Report approvals, then handle at most one task, else one job; False when there was nothing for this site.

        A job is asked for only when the coordinator had no task (site_agent/jobs.py): rounds come first.
        """
        self.register_identity()
        approved_now = any(decision.approved for decision in self.approvals.sync(self.client))
        if self.secure is not None:
            return self._step_secure(self.secure)
        try:  # a study approved just now may have a job due already: no wait for a task then
            task = self.client.next_task(wait_s=0.0 if approved_now else None)
        except TaskUnreadable as exc:
            if exc.round_id is not None:
                self._decline(exc.round_id, f"the task is not a valid protocol {PROTOCOL_VERSION} task: {exc}")
            else:
                log.warning("the coordinator sent a task that names no round; ignored: %s", exc)
            return False
        if task is None:
            return self.jobs.run_next()
        if task.round_id in self.declined:
            self._decline(task.round_id, self.declined[task.round_id])  # offered again: say so again
            return False
        self.busy = True
        try:
            with log_context(study=task.study_id, round=task.round, site=self.site):  # JSON lines name the task
                self.handle(task)
        finally:
            self.busy = False
        return True

    def handle(self, task: TaskSpec) -> None:
        """Train for `task` and upload, unless a pending upload of the same round attempt is re-sent.

        The site takes a task only from the terms its operator approved, and declines one whose
        terms or round facts disagree with them (site_agent/task_check.py): nothing is trained,
        downloaded or uploaded for it.
        """
        decision = self.approvals.decide(task)
        site_round = site_round_for(task)  # the one place that asks which kind of round this is
        try:
            revealed = revealed_attempt(self.store, decision.key, task.round)
            used = used_from(self.store, task.global_model_sha256) if site_round.secure else None
            approved = approved_terms(decision, task.terms)
            key = self.identity.public_hex()
            trained = max(self.store.local_rounds(decision.key), default=None)
            spec = check_task(task, approved, self.site, signing_key=key, revealed=revealed, used=used, trained=trained)
        except TaskMismatch as exc:
            self._decline(task.round_id, f"study {task.study_id} round {task.round}: {exc}", task)
            return
        study = decision.key
        if site_round.secure:  # before theta^g is downloaded: this site's one secure round from it
            record_use(self.store, study, task.round, task.global_model_sha256)
        if self.store.load_pending(study) is not None:
            # this round attempt's upload again, or an older round's settled first: then the next poll says what
            # is asked now (in a buffered study the older update may have joined this very round)
            self.resend_pending(study)
            return
        try:
            inputs = self._inputs(task, spec, study, site_round)
            result = site_round.compute(inputs)
        except MetricsError as exc:  # e.g. a released model whose predictions are not finite: nothing to report
            self._decline(
                task.round_id, f"study {task.study_id} round {task.round}: the model gave no valid scores: {exc}", task
            )
            return
        except TaskMismatch as exc:  # theta^g's tensors were those of an earlier secure round: nothing trained
            self._decline(task.round_id, f"study {task.study_id} round {task.round}: {exc}", task)
            return
        site_round.deliver(self, inputs, result)

    def _inputs(self, task: TaskSpec, spec: LocalRoundSpec, study: str, site_round: SiteRound) -> RoundInputs:
        """theta^g_{t-1} and phi_0 downloaded, phi_k from the store (phi_0 on a site's first round)."""
        exchange = algorithm_exchange(spec.model, spec.algorithm)
        global_tensors = download_global(self.client, task.global_model_url, task.global_model_sha256, exchange)
        if site_round.secure:
            self._claim_secure_use(task, study, content_digest(global_tensors))
        initial_local = download_initial_local(self.client, task.initial_local_url, task.initial_local_sha256, exchange)
        committed = self.store.load_local_before(study, task.round)
        return RoundInputs(
            task=task,
            spec=spec,
            study=study,
            partition=exchange.partition,
            global_tensors=global_tensors,
            local_tensors=committed[1] if committed is not None else initial_local,
            initial_local=initial_local,
            data=self.data,
            runtime=self.runtime,
            progress=lambda total, what: Progress(total, what, bar=self.progress_bar),
            stop=self.stop,
        )

    # -- RoundHost: what a round delivers through -------------------------------------------

    def send(self, inputs: RoundInputs, result: LocalRoundResult) -> int:
        """Store the plain update as pending and upload it; the bytes sent."""
        return len(self._send(inputs.task, inputs.study, result))

    def start_secure(self, inputs: RoundInputs, result: LocalRoundResult) -> None:
        """Advertise this round's keys and scalars; later polls take the round's next phases."""
        study = inputs.study

        def revealed(round_: int, attempt: int) -> None:
            record_revealed(self.store, study, round_, attempt)

        secure = SecureRound(inputs.task, inputs.spec, study, result, self.identity, revealed, inputs.global_tensors)
        secure.advertise(self.client)
        self.secure = secure

    def trained(self) -> None:
        """One more round trained and uploaded."""
        self.rounds_done += 1

    def _claim_secure_use(self, task: TaskSpec, study: str, content: str) -> None:
        """theta^g's tensors, whatever metadata wraps them, feed one secure round here; TaskMismatch if used."""
        key = f"tensors:{content}"
        problem = replay_problem(task, used_from(self.store, key), f"theta^g's tensors {content[:12]}")
        if problem is not None:
            raise TaskMismatch(problem)
        record_use(self.store, study, task.round, key)

    def _decline(self, round_id: int, reason: str, task: TaskSpec | None = None) -> None:
        """Tell the coordinator this site will not do the round's task, and why; remember it, in the store too."""
        log.warning("declined the task of round attempt %d: %s", round_id, reason)
        if round_id not in self.declined:  # a task offered again is declined again, but kept once
            try:
                record_task_decline(self.store, round_id=round_id, reason=reason, task=task)
            except (StoreError, OSError) as exc:  # the decline still goes out; only its history misses it
                log.warning("the decline of round attempt %d was not kept in the store: %s", round_id, exc)
        self.declined[round_id] = reason
        try:
            self.client.decline(decline_url(round_id), reason)
        except TaskRejected as exc:
            log.warning("the coordinator did not take the decline of round attempt %d: %s", round_id, exc)

    def _send(
        self, task: TaskSpec, study: str, result: LocalRoundResult, body: bytes | bytearray | None = None
    ) -> bytes | bytearray:
        """Write the pending update (phi_k and the exact bytes: by default the plain update) to the store, send them.

        The bytes are sent as held; the store's copy is read back only by a restarted agent (`resend_pending`).
        """
        body = body if body is not None else encode_update(result.shared, result.meta)
        meta = {"round_id": task.round_id, "update_url": task.update_url, "num_examples": result.meta.num_examples}
        self.store.save_pending(study, PendingUpdate(task.round, body, result.local, meta))
        self._settle(study, task.round, task.update_url, body)
        return body

    def _step_secure(self, secure: SecureRound) -> bool:
        """One step of the secure round in progress; True when something was sent or the round ended."""

        def send(body: bytes | bytearray) -> None:
            self._send(secure.task, secure.study, secure.result, body)
            trains = secure.task.kind is RoundKind.TRAIN
            if trains:
                self.trained()
            what = "update" if trains else "final evaluation"
            log.info("study %s round %d: masked %s uploaded", secure.task.study_id, secure.task.round, what)

        try:
            with log_context(study=secure.task.study_id, round=secure.task.round, site=self.site):
                worked = secure.step(self.client, send)
        except TaskMismatch as exc:
            self.secure = None
            self._decline(
                secure.task.round_id, f"study {secure.task.study_id} round {secure.task.round}: {exc}", secure.task
            )
            return True
        if secure.finished:
            self.secure = None
        return worked
