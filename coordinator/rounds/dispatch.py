"""Which workflow a study's rounds run: secure aggregation in its terms, or plain rounds; the one place that asks."""

from __future__ import annotations

from sqlalchemy import ColumnElement, or_

from coordinator.rounds.plain import PlainWorkflow
from coordinator.rounds.secure import SecureWorkflow
from coordinator.rounds.workflow import RoundWorkflow
from shared.terms import StudyTerms

__all__ = ["WORKFLOWS", "offerable", "workflow_for"]

PLAIN, SECURE = PlainWorkflow(), SecureWorkflow()
WORKFLOWS: tuple[RoundWorkflow, ...] = (PLAIN, SECURE)


def workflow_for(terms: StudyTerms) -> RoundWorkflow:
    """The workflow of every round of a study with `terms`."""
    return SECURE if terms.privacy.secure_aggregation is not None else PLAIN


def offerable(site_id: int) -> ColumnElement[bool]:
    """SQL: an open round of any workflow that may still be offered to the site."""
    return or_(*(workflow.offerable(site_id) for workflow in WORKFLOWS))
