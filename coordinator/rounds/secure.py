"""A secure round's workflow (SecAgg+): its phases relayed through the database, and the unmasked sum.

A secure round stays `open` while `rounds.secagg_phase` walks 0 -> 1 -> 2 -> 3 -> 4; then the
round engine aggregates it as any round (coordinator/rounds/closing.py). Each phase ends when every
site expected in it has sent its message, or at `rounds.secagg_deadline_at` (phase 0: the round's
deadline, since sites train before they advertise; later phases: `phase_timeout_s` after the
previous one closed) with at least the round's quorum max(min_sites, min_survivors) (the signature
quorum q = floor((K + c) / 2) + 1 in phase 3: shared/privacy/graph.py). The coordinator is not
trusted by the sites (Bonawitz et al. 2017 §4, malicious server): every message below is signed or
checked by them, and it checks them as they do.

0. advertise: a participant sends its two X25519 round keys, n_k, its scalar metrics and theta^g's
   digest, signed with its long-term key (`secagg_messages` phase 0). Closing fixes, for display,
   each site's weight w_k over the advertisers; each site computes its own the same way.
1. share: an advertiser reads every advertisement, checks every signature and that every site
   trained from its theta^g, then sends its sealed Shamir shares, one per neighbour that advertised.
2. mask: a site that shared uploads its masked ring vector (w_k theta_k, its w_k, its statistics)
   as an ordinary update whose blob holds only `secagg.masked` (coordinator/rounds/updates.py).
   Closing fixes the survivors (uploaders) and the dropped (shared, then sent nothing).
3. consistency: each survivor signs the survivor set, the dropped set and the advertisers it was told.
4. reveal: a survivor that sees at least q signatures of its own set (and none of another) sends
   the shares the unmasking needs; closing hands the round to the engine, which sums the stored
   masked blobs one window at a time, removes the masks (shared.privacy.server.ServerState) and
   decodes the survivors' sums and weight sum, which the algorithm's server step turns into theta^g_t.

Everything lives in the database: `rounds.secagg_state` (the public setup, then the weights and
the unmask request) and `secagg_messages`; a ServerState is rebuilt from them when needed. Every
phase change is a conditional UPDATE on (status open, the phase), taken with the round row locked,
so one worker wins it and a restarted coordinator carries on. Below quorum a phase fails the
round with its reason and the retry policy opens a new attempt; too few reveals fail the
aggregation the same way. The coordinator never holds an unmasked individual update.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, cast

import numpy as np
from sqlalchemy import ColumnElement, and_, exists, select, update
from sqlalchemy.engine import CursorResult, Engine  # CursorResult: an UPDATE's result, typed as a Result
from sqlalchemy.orm import Session, sessionmaker

from coordinator import audit
from coordinator.errors import WrongPhase
from coordinator.models import Round, RoundKind, RoundStatus, SecAggMessage, Study
from coordinator.rounds.declines import declined_sites
from coordinator.rounds.secure_messages import (
    ADVERTISE,
    CONSISTENCY,
    MASK,
    PHASE_NAMES,
    REVEAL,
    check_advertised,
    check_masked_upload,
    replay,
    senders,
)
from coordinator.rounds.upload_schema import exchange_schema
from coordinator.rounds.workflow import Aggregated, Contribution, Routed, Step, UploadRules
from coordinator.storage.blobs import blob_store_of, open_blobs
from coordinator.storage.stored_tensors import StoredTensors, blob_header
from coordinator.storage.stored_updates import add_stored_updates
from coordinator.storage.update_files import BlobStore
from shared.algorithms.aggregation import WeightedAverage
from shared.privacy.masking import MaskStreams
from shared.study.round_terms import secure_round_info, secure_setup
from shared.study.rules import add_secure_sum_noise, masked_update_schema
from shared.study.rules import secure_layout as study_layout
from shared.study.secagg import SecureLayout, SecureSumDecoded, decode_sum, survivor_weight_sum
from shared.study.secure_setup import round_quorum, site_numbers
from shared.study.server_round import SiteReport, round_weights, server_round_from_sums
from shared.tensors.codec import TensorSpec, dump_taking
from shared.terms import StudyTerms
from shared.wire.protocol import SecureRoundInfo, UpdateMeta

__all__ = ["SecureWorkflow", "masked_schema", "secure_layout", "unmasked_sums"]

_WINDOW = 1 << 17  # ring elements of every masked blob summed and unmasked at a time (1 MiB each)


class SecureWorkflow:
    """Masked updates only: phases 0..3 relayed through the database, the survivors' sum unmasked and decoded."""

    def start(self, session: Session, round_: Round, terms: StudyTerms) -> None:
        """Phase 0 until the round's deadline, with the round's public setup (see `start`)."""
        start(session, round_, terms)

    def offerable(self, site_id: int) -> ColumnElement[bool]:
        """A secure round is offered only in phase 0 and until the site advertised (never a second time)."""
        advertised = exists().where(and_(SecAggMessage.round_id == Round.id, SecAggMessage.site_id == site_id))
        return and_(Round.secagg_phase == ADVERTISE, ~advertised)

    def task_setup(self, terms: StudyTerms, uid: str, round_: Round, site: str) -> SecureRoundInfo | None:
        """The round's setup, which the site derives itself and compares (shared/study/round_terms.py)."""
        return secure_round_info(
            terms,
            study_uid=uid,
            number=round_.number,
            attempt=round_.attempt,
            participants=sorted(round_.participants),
            site=site,
            round_id=round_.id,
        )

    def upload_rules(self, terms: StudyTerms, kind: str) -> UploadRules:
        """Only the masked vector: usages, counts and histograms travel inside it, never in the clear."""
        _, private = exchange_schema(terms)
        return UploadRules(
            schema=masked_schema(terms, kind),
            private=private,
            usage_in_clear=False,
            zero_local_heads=False,
            statistics_in_clear=False,
        )

    def route_upload(self, session: Session, round_: Round, terms: StudyTerms) -> Routed:
        """An update joins the round whose task it answers."""
        return Routed(round_, None)

    def admit_upload(self, session: Session, round_: Round, site: str) -> None:
        """Phase 2 only, from a site that shared its secrets in phase 1."""
        check_masked_upload(session, round_, site)

    def check_upload(self, session: Session, round_id: int, site: str, meta: UpdateMeta) -> None:
        """The n_k the site advertised in phase 0."""
        check_advertised(session, round_id, site, meta.num_examples)

    def still_accepting(self, round_: Round) -> None:
        """The masking phase must still be open once the bytes were checked."""
        if round_.secagg_phase != MASK:
            raise WrongPhase(f"round {round_.id}'s masking phase closed while the update was checked")

    def step(self, sessions: sessionmaker[Session], round_id: int, *, now: datetime) -> Step | None:
        """Close the current phase when due; after the last, aggregate; below quorum, fail (see `advance`)."""
        return advance(sessions, round_id, now=now)

    def aggregate(
        self, sessions: sessionmaker[Session], round_: Round, terms: StudyTerms, contributions: list[Contribution]
    ) -> Aggregated:
        """The survivors' masked vectors summed and unmasked, the server step on their sums (or the statistics)."""
        with sessions() as session:
            engine, store = session.get_bind().engine, blob_store_of(session)
            session.rollback()

        def previous(average: WeightedAverage) -> None:
            add_stored_updates(average, engine, [round_.base_sha256], [1.0], store=store)

        with unmasked_sums(sessions, engine, store, round_.id, terms) as (decoded, weights):
            if round_.kind == RoundKind.EVALUATE:
                return Aggregated(None, None, decoded.pooled_eval, summed_eval=True)
            theta = server_round_from_sums(  # reads the sums a tensor at a time, the ring sum whole beside theta^g_t
                terms, previous, decoded.schema, decoded.sums, decoded.weight_sum, decoded.survivors
            )
        meta = {"study": str(round_.study_id), "round": str(round_.number), "part": "global"}
        used = [weights[c.site] for c in contributions]
        return Aggregated([dump_taking(theta, meta)], used, decoded.pooled_eval, summed_eval=True)


def start(session: Session, round_: Round, terms: StudyTerms) -> None:
    """Make a just-flushed round of a secure study secure: phase 0 until the round's deadline, its public setup.

    The setup is what every site derives from the terms and (study uid, round, attempt, participants)
    itself (shared/study/round_terms.py `secure_setup`); the stored copy spares recomputing it.
    """
    uid = session.scalar(select(Study.uid).where(Study.id == round_.study_id))
    assert uid is not None
    setup = secure_setup(
        terms,
        study_uid=uid,
        number=round_.number,
        attempt=round_.attempt,
        participants=list(round_.participants),
        global_digest=round_.base_sha256,
    )
    round_.secagg_phase = ADVERTISE
    round_.secagg_deadline_at = round_.deadline_at
    round_.secagg_state = {
        "study_uid": uid,
        "sites": site_numbers(list(round_.participants)),
        "graph_seed": setup.graph_seed.hex(),
        "neighbour_count": setup.neighbour_count,
        "threshold": setup.threshold,
        "signature_quorum": setup.signature_quorum,
        "min_survivors": setup.min_survivors,
    }


def secure_layout(terms: StudyTerms, kind: str) -> SecureLayout:
    """The ring vector's layout of a round of `kind` (the final evaluation sums statistics only)."""
    secure = terms.privacy.secure_aggregation
    assert secure is not None
    train = kind == RoundKind.TRAIN
    return study_layout(
        terms.model, terms.algorithm, train=train, fraction_bits=secure.fraction_bits, ring_bits=secure.ring_bits
    )


def masked_schema(terms: StudyTerms, kind: str) -> dict[str, TensorSpec]:
    """What a secure round's update holds: the masked ring vector's sections, as int32 and int64 words."""
    return masked_update_schema(secure_layout(terms, kind))


def advance(sessions: sessionmaker[Session], round_id: int, *, now: datetime) -> Step | None:
    """Close the current phase when it is due (None when nothing was due or another worker closed it)."""
    with sessions() as session:
        round_ = session.scalar(select(Round).where(Round.id == round_id).with_for_update())
        if round_ is None or round_.status != RoundStatus.OPEN or round_.secagg_phase is None:
            session.rollback()
            return None
        study = session.get(Study, round_.study_id)
        assert study is not None  # the round's study: a foreign key
        terms = study.terms
        phase, state = round_.secagg_phase, dict(round_.secagg_state or {})
        expected = _expected(session, round_, phase, state)
        got = senders(session, round_id, phase)
        due = round_.secagg_deadline_at is not None and now >= round_.secagg_deadline_at
        if not (expected <= got.keys() or due):
            session.rollback()
            return None
        if phase == REVEAL:
            session.rollback()
            return Step(aggregate=True)  # too few reveals: the unmasking fails the aggregation with the reason
        signatures = state.get("signature_quorum", state["threshold"])  # a round opened before protocol 6: t
        quorum = signatures if phase == CONSISTENCY else round_quorum(terms.min_sites, state["min_survivors"])
        if len(got) < quorum:
            session.rollback()
            return Step(
                rescuable=False,
                failure=f"secure aggregation, phase {PHASE_NAMES[phase]}: {len(got)} of {len(expected)} sites, "
                f"{quorum} needed",
            )
        try:
            state.update(_closing(phase, got, expected, state, terms))
        except ValueError as exc:
            session.rollback()
            return Step(failure=f"secure aggregation, phase {PHASE_NAMES[phase]}: {exc}", rescuable=False)
        secure = terms.privacy.secure_aggregation
        assert secure is not None
        moved = cast(
            "CursorResult[Any]",
            session.execute(
                update(Round)
                .where(Round.id == round_id, Round.status == RoundStatus.OPEN, Round.secagg_phase == phase)
                .values(
                    secagg_phase=phase + 1,
                    secagg_deadline_at=now + timedelta(seconds=secure.phase_timeout_s),
                    secagg_state=state,
                )
            ),
        )
        if moved.rowcount != 1:
            session.rollback()
            return None
        audit.record(
            session,
            "round.secagg_phase",
            actor="system",
            study_id=round_.study_id,
            round_id=round_id,
            phase=phase + 1,
            sites=sorted(got),
        )
        session.commit()
    return Step(moved_to=PHASE_NAMES[phase + 1])


def _expected(session: Session, round_: Round, phase: int, state: dict[str, Any]) -> set[str]:
    """The sites whose message of `phase` closes it early: those still in the round that have not declined it."""
    if phase == ADVERTISE:
        expected = set(round_.participants)
    elif phase == CONSISTENCY:
        names = {number: name for name, number in state["sites"].items()}
        expected = {names[number] for number in state["survivors"]}
    else:  # share: the advertisers; mask: the sites that shared; reveal: the survivors that signed
        expected = set(senders(session, round_.id, phase - 1))
    return expected - declined_sites(session, round_.id)


def _closing(
    phase: int, got: dict[str, dict[str, Any]], expected: set[str], state: dict[str, Any], terms: StudyTerms
) -> dict[str, Any]:
    """What closing `phase` fixes: the weights shown per site (advertise) or the unmask request (mask)."""
    if phase == ADVERTISE:
        names = sorted(got)
        reports = [SiteReport(name, got[name]["num_examples"], got[name]["metrics"]) for name in names]
        return {"weights": dict(zip(names, round_weights(terms, reports), strict=True))}
    if phase == MASK:
        numbers: dict[str, int] = state["sites"]
        dropped = expected - got.keys()  # shared their secrets, then sent no masked vector
        return {"survivors": sorted(numbers[name] for name in got), "dropped": sorted(numbers[n] for n in dropped)}
    return {}


@contextmanager
def unmasked_sums(
    sessions: sessionmaker[Session], engine: Engine, store: BlobStore | None, round_id: int, terms: StudyTerms
) -> Iterator[tuple[SecureSumDecoded, dict[str, float]]]:
    """The survivors' decoded sums and statistics, and each survivor's weight renormalised over them.

    The sums are decoded a tensor at a time as they are read, within the block: theta^g_{t-1}, which
    the narrow ones are changes from, stays open meanwhile and is read a tensor at a time too.
    """
    with sessions() as session:
        round_ = session.get(Round, round_id)
        assert round_ is not None
        server = replay(session, round_, terms)
        layout = secure_layout(terms, round_.kind)
        masked = sorted(senders(session, round_id, MASK).items())
        base_sha256 = round_.base_sha256
        weights: dict[str, float] = (round_.secagg_state or {})["weights"]
        session.rollback()
    total, digests = layout.empty(), [body["sha256"] for _, body in masked]
    _sum_and_unmask(engine, store, digests, masked_update_schema(layout), total, MaskStreams(server.removal_masks()))
    survivors = [name for name, _ in masked]
    add_secure_sum_noise(terms, layout, total)  # central DP: the discrete noise on the unmasked sum
    shown = survivor_weight_sum(weights, survivors)
    with open_blobs(engine, [base_sha256] if layout.narrow_length else [], store=store) as bases:
        base = StoredTensors(bases[0]) if bases else None
        decoded = decode_sum(layout, total, len(survivors), base)  # the weight sum is the survivors' own, unmasked
        yield decoded, {name: weights[name] / shown for name in survivors}


def _sum_and_unmask(
    engine: Engine,
    store: BlobStore | None,
    digests: list[str],
    schema: dict[str, TensorSpec],
    total: tuple[np.ndarray, np.ndarray],
    masks: MaskStreams,
) -> None:
    """Write into `total`'s (Z_{2^32}, Z_{2^64}) sections the sum of the stored masked vectors `digests`, minus `masks`.

    `schema` is the masked update's (study.masked_update_schema), its sections in masking order.

    One pass per section, a window at a time: each window of every blob is added, then the window
    of every mask removed, while the window is still in the CPU cache.
    """
    if not digests:
        raise ValueError("no masked vector to sum")
    with open_blobs(engine, digests, store=store) as readers:
        starts: list[list[int]] = []
        for digest, reader in zip(digests, readers, strict=True):
            header = blob_header(reader)
            if dict(header.specs) != schema:
                raise ValueError(f"masked update {digest} does not fit the round's layout")
            starts.append([header.data_start + header.offsets[name][0] for name in schema])
        for index, section in enumerate(s for s in total if s.size):
            word = section.dtype.newbyteorder("<")
            for first in range(0, section.size, _WINDOW):
                window = section[first : first + _WINDOW]
                for number, (reader, start) in enumerate(zip(readers, starts, strict=True)):
                    at = start[index] + word.itemsize * first
                    words = np.frombuffer(reader.read(at, word.itemsize * window.size), dtype=word)
                    if number == 0:
                        window[...] = words
                    else:
                        np.add(window, words, out=window)
                masks.apply(window)
