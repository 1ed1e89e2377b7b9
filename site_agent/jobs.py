"""A site's jobs: its survey, its external validations and its evaluations, each checked, run once and reported.

The worker (site_agent/worker.py) asks for jobs only in a poll that found no task to train: a job
never holds up a round, and at most one job runs per poll, so a task that comes meanwhile waits at
most one job. A secure round in progress takes every poll until it ends, jobs included.

Each job is taken only under the terms its site's operator approved for the study, exactly as the
job carries them (site_agent/approvals.py; a job is never approved from, auto_approve or not), and
only as those terms ask it of this site (site_agent/job_check.py). A job that fails is not run, and is
logged with the reason and remembered, so it is not tried again at every poll (there is no route to
decline a job; the coordinator keeps it listed). Then:

- survey: the exact survey of the agent's configured data sources (site_agent/data/survey.py), released
  as the terms say (shared/wire/survey_release.py: noise of `survey.noise_sigma`, suppression below
  `privacy.min_records`);
- external: theta^g_t with phi_0 on all the site's records, train and test (site_agent/released_evaluation.py);
- evaluate: the named model on the test split, and with phi adapted to the site when the terms ask
  (site_agent/adaptation.py); the adapted phi stays here, committed in the store under the study's key
  as its round 1 (an evaluate study has no rounds of its own).

Downloads are the client's sha256-checked bytes, decoded only when they match the study's schema
(site_agent/downloads.py). What leaves is a JobReport alone. Before it leaves it is kept in the
store's ledger of reports (`JOB_LEDGER`, a protected record: a restored older store is refused rather
than forget it), and a job listed again is answered with that very report, never run again: a survey
is released once (fresh noise would spend its epsilon twice), and each study's round is reported at
most once, whatever the coordinator asks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from shared.logs import log_context
from shared.study.rules import algorithm_exchange
from shared.tensors.codec import TensorDict
from shared.terms import StudyTerms
from shared.wire.jobs import JobKind, JobReport, SiteJob
from shared.wire.survey_release import release
from site_agent.adaptation import evaluate_with_adaptation
from site_agent.approvals import Approvals, approved_terms, study_key
from site_agent.client import CoordinatorClient
from site_agent.data import SiteData
from site_agent.data.config import DataSourceConfig
from site_agent.data.survey import survey_site
from site_agent.device import Runtime
from site_agent.downloads import download_global, download_initial_local
from site_agent.errors import IntegrityError, TaskMismatch, TaskRejected
from site_agent.job_check import job_problems
from site_agent.released_evaluation import released_summary
from site_agent.store import SiteStore

__all__ = ["ADAPTED_ROUND", "JOB_LEDGER", "JobRunner", "job_id", "reported_rounds", "sent_report"]

log = logging.getLogger(__name__)

JOB_LEDGER = "job-reports"  # the protected record of every report this site sent for a job, by job id
ADAPTED_ROUND = 1  # the round under which an evaluate study's adapted phi is committed in the store


def job_id(job: SiteJob) -> str:
    """A job's identity: its study (as the store names it), kind and round; one report each, ever."""
    return f"{study_key(job.study_id, job.study_uid)}/{job.kind.value}/{job.round}"


def _ledger(store: SiteStore) -> dict[str, str]:
    """Every report kept, as its JSON, by job id."""
    return dict((store.load_protected(JOB_LEDGER) or {}).get("reports", {}))


def sent_report(store: SiteStore, ident: str) -> JobReport | None:
    """The report this site kept for job `ident` before sending it, if any."""
    body = _ledger(store).get(ident)
    return JobReport.model_validate_json(body) if body is not None else None


def reported_rounds(store: SiteStore, study: str) -> list[int]:
    """The rounds of `study` (its store key) whose external validation this site reported, ascending."""
    prefix = f"{study}/{JobKind.EXTERNAL.value}/"
    return sorted(int(ident.removeprefix(prefix)) for ident in _ledger(store) if ident.startswith(prefix))


def _keep_report(store: SiteStore, ident: str, report: JobReport) -> None:
    """Keep `report` as job `ident`'s, before it is sent."""
    reports = _ledger(store)
    reports[ident] = report.model_dump_json()
    store.save_protected(JOB_LEDGER, {"reports": reports})


class JobRunner:
    """Checks, runs and reports one site's jobs, one per call of `run_next`."""

    def __init__(
        self,
        *,
        site: str,
        client: CoordinatorClient,
        store: SiteStore,
        approvals: Approvals,
        data: Callable[[], SiteData],
        runtime: Runtime,
        sources: Sequence[DataSourceConfig] = (),
    ) -> None:
        self.site, self.client, self.store, self.approvals = site, client, store, approvals
        self.data, self.runtime, self.sources = data, runtime, list(sources)
        self.refused: dict[str, str] = {}  # job id -> why this site did not run it (not tried again)
        self.reported: set[str] = set()  # job ids the coordinator took a report of in this process
        self.listing = True  # False once the coordinator said it has no jobs route (an older release)

    def run_next(self) -> bool:
        """Handle the first due job not handled before; False when there was none."""
        for job in self._due():
            ident = job_id(job)
            if ident in self.refused or ident in self.reported:
                continue
            with log_context(study=job.study_id, round=job.round or None, site=self.site):
                self.handle(job)
            return True
        return False

    def _due(self) -> list[SiteJob]:
        """The coordinator's list of this site's due jobs; none from a coordinator without the route."""
        if not self.listing:
            return []
        try:
            return self.client.jobs()
        except TaskRejected as exc:
            if exc.status == 404:
                self.listing = False
                log.warning("the coordinator lists no jobs (%s): surveys and evaluations cannot run here", exc)
            else:
                log.warning("the coordinator did not list this site's jobs: %s", exc)
            return []

    def handle(self, job: SiteJob) -> None:
        """Check `job`, run it (or take the report kept of it) and send the report; refuse it, saying why."""
        ident = job_id(job)
        key = study_key(job.study_id, job.study_uid)
        try:
            terms = approved_terms(self.approvals.decide(job), job.terms)
            problems = job_problems(job, terms, self.site, reported_rounds=reported_rounds(self.store, key))
            if problems:
                raise TaskMismatch("; ".join(problems))
            report = sent_report(self.store, ident)
            if report is None:
                report = self._run(job, terms, key)
                _keep_report(self.store, ident, report)
            else:
                log.info("study %d: %s job reported before; sending that report again", job.study_id, job.kind.value)
        except (TaskMismatch, IntegrityError, ValueError, OSError) as exc:  # shared's errors and PayloadError too
            self._refuse(ident, f"study {job.study_id}: its {job.kind.value} job{_of_round(job)} was not run: {exc}")
            return
        self._send(job, ident, report)

    def _refuse(self, ident: str, reason: str) -> None:
        """Log why job `ident` was not run or reported, and remember it."""
        log.warning("%s", reason)
        self.refused[ident] = reason

    def _send(self, job: SiteJob, ident: str, report: JobReport) -> None:
        """POST the report; the coordinator's refusal is logged and remembered (the kept report stays)."""
        try:
            self.client.report(job.report_url, report)
        except TaskRejected as exc:
            self._refuse(ident, f"study {job.study_id}: the coordinator refused its {job.kind.value} report: {exc}")
            return
        self.reported.add(ident)
        log.info("study %d: %s job%s reported", job.study_id, job.kind.value, _of_round(job))

    def _run(self, job: SiteJob, terms: StudyTerms, key: str) -> JobReport:
        """The report of a checked job, computed at the site."""
        if job.kind is JobKind.SURVEY:
            return self._survey(terms)
        global_tensors, initial_local = self._download(job, terms)
        if job.kind is JobKind.EXTERNAL:
            data = self.data()
            evaluation = released_summary(
                terms,
                self.site,
                job.round,
                global_tensors=global_tensors,
                initial_local=initial_local,
                splits=[data.train, data.test],
                runtime=self.runtime,
            )
            return JobReport(kind=JobKind.EXTERNAL, round=job.round, evaluation=evaluation)
        adapted = evaluate_with_adaptation(
            terms,
            self.site,
            global_tensors=global_tensors,
            initial_local=initial_local,
            data=self.data(),
            runtime=self.runtime,
        )
        if adapted.local is not None:
            self.store.save_local(key, ADAPTED_ROUND, adapted.local)
        return JobReport(
            kind=JobKind.EVALUATE, evaluation=adapted.before, adapted=adapted.after, adapt_records=adapted.adapt_records
        )

    def _survey(self, terms: StudyTerms) -> JobReport:
        """The survey of the configured sources, released as the terms say."""
        if not self.sources:
            raise TaskMismatch("this agent has no configured data sources (`[[data]]`) to survey")
        noise = terms.survey.noise_sigma if terms.survey is not None else None
        survey = release(survey_site(self.sources), min_records=terms.privacy.min_records, noise_sigma=noise)
        return JobReport(kind=JobKind.SURVEY, survey=survey)

    def _download(self, job: SiteJob, terms: StudyTerms) -> tuple[TensorDict, TensorDict]:
        """theta^g and phi_0 of the job, checked against their digests and the study's schema."""
        assert job.model_url and job.model_sha256 and job.initial_local_url and job.initial_local_sha256  # checked
        exchange = algorithm_exchange(terms.model.for_site(self.site), terms.algorithm)
        global_tensors = download_global(self.client, job.model_url, job.model_sha256, exchange)
        initial = download_initial_local(self.client, job.initial_local_url, job.initial_local_sha256, exchange)
        return global_tensors, initial


def _of_round(job: SiteJob) -> str:
    """The words " of round t" for an external validation, else nothing."""
    return f" of round {job.round}" if job.kind is JobKind.EXTERNAL else ""
