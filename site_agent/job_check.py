"""A site's check of a job against the terms its operator approved: what the job asks must be what the terms allow.

The coordinator may lie, as with tasks (site_agent/task_check.py). The worker takes a job only under
the terms its operator approved for the study (site_agent/approvals.py `approved_terms`: the digest of
the site's own description of the job's study), and then only a job those terms ask of this site:

- every job: addressed to this site, carrying the approved terms whole, reporting to its own report URL;
- survey: a survey study that lists the site among its `sites`; it downloads nothing;
- external: a training study that lists the site among its `validation_sites`, for a released round t with
  1 <= t <= the rounds the study can train (shared/study/accounting.py `trained_rounds`: T, or fewer under
  an epsilon budget), a multiple of `validation_every` or the study's final one; theta^g_t and phi_0 from the
  study's own URLs. The site cannot tell a failed or cancelled study's last round from another, so it takes
  one round that is not a multiple, its final one: a second one, or a round after it, is refused. With the
  site's ledger of reports (site_agent/jobs.py), a coordinator that lies extracts at most one report per
  released round, and one round off the schedule;
- evaluate: an evaluate study that lists the site among its `sites`, whose model and phi_0 are the very
  digests its terms name (`evaluation.model_sha256`, `evaluation.initial_local_sha256`).

`job_problems` names every difference; the worker runs nothing and sends nothing for a job with any.
"""

from __future__ import annotations

from collections.abc import Collection

from shared.study.accounting import trained_rounds
from shared.terms import StudyTerms
from shared.wire.jobs import JobKind, SiteJob, report_url
from shared.wire.urls import global_model_url, initial_local_url

__all__ = ["job_problems"]


def job_problems(job: SiteJob, approved: StudyTerms, site: str, *, reported_rounds: Collection[int] = ()) -> list[str]:
    """Why `job` is not one the `approved` terms ask of `site`; empty when it is.

    `reported_rounds` are the rounds of the study this site already sent an external report of (its ledger).
    """
    problems = []
    if job.terms != approved:
        problems.append("its terms are not the ones this site's operator approved")
    if job.site != site:
        problems.append(f"it is addressed to site {job.site!r}, not {site!r}")
    expected = report_url(job.study_id, job.kind, job.round if job.kind is JobKind.EXTERNAL else 0)
    if job.report_url != expected:
        problems.append(f"report_url is {job.report_url!r}, not {expected!r}")
    if job.kind is JobKind.SURVEY:
        problems += _survey_problems(job, approved, site)
    elif job.kind is JobKind.EXTERNAL:
        problems += _external_problems(job, approved, site, reported_rounds)
    else:
        problems += _evaluate_problems(job, approved, site)
    return problems


def _survey_problems(job: SiteJob, approved: StudyTerms, site: str) -> list[str]:
    """A survey study's site releases its survey once; nothing is downloaded for it."""
    problems = []
    if approved.kind != "survey":
        problems.append(f"a survey job of a {approved.kind} study")
    if site not in approved.sites:
        problems.append(f"the study's terms do not list {site!r} among its sites")
    if job.round != 0:
        problems.append(f"a survey names no round, the job names {job.round}")
    if any(url is not None for url in (job.model_url, job.model_sha256, job.initial_local_url)):
        problems.append("a survey downloads no model, the job names one")
    return problems


def _external_problems(job: SiteJob, approved: StudyTerms, site: str, reported: Collection[int]) -> list[str]:
    """A validation site evaluates a released theta^g_t due by the terms' schedule, from the study's own URLs."""
    problems = []
    if approved.kind != "train":
        problems.append(f"an external validation of a {approved.kind} study, which trains no model")
    if site not in approved.validation_sites:
        problems.append(f"the study's terms do not name {site!r} among its validation sites")
    problems += _round_problems(job.round, approved, reported)
    problems += _download_problems(job, global_model_url(job.study_id, job.round), initial_local_url(job.study_id))
    return problems


def _round_problems(number: int, approved: StudyTerms, reported: Collection[int]) -> list[str]:
    """Why round `number` is not due for external validation: outside the trained rounds, or off the schedule twice."""
    last = trained_rounds(approved)
    if not 1 <= number <= last:
        return [f"round {number} is not a round the study can release (1 to {last})"]
    every = approved.validation_every
    if number % every == 0 or number == last:
        final = [t for t in reported if t % every and t != last]
        if final and number > min(final):
            return [f"round {number} comes after round {min(final)}, which this site evaluated as the final one"]
        return []
    earlier = sorted(t for t in reported if t % every and t != last and t != number)
    if earlier:
        return [
            f"round {number} is not a multiple of validation_every {every}, and this site evaluated round "
            f"{earlier[0]} as the study's final one already"
        ]
    if any(t > number for t in reported):
        return [f"round {number} is off the schedule of every {every} rounds and not the last round evaluated here"]
    return []


def _evaluate_problems(job: SiteJob, approved: StudyTerms, site: str) -> list[str]:
    """A site of an evaluate study evaluates exactly the model (and phi_0) whose digests its terms name."""
    problems = []
    if approved.kind != "evaluate" or approved.evaluation is None:
        return [f"an evaluation job of a {approved.kind} study"]
    if site not in approved.sites:
        problems.append(f"the study's terms do not list {site!r} among its sites")
    if job.round != 0:
        problems.append(f"an evaluation names no round, the job names {job.round}")
    spec = approved.evaluation
    for name, named, sent in (
        ("model", spec.model_sha256, job.model_sha256),
        ("phi_0", spec.initial_local_sha256, job.initial_local_sha256),
    ):
        if named is None:
            problems.append(f"the terms name no digest of the evaluated {name}")
        elif sent != named:
            problems.append(f"the job's {name} digest {str(sent)[:12]} is not the terms' {named[:12]}")
    if job.model_url is None or job.initial_local_url is None:
        problems.append("the job names no URL of the model and phi_0 to download")
    return problems


def _download_problems(job: SiteJob, model: str, initial: str) -> list[str]:
    """The job's model and phi_0 are the study's own URLs, each with a digest."""
    problems = []
    if job.model_url != model or job.model_sha256 is None:
        problems.append(f"its model is {job.model_url!r} (digest {job.model_sha256!r}), not the study's {model!r}")
    if job.initial_local_url != initial or job.initial_local_sha256 is None:
        problems.append(f"its phi_0 is {job.initial_local_url!r}, not the study's {initial!r}")
    return problems
