"""Accepting a site's update: validated against what its round's workflow takes before anything is stored.

Refusals, in the order checked: not a participant, or no such round (403, before the route reads
the body: coordinator/api/deps.py `round_participant`); an accepted update with other bytes
(409 update_conflict; equal bytes return the first receipt); round no longer open (409); malformed
safetensors, private (phi_k) names or, with per-site head splits, non-zero values of the heads the
site keeps local (422 private_tensors_in_payload), other unexpected or missing names, shapes, dtypes (422, the
shared.tensors.codec code); missing or invalid UpdateMeta, n_k <= 0 or absurd, a per-site report holding
more than scalars, a learned-heads usage of the wrong shape or outside [0, 1], or one where the study
learns no heads (422 invalid_update_meta); NaN/Inf (422 non_finite_values); malformed evaluation
statistics, or counts and histograms of fewer test records than the study's privacy.min_records (422
invalid_metrics). Every refusal is an audit event; a private name is recorded as a privacy violation.

What a round takes is its workflow's (`UploadRules`, coordinator/rounds/plain.py and secure.py).
In a secure round the update is the site's masked ring vector (coordinator/rounds/secure.py): it
is taken only in phase 2 (409 wrong_phase), from a site that shared its secrets in phase 1 (403
not_in_phase), holding exactly `secagg.masked` of the round's length, no statistics in the clear
and the n_k the site advertised (422).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session, sessionmaker

from coordinator import audit
from coordinator.errors import (
    BufferReleasing,
    InvalidUpload,
    NotAParticipant,
    RoundClosed,
    UpdateConflict,
    WrongPhase,
)
from coordinator.models import Round, RoundKind, RoundStatus, Study, Update
from coordinator.rounds.dispatch import workflow_for
from coordinator.rounds.workflow import RoundWorkflow, UploadRules
from coordinator.sites.security import Principal
from coordinator.storage.blobs import blob_store_of, put_update_blob, sha256_of
from coordinator.storage.update_files import IncomingBlob
from shared.algorithms.head_splits import unused_heads_leaked
from shared.evaluation.summaries import check_reports, site_summaries
from shared.study.rules import algorithm_model
from shared.study.server_round import SiteReport, round_weights
from shared.tensors.codec import (
    Header,
    PayloadError,
    PrivateTensorsInPayload,
    check_finite,
    check_header,
    read_header,
    tensor_views,
)
from shared.terms import StudyTerms
from shared.wire.protocol import MIN_PROTOCOL_VERSION, UpdateMeta, UpdateReceipt

__all__ = ["HEADER_ALLOWANCE_BYTES", "accept_update", "admit_upload_session", "record_upload_refusal", "upload_limit"]

# Beyond its tensors, an update holds its safetensors header: names, shapes, offsets, and the UpdateMeta
# (n_k, metrics, evaluation statistics). A few kB for the paper model; this leaves room for far more.
HEADER_ALLOWANCE_BYTES = 8 << 20


@dataclass(frozen=True)
class _Admitted:
    """An upload admitted to have its bytes checked: its round's facts and workflow."""

    study_id: int
    number: int  # of the round the update joins (in a buffered study, maybe not the one whose task it answers)
    kind: str
    terms: StudyTerms
    workflow: RoundWorkflow
    round_id: int  # the round it joins
    base_round: int | None  # buffered studies: the version it trained from


def accept_update(
    session: Session,
    *,
    round_id: int,
    site: Principal,
    body: bytes | bytearray | memoryview,
    max_num_examples: int,
    now: datetime,
    digest: str | None = None,
    incoming: IncomingBlob | None = None,
) -> tuple[UpdateReceipt, bool]:
    """Store one site's update for an open round; returns (receipt, whether it is new).

    `digest` is the body's sha256 when the caller has it already (hashed while it arrived), and
    `incoming` the file it was spooled to, renamed into the blob store rather than copied.
    """
    assert site.site_id is not None and site.site_name is not None
    digest = digest or sha256_of(body)
    admitted = _admit(session, round_id, site, digest)
    if isinstance(admitted, UpdateReceipt):
        return admitted, False
    session.rollback()  # checking the bytes holds no lock
    try:
        rules = admitted.workflow.upload_rules(admitted.terms, admitted.kind)
        trains = admitted.kind == RoundKind.TRAIN
        meta, summary = _checked(body, admitted.terms, rules, max_num_examples, site.site_name, trains=trains)
        admitted.workflow.check_upload(session, round_id, site.site_name, meta)
    except InvalidUpload as exc:
        _record_refusal(session, exc, site, admitted.study_id, round_id, digest)
        raise
    return _store(session, admitted, round_id, site, body, digest, meta, summary, now=now, incoming=incoming)


def admit_upload_session(session: Session, *, round_id: int, site: Principal, digest: str) -> UpdateReceipt | None:
    """None when the site may start sending update `digest` in chunks; its receipt when these bytes came already.

    The refusals are those an upload of the whole body meets before its bytes are checked (`_admit`).
    """
    admitted = _admit(session, round_id, site, digest)
    session.rollback()
    return admitted if isinstance(admitted, UpdateReceipt) else None


def upload_limit(session: Session, round_id: int, ceiling: int | None) -> int:
    """The largest body an update of round `round_id` may have: the tensors its terms declare, and the header's room.

    A study's terms fix every tensor of its updates (UploadRules.schema: theta^g's, or under secure
    aggregation the masked encoding), so a model of any size takes part and no body larger than its
    own can be sent; `ceiling`, when set, is the operator's cap on any body. A round that is not
    there gets the header's room only: its upload is refused before its bytes are read.
    """
    round_ = session.get(Round, round_id)
    study = session.get(Study, round_.study_id) if round_ is not None else None
    declared = HEADER_ALLOWANCE_BYTES
    if round_ is not None and study is not None:
        rules = workflow_for(study.terms).upload_rules(study.terms, round_.kind)
        declared += sum(spec.nbytes for spec in rules.schema.values())
    session.rollback()
    return declared if ceiling is None else min(declared, ceiling)


def _admit(session: Session, round_id: int, site: Principal, digest: str) -> _Admitted | UpdateReceipt:
    """The round's facts when it may take the site's update now; the first receipt when these bytes came already."""
    assert site.site_id is not None and site.site_name is not None
    round_ = session.get(Round, round_id)
    if round_ is None or site.site_name not in round_.participants:  # alike: a site learns no other round's id
        raise NotAParticipant.of_round(site.site_name, round_id)
    existing = _answer(session, round_id, site.site_id)
    if existing is not None:
        return _same_bytes_receipt(session, existing, digest, site.site_name)
    study = session.get(Study, round_.study_id)
    assert study is not None
    workflow = workflow_for(study.terms)
    target, base = workflow.route_upload(session, round_, study.terms)  # a buffered study's open buffer
    if target.status != RoundStatus.OPEN:
        raise RoundClosed(f"round {round_id} is {round_.status}")
    workflow.admit_upload(session, target, site.site_name)
    return _Admitted(target.study_id, target.number, target.kind, study.terms, workflow, target.id, base)


def _store(
    session: Session,
    admitted: _Admitted,
    round_id: int,
    site: Principal,
    body: bytes | bytearray | memoryview,
    digest: str,
    meta: UpdateMeta,
    summary: dict[str, Any],
    *,
    now: datetime,
    incoming: IncomingBlob | None,
) -> tuple[UpdateReceipt, bool]:
    """With the round row locked: still taking updates? Then the blob, the update row and its audit event.

    `round_id` is the round whose task the update answers; it joins `admitted.round_id` (the same, but
    in a buffered study whose round was released since).
    """
    assert site.site_id is not None and site.site_name is not None
    round_ = session.scalar(select(Round).where(Round.id == admitted.round_id).with_for_update())
    assert round_ is not None
    existing = _answer(session, round_id, site.site_id)  # a concurrent upload of the same site
    if existing is not None:
        session.rollback()
        return _same_bytes_receipt(session, existing, digest, site.site_name), False
    try:
        if round_.status != RoundStatus.OPEN and admitted.base_round is not None:
            raise BufferReleasing(f"round {round_.id} was released while the update was checked: send it again")
        if round_.status != RoundStatus.OPEN:
            raise RoundClosed(f"round {round_id} closed while the update was checked")
        joins_later = round_.id != round_id  # a buffered update joining a later buffer than its task's
        if joins_later and _accepted(session, round_.id, site.site_id) is not None:  # one update of a site a buffer
            raise UpdateConflict(f"site {site.site_name!r} has an update in round {round_.number}: send it later")
        admitted.workflow.still_accepting(round_)
    except (RoundClosed, WrongPhase, BufferReleasing, UpdateConflict):
        session.rollback()
        raise
    put_update_blob(session, blob_store_of(session), body, digest, incoming=incoming)
    buffered = admitted.base_round is not None
    update = Update(
        round_id=round_.id,
        site_id=site.site_id,
        sha256=digest,
        size=len(body),
        num_examples=meta.num_examples,
        metrics=meta.metrics.model_dump(mode="json"),
        summary=summary,
        train_seconds=meta.train_seconds,
        received_at=now,
        task_round_id=round_id if buffered else None,
        base_round=admitted.base_round,
    )
    session.add(update)
    session.flush()
    audit.record(
        session,
        "update.accepted",
        actor=site.actor,
        study_id=admitted.study_id,
        round_id=round_.id,
        site_id=site.site_id,
        digest=digest,
        num_examples=meta.num_examples,
        size=len(body),
        **({"base_round": admitted.base_round, "task_round_id": round_id} if buffered else {}),
    )
    session.commit()
    return _receipt(update, admitted.study_id, admitted.number, site.site_name), True


def _accepted(session: Session, round_id: int, site_id: int) -> Update | None:
    """The site's update stored in the round."""
    return session.scalar(select(Update).where(Update.round_id == round_id, Update.site_id == site_id))


def _answer(session: Session, round_id: int, site_id: int) -> Update | None:
    """The site's update answering the round's task: stored in it, or (buffered studies) in a later buffer."""
    return session.scalar(
        select(Update)
        .where(
            Update.site_id == site_id,
            or_(Update.task_round_id == round_id, and_(Update.round_id == round_id, Update.task_round_id.is_(None))),
        )
        .order_by(Update.id)
        .limit(1)
    )


def _receipt(update: Update, study_id: int, number: int, site_name: str) -> UpdateReceipt:
    return UpdateReceipt(
        study_id=study_id,
        round_id=update.round_id,
        round=number,
        site=site_name,
        sha256=update.sha256,
        size=update.size,
        num_examples=update.num_examples,
        received_at=update.received_at,
    )


def _same_bytes_receipt(session: Session, existing: Update, digest: str, site_name: str) -> UpdateReceipt:
    """The first receipt of an update sent again; UpdateConflict when other bytes were accepted."""
    if existing.sha256 != digest:
        raise UpdateConflict(
            f"site {site_name!r} already has an accepted update {existing.sha256} for round {existing.round_id}"
        )
    joined = session.get(Round, existing.round_id)  # in a buffered study, maybe a later round than the task's
    assert joined is not None
    return _receipt(existing, joined.study_id, joined.number, site_name)


def _checked(
    body: bytes | bytearray | memoryview,
    terms: StudyTerms,
    rules: UploadRules,
    max_num_examples: int,
    site: str,
    *,
    trains: bool,
) -> tuple[UpdateMeta, dict[str, Any]]:
    """The update's meta and evaluation summaries if every check the round's rules name passes; else InvalidUpload."""
    header = _checked_header(body, rules)
    meta = _checked_meta(header, max_num_examples)
    _check_head_usage(meta, terms, usage_in_clear=rules.usage_in_clear)
    try:
        check_finite(tensor_views(body, header))
    except PayloadError as exc:
        raise InvalidUpload(str(exc), code=exc.code) from None
    if rules.zero_local_heads:
        leaked = unused_heads_leaked(tensor_views(body, header), terms.model.for_site(site).config())
        if leaked:
            raise InvalidUpload(
                f"site {site!r} keeps heads local (split {terms.model.split_of(site)}) but uploads non-zero values "
                f"of them in {leaked}",
                code=PrivateTensorsInPayload.code,
            )
    if not rules.statistics_in_clear and meta.metrics.eval_stats is not None:
        raise InvalidUpload("eval_stats are summed under the masks in a secure round", code="invalid_metrics")
    return meta, _checked_reports(meta, terms, trains=trains)


def _checked_header(body: bytes | bytearray | memoryview, rules: UploadRules) -> Header:
    """The body's safetensors header, holding exactly the round's tensors and no private name."""
    try:
        header = read_header(body)
        check_header(header, rules.schema, rules.private)
    except PayloadError as exc:
        raise InvalidUpload(str(exc), code=exc.code) from None
    return header


def _checked_meta(header: Header, max_num_examples: int) -> UpdateMeta:
    """The UpdateMeta in the header: of a protocol this coordinator takes, with a plausible n_k."""
    try:
        meta = UpdateMeta.from_metadata(header.metadata)
    except (ValueError, ValidationError) as exc:
        raise InvalidUpload(f"invalid update meta: {exc}", code="invalid_update_meta") from None
    if meta.protocol < MIN_PROTOCOL_VERSION:
        raise InvalidUpload(
            f"an update of protocol {meta.protocol}; this coordinator takes protocol {MIN_PROTOCOL_VERSION} or newer",
            code="invalid_update_meta",
        )
    if meta.num_examples > max_num_examples:
        raise InvalidUpload(
            f"n_k = {meta.num_examples} exceeds the plausible maximum {max_num_examples}", code="invalid_update_meta"
        )
    return meta


def _checked_reports(meta: UpdateMeta, terms: StudyTerms, *, trains: bool) -> dict[str, Any]:
    """The per-site summaries of what the site reported: scalars, and statistics of enough test records."""
    try:
        reported = meta.metrics.model_dump()
        n_classes = terms.model.config().n_classes
        check_reports(reported, n_classes, terms.privacy.min_records)
        if trains:  # what the study's weighting reads (uncertainty: H_k) must be there now
            round_weights(terms, [SiteReport("", meta.num_examples, meta.metrics.model_dump(mode="json"))])
    except ValueError as exc:
        raise InvalidUpload(f"invalid metrics: {exc}", code="invalid_metrics") from None
    train_loss = meta.metrics.loss if trains else None  # nothing trained in the final evaluation
    return {"train_loss": train_loss, **site_summaries(reported, n_classes)}


def _check_head_usage(meta: UpdateMeta, config: StudyTerms, *, usage_in_clear: bool) -> None:
    """A learned-heads training update sent in the clear carries (blocks, H) usages (UpdateMeta checks [0, 1]).

    No other update does: not the final evaluation's, and not a secure round's (its usages are
    inside the masked vector).
    """
    model = algorithm_model(config.model, config.algorithm)
    if not model.learned_heads or not usage_in_clear:
        if meta.head_usage is not None:
            raise InvalidUpload(
                "head_usage belongs to a learned_heads study's training update sent in the clear only (a secure "
                "round sums the usages under the masks)",
                code="invalid_update_meta",
            )
        return
    shape = (model.n_blocks, model.n_heads)
    if (
        meta.head_usage is None
        or len(meta.head_usage) != shape[0]
        or any(len(row) != shape[1] for row in meta.head_usage)
    ):
        got = None if meta.head_usage is None else [len(row) for row in meta.head_usage]
        raise InvalidUpload(
            f"head_usage must be {shape[0]} blocks x {shape[1]} heads of values in [0, 1] (1 - g_k,h); got {got}",
            code="invalid_update_meta",
        )


def _record_refusal(
    session: Session, exc: InvalidUpload, site: Principal, study_id: int, round_id: int, digest: str
) -> None:
    privacy = exc.code == PrivateTensorsInPayload.code
    audit.record(
        session,
        "privacy.violation" if privacy else "update.refused",
        actor=site.actor,
        study_id=study_id,
        round_id=round_id,
        site_id=site.site_id,
        digest=digest,
        code=exc.code,
        message=exc.message[:1000],
    )
    session.commit()


def record_upload_refusal(
    sessions: sessionmaker[Session], caller: Principal, round_id: int | None, code: str, message: str
) -> None:
    """Audit an upload refused before its bytes were checked (403, 404, 409, 413, 415, a bad round id)."""
    with sessions() as session:
        study_id = session.scalar(select(Round.study_id).where(Round.id == round_id)) if round_id else None
        audit.record(
            session,
            "update.refused",
            actor=caller.actor,
            study_id=study_id,
            round_id=round_id if study_id is not None else None,
            site_id=caller.site_id,
            code=code,
            message=message[:1000],
        )
        session.commit()
