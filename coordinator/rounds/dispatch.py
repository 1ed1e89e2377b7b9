"""Which workflow a study's rounds run: secure aggregation or buffers in its terms, else plain; asked here only."""

from __future__ import annotations

from sqlalchemy import ColumnElement, or_

from coordinator.rounds.buffered import BufferedWorkflow
from coordinator.rounds.plain import PlainWorkflow
from coordinator.rounds.secure import SecureWorkflow
from coordinator.rounds.workflow import RoundWorkflow
from shared.terms import StudyTerms

__all__ = ["WORKFLOWS", "offerable", "workflow_for"]

PLAIN, SECURE, BUFFERED = PlainWorkflow(), SecureWorkflow(), BufferedWorkflow()
WORKFLOWS: tuple[RoundWorkflow, ...] = (PLAIN, SECURE, BUFFERED)


def workflow_for(terms: StudyTerms) -> RoundWorkflow:
    """The workflow of every round of a study with `terms`."""
    if terms.privacy.secure_aggregation is not None:
        return SECURE
    return BUFFERED if terms.buffered is not None else PLAIN


def offerable(site_id: int) -> ColumnElement[bool]:
    """SQL: an open round of any workflow that may still be offered to the site."""
    return or_(*(workflow.offerable(site_id) for workflow in WORKFLOWS))
