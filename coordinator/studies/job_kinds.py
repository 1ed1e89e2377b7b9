"""Creating and starting the studies that train nothing: a survey, and an evaluation of a completed study's model.

An evaluate study names the study it evaluates by uid (`evaluation.study_uid`). Creating it fills in
what each site's approval must then cover: the evaluated model's digests (theta^g_T and phi_0) and T,
and the evaluated study's model, algorithm and seed, which replace whatever the researcher wrote.
Or it names a model file by its two digests alone (no study_uid), uploaded before (POST /api/v1/models):
creating it checks that both are stored and hold exactly the tensors of the terms' own model and
algorithm, which stay as the researcher wrote them. Starting it stores its round 0 as those blobs
(content addressed: nothing is copied); a survey starts with no model at all. Neither opens a round:
their sites' jobs are all they run (coordinator/studies/jobs.py), and coordinator/rounds/job_studies.py
ends them.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator import audit
from coordinator.errors import Conflict, Unprocessable, WrongStudyKind
from coordinator.models import GlobalModel, Study, StudyStatus
from coordinator.sites.security import Principal
from coordinator.storage.model_files import model_header
from shared.study.rules import algorithm_exchange
from shared.tensors.codec import Header, PayloadError, check_header
from shared.terms import StudyTerms, terms_from

__all__ = ["start_without_rounds", "with_evaluated_model"]


def _evaluated_study(session: Session, terms: StudyTerms, uid: str) -> Study:
    """The completed training study of uid `uid` that `terms.evaluation` names, with the labels of `terms`."""
    evaluated = session.scalar(select(Study).where(Study.uid == uid))
    if evaluated is None:
        raise Unprocessable(f"evaluation.study_uid: no study {uid} on this coordinator", code="unknown_evaluated_study")
    if evaluated.terms.kind != "train":
        raise WrongStudyKind(
            f"evaluation.study_uid: study {evaluated.id} is a {evaluated.terms.kind} study; only a training study's "
            "model can be evaluated"
        )
    if evaluated.status != StudyStatus.COMPLETED:
        raise Conflict(
            f"evaluation.study_uid: study {evaluated.id} is {evaluated.status}; only a completed study's final model "
            "can be evaluated",
            code="evaluated_study_not_completed",
        )
    if evaluated.terms.labels != terms.labels:
        raise Unprocessable(
            f"labels: study {evaluated.id}'s model predicts {list(evaluated.terms.labels)}", code="labels_differ"
        )
    return evaluated


def with_evaluated_model(session: Session, terms: StudyTerms) -> StudyTerms:
    """An evaluate study's terms with the evaluated study's model, algorithm and seed, and its model's digests.

    Digests or a T that the researcher wrote must be the evaluated study's (409 evaluated_model_mismatch).
    Terms of a model file (no study_uid) come back as they are, once the file holds the terms' model.
    """
    assert terms.evaluation is not None
    if terms.evaluation.study_uid is None:
        _check_model_file(session, terms)
        return terms
    evaluated = _evaluated_study(session, terms, terms.evaluation.study_uid)
    models = session.scalars(
        select(GlobalModel).where(GlobalModel.study_id == evaluated.id).order_by(GlobalModel.round_number)
    ).all()
    initial, final = models[0], models[-1]
    if final.round_number < 1:
        raise Unprocessable(f"study {evaluated.id} released no trained model", code="no_trained_model")
    found = {"model_sha256": final.sha256, "initial_local_sha256": initial.local_sha256, "rounds": final.round_number}
    named = terms.evaluation.model_dump(include=set(found), exclude_none=True)
    differ = sorted(name for name, value in named.items() if value != found[name])
    if differ:
        shown = ", ".join(f"{name} {named[name]} (it is {found[name]})" for name in differ)
        raise Conflict(f"evaluation: the terms name {shown} of study {evaluated.id}", code="evaluated_model_mismatch")
    source = evaluated.terms.model_dump(mode="json", include={"model", "algorithm", "seed"})
    evaluation = {**terms.evaluation.model_dump(mode="json"), **found}
    return terms_from({**terms.model_dump(mode="json"), **source, "evaluation": evaluation})


def _check_model_file(session: Session, terms: StudyTerms) -> None:
    """The model file the terms name: theta^g and phi_0 stored here, holding exactly the tensors its sites expect.

    theta^g holds the global schema of the terms' model under their algorithm (the shared tensors and the
    server state), phi_0 exactly the model's local tensors, each of the model's shape and dtype: what
    every site checks its download against (site_agent/downloads.py), each with its own head split.
    """
    spec = terms.evaluation
    assert spec is not None and spec.model_sha256 is not None and spec.initial_local_sha256 is not None
    headers = {
        "model_sha256": _stored_header(session, "model_sha256", spec.model_sha256),
        "initial_local_sha256": _stored_header(session, "initial_local_sha256", spec.initial_local_sha256),
    }
    models = {terms.model.split_of(site): terms.model.for_site(site) for site in terms.sites}
    for split, model in models.items():
        exchange = algorithm_exchange(model, terms.algorithm)
        schemas = {
            "model_sha256": exchange.global_schema(),
            "initial_local_sha256": exchange.model_specs(exchange.partition.local),
        }
        for name, schema in schemas.items():
            try:
                check_header(headers[name], schema)
            except PayloadError as exc:
                raise Unprocessable(
                    f"evaluation.{name}: not a model of the terms' model {model.preset} {split} under algorithm "
                    f"{terms.algorithm.name!r}: {exc}",
                    code="model_not_of_terms",
                ) from None


def _stored_header(session: Session, name: str, digest: str) -> Header:
    """The header of the model `digest` that the terms' `evaluation.<name>` names; 422 unknown_model if none."""
    header = model_header(session, digest)
    if header is None:
        raise Unprocessable(
            f"evaluation.{name}: no model {digest} on this coordinator: upload its file first (POST /api/v1/models)",
            code="unknown_model",
        )
    return header


def start_without_rounds(session: Session, study: Study, *, by: Principal) -> None:
    """Audit a survey's or an evaluation's start; an evaluation's round 0 is the evaluated model. The caller commits."""
    spec = study.terms.evaluation
    if spec is not None:
        assert spec.model_sha256 is not None and spec.initial_local_sha256 is not None  # filled at creation
        session.add(
            GlobalModel(
                study_id=study.id, round_number=0, sha256=spec.model_sha256, local_sha256=spec.initial_local_sha256
            )
        )
    digest = spec.model_sha256 if spec is not None else None
    audit.record(session, "study.running", actor=by.actor, study_id=study.id, digest=digest, kind=study.terms.kind)
