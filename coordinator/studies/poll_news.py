"""What a site's wait for a task also watches: a study created, or a job outside rounds falling due, meanwhile.

`GET /tasks/next` holds a site's poll until it has a task. A job (a survey, an evaluation, a released
model to validate: coordinator/studies/jobs.py) is not a task, and a new study gives none until the
site's operator approved it; the agent asks for both after its poll. So that neither waits the poll
out (30 s by default), a poll with no task answers 204 as soon as one of them appears after it began,
saying which in OTHER_WORK_HEADER. A job is news against the due jobs the site's previous poll ended
with (in this process; else those due when this poll began), so one that fell due between two polls
ends the next at once; a job the site refused to run stays due and ends none (it would end every poll).
A study is news against the newest when the poll began: the agent decided on the studies just before.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from coordinator.models import Study
from coordinator.sites.security import Principal
from coordinator.studies.jobs import due_job_keys

__all__ = ["PollNews", "poll_news"]


@dataclass(frozen=True)
class PollNews:
    """What a site's poll compares over its wait: the newest study's id, and the jobs the site is due."""

    newest_study: int
    due_jobs: frozenset[tuple[int, int]]  # (study id, round)

    def knowing(self, jobs: frozenset[tuple[int, int]] | None) -> PollNews:
        """These figures, as a poll's start, for a site that knew of `jobs` (None: of those due now)."""
        return PollNews(newest_study=self.newest_study, due_jobs=self.due_jobs if jobs is None else jobs)

    def since(self, before: PollNews) -> str | None:
        """What appeared after `before`: "study" (one was created), "job" (one fell due), or None."""
        if self.newest_study > before.newest_study:
            return "study"
        if self.due_jobs - before.due_jobs:
            return "job"
        return None


def poll_news(session: Session, site: Principal) -> PollNews:
    """The newest study and the jobs `site` is due, as the database has them now."""
    newest = session.scalar(select(func.max(Study.id))) or 0
    return PollNews(newest_study=newest, due_jobs=due_job_keys(session, site))
