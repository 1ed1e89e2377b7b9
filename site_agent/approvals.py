"""The site operator's approvals: the agent trains only for studies whose description's digest was approved.

The digest is the site's own: `shared.study.description` derives, from the study's terms, what the
study would run and what would leave the site, and hashes that with the terms whole. The record
keeps the approved description, terms included, in the encrypted store: the site builds every round
from those terms. A study whose description changes (other terms, another cardiofl release that
uploads something else) has another digest, and needs approval again.

The operator may decline a study instead: the decline names the digest declined, when, by whom and
why (the reason stays at the site), and replaces an approval (revokes it). The site reports the
study `declined`, and a study whose description changed since awaits approval again. An approval
replaces a decline. The agent's declines of tasks are kept too, the last TASK_DECLINES_KEPT.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from shared.algorithms.registry import terms_plugin_problems
from shared.study.checks import check_study
from shared.study.description import StudyDescription, describe_study, terms_differences
from shared.terms import StudyTerms
from shared.wire.jobs import SiteJob
from shared.wire.protocol import ApprovalReport, StudyOffer, TaskSpec
from site_agent.client import CoordinatorClient
from site_agent.errors import AgentError, TaskMismatch
from site_agent.store import SiteStore

__all__ = [
    "Approvals",
    "Decision",
    "approved_terms",
    "record_task_decline",
    "recorded_terms",
    "study_key",
    "task_declines",
]

log = logging.getLogger(__name__)

APPROVED = "approved"
AWAITING = "awaiting_approval"
DECLINED = "declined"
DECLINE_RECORD = "decline"  # the operator's decline of a study, a small record of the study's
TASK_DECLINES = "task-declines"  # the agent's last declines of tasks, a small record of the store's
TASK_DECLINES_KEPT = 50
REASON_CHARS = 2_000


def study_key(study_id: int, study_uid: str) -> str:
    """Where the store keeps a study's state: its id for people, its uid so no other database's study meets it."""
    return f"{study_id}-{study_uid}"


@dataclass(frozen=True)
class Decision:
    """Where the site stands on one study: its description, the digest, and whether that digest is approved."""

    study_id: int
    key: str  # the store's key of the study
    description: StudyDescription
    digest: str
    approved: bool
    recorded: dict[str, Any] | None  # the stored approval, possibly of another digest (the study changed)
    decline: dict[str, Any] | None = None  # the stored decline, possibly of another digest (the study changed)

    @property
    def declined(self) -> bool:
        """The operator declined the study's current description."""
        return not self.approved and self.decline is not None and self.decline.get("digest") == self.digest

    @property
    def state(self) -> str:
        """What the site reports to the coordinator."""
        return APPROVED if self.approved else DECLINED if self.declined else AWAITING

    @property
    def outdated(self) -> bool:
        """An approval is recorded, but of another description: the study changed since."""
        return self.recorded is not None and not self.approved

    def approved_terms(self) -> StudyTerms | None:
        """The terms the recorded approval is of (None: no approval, or one recorded before terms were kept)."""
        return recorded_terms(self.recorded)


def approved_terms(decision: Decision, terms: StudyTerms) -> StudyTerms:
    """The terms the operator approved for the study of a task or job carrying `terms`; TaskMismatch saying why not."""
    approved = decision.approved_terms()
    if decision.approved and approved is not None:
        return approved
    if decision.declined:
        raise TaskMismatch(f"this site's operator declined study {decision.study_id}")
    if decision.recorded is None:
        raise TaskMismatch(f"this site's operator has not approved study {decision.study_id}")
    if approved is None:
        raise TaskMismatch("its approval predates this release's study terms: the operator must approve it again")
    changed = terms_differences(approved, terms)
    if changed:
        raise TaskMismatch(f"its terms differ from those this site's operator approved at {', '.join(changed)}")
    raise TaskMismatch("the study's description changed since it was approved (its uid, protocol or release)")


def recorded_terms(record: dict[str, Any] | None) -> StudyTerms | None:
    """The terms an approval record is of; None without a record, or for one recorded before terms were kept."""
    terms = (record or {}).get("description", {}).get("terms")
    return StudyTerms.model_validate(terms) if terms is not None else None


class Approvals:
    """Decides, records and reports the operator's approval of studies, for one site's store."""

    def __init__(
        self, store: SiteStore, *, auto_approve: bool = False, studies_command: str = "cardiofl site studies"
    ) -> None:
        self.store, self.auto_approve = store, auto_approve
        self.studies_command = studies_command  # as the operator pastes it: with the agent's --config, if any
        self._reported: dict[int, tuple[str, str]] = {}  # study id -> (state, digest) last told the coordinator

    def decide(self, source: TaskSpec | StudyOffer | SiteJob) -> Decision:
        """The site's decision on the study of a task, a job or an offer (with auto_approve, an offer is approved now).

        A task or a job is never approved here, auto_approve or not: it is taken only under terms an
        offer brought and the site approved, so a coordinator cannot slip other terms into either.
        """
        description = describe_study(source, self.store.site)
        digest = description.digest()
        key = study_key(source.study_id, source.study_uid)
        recorded = self.store.load_approval(key)
        approved = recorded is not None and recorded.get("digest") == digest
        decline = self.store.load_record(DECLINE_RECORD, key)
        declined = decline is not None and decline.get("digest") == digest
        if not (approved or declined) and self.auto_approve and isinstance(source, StudyOffer):
            try:
                recorded = self.approve(source, by="auto_approve", description=description)
                approved, decline = True, None
            except AgentError as exc:  # a plug-in this site lacks, or has of another identity: never auto-approved
                log.warning("%s", exc)
        return Decision(source.study_id, key, description, digest, approved, recorded, decline)

    def approve(
        self, source: TaskSpec | StudyOffer, *, by: str, description: StudyDescription | None = None
    ) -> dict[str, Any]:
        """Record the approval of the study's current description (`description`, when already built); the record."""
        description = description if description is not None else describe_study(source, self.store.site)
        terms = description.terms
        problems = [str(problem) for problem in check_study(terms)] + terms_plugin_problems(terms)
        if problems:  # the operator installs the study's plug-ins, of their very identities, first
            raise AgentError(f"study {source.study_id} cannot be approved here: {'; '.join(problems)}")
        record = {
            "study_id": source.study_id,
            "study_uid": source.study_uid,
            "digest": description.digest(),
            "approved_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "approved_by": by,
            "description": description.model_dump(mode="json"),
        }
        key = study_key(source.study_id, source.study_uid)
        self.store.save_approval(key, record)
        self.store.remove_record(DECLINE_RECORD, key)  # after the approval: a crash between leaves it approved
        log.info("study %d: approved (digest %s) by %s", source.study_id, record["digest"], by)
        return record

    def decline(
        self, source: TaskSpec | StudyOffer, *, by: str, reason: str, description: StudyDescription | None = None
    ) -> dict[str, Any]:
        """Record the decline of the study's current description, revoking any approval of it; the record.

        The reason stays at the site: the coordinator hears only that the study is declined.
        """
        reason = reason.strip()
        if not reason or len(reason) > REASON_CHARS:
            raise AgentError(f"a decline needs a reason of 1 to {REASON_CHARS} characters")
        description = description if description is not None else describe_study(source, self.store.site)
        key = study_key(source.study_id, source.study_uid)
        record = {
            "study_id": source.study_id,
            "study_uid": source.study_uid,
            "digest": description.digest(),
            "declined_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "declined_by": by,
            "reason": reason,
        }
        if self.store.load_approval(key) is not None:  # first: a crash before the decline leaves it unapproved
            self.store.remove_approval(key)
        self.store.save_record(DECLINE_RECORD, record, key)
        log.info("study %d: declined (digest %s) by %s", source.study_id, record["digest"], by)
        return record

    def declines(self) -> list[dict[str, Any]]:
        """The operator's recorded declines of studies, of whatever digest, by study key."""
        found = []
        for key in self.store.studies_with_record(DECLINE_RECORD):
            record = self.store.load_record(DECLINE_RECORD, key)
            if record is not None:
                found.append(record)
        return found

    def revoke(self, study_id: int, study_uid: str) -> bool:
        """Forget the approval of a study; True when there was one."""
        return self.store.remove_approval(study_key(study_id, study_uid))

    def report(self, client: CoordinatorClient, decision: Decision, *, told: ApprovalReport | None = None) -> bool:
        """Tell the coordinator the site's state on a study, unless it already knows it; whether it was told."""
        now = (decision.state, decision.digest)
        known = (told.state, told.digest) if told is not None else self._reported.get(decision.study_id)
        if known == now:
            self._reported[decision.study_id] = now
            return False
        client.report_approval(decision.study_id, ApprovalReport(state=decision.state, digest=decision.digest))
        self._reported[decision.study_id] = now
        if decision.declined:
            log.info("study %d: reported declined (digest %s)", decision.study_id, decision.digest)
        elif not decision.approved:
            log.warning(
                "study %d awaits this site's approval%s (digest %s): review it with `%s`, which prints the command "
                "that approves it (or decline it); until then this site trains for none of its rounds",
                decision.study_id,
                " again: its description changed" if decision.outdated else "",
                decision.digest,
                self.studies_command,
            )
        return True

    def sync(self, client: CoordinatorClient) -> list[Decision]:
        """Decide on every open study offered to this site and report each state the coordinator lacks: those told."""
        told = []
        for offer in client.offers():
            decision = self.decide(offer)
            if self.report(client, decision, told=offer.approval):
                told.append(decision)
        return told


def record_task_decline(store: SiteStore, *, round_id: int, reason: str, task: TaskSpec | None = None) -> None:
    """Keep the agent's decline of a task (its study and round when known, when, why): the last TASK_DECLINES_KEPT."""
    kept = task_declines(store)
    kept.append(
        {
            "round_id": round_id,
            "study_id": task.study_id if task is not None else None,
            "round": task.round if task is not None else None,
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
            "reason": reason[:REASON_CHARS],
        }
    )
    store.save_record(TASK_DECLINES, {"declines": kept[-TASK_DECLINES_KEPT:]})


def task_declines(store: SiteStore) -> list[dict[str, Any]]:
    """The agent's kept declines of tasks, oldest first."""
    record = store.load_record(TASK_DECLINES) or {}
    return list(record.get("declines", []))
