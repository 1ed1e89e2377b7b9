"""A round of a study as its terms make it: its kind, its load factor and quorum, its secure setup, its URLs.

The coordinator opens rounds and writes tasks with these functions; a site recomputes each of them
from the terms its operator approved and the round's public facts (study uid, round, attempt,
participants), and declines a task that says otherwise (site_agent/task_check.py). The in-process
runner uses them too, so all three agree by construction. The URLs a task names are shared/wire/urls.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.privacy.messages import RoundSetup
from shared.privacy.signing import RoundContext
from shared.study.accounting import trained_rounds
from shared.study.secure_setup import colluding_sites, round_setup, site_numbers
from shared.terms import StudyTerms
from shared.wire.protocol import RoundKind, SecureRoundInfo
from shared.wire.urls import secure_url

__all__ = [
    "load_factor",
    "round_kind",
    "secure_round_info",
    "secure_round_key",
    "secure_setup",
]

_ATTEMPTS = 1 << 20  # more than any study's round_retries + 1


def round_kind(terms: StudyTerms, number: int) -> RoundKind | None:
    """Rounds 1..T train, T + 1 evaluates theta^g_T (T fewer when an epsilon budget says so); None past that."""
    trained = trained_rounds(terms)
    if 1 <= number <= trained:
        return RoundKind.TRAIN
    return RoundKind.EVALUATE if number == trained + 1 else None


def load_factor(terms: StudyTerms, participants: Sequence[str]) -> float:
    """|all sites| / |selected sites|: how much a selected site scales its local steps by."""
    return len(terms.sites) / len(participants)


def secure_round_key(number: int, attempt: int) -> int:
    """The integer that binds a secure round attempt's keys, shares and graph: (round, attempt), chosen by no one."""
    return number * _ATTEMPTS + attempt


def secure_setup(
    terms: StudyTerms,
    *,
    study_uid: str,
    number: int,
    attempt: int,
    participants: Sequence[str],
    global_digest: str = "",
) -> RoundSetup:
    """The public setup of a secure round attempt: numbering, graph, threshold and quorum, from the terms alone.

    It names the sites' signing keys (the terms') and the context every signature of the round
    names: the study, the round, the attempt and `global_digest`, theta^g_{t-1}'s sha256.
    """
    secure = terms.privacy.secure_aggregation
    assert secure is not None
    return round_setup(
        secure,
        study_uid=study_uid,
        round_key=secure_round_key(number, attempt),
        sites=sorted(participants),
        colluding=colluding_sites(terms),
        signing_keys=secure.site_keys,
        context=RoundContext(study_uid, number, attempt, global_digest),
    )


def secure_round_info(
    terms: StudyTerms,
    *,
    study_uid: str,
    number: int,
    attempt: int,
    participants: Sequence[str],
    site: str,
    round_id: int,
) -> SecureRoundInfo:
    """What a secure round's task tells `site` of its setup: what the site derives itself, and the phases' URL."""
    secure = terms.privacy.secure_aggregation
    assert secure is not None
    setup = secure_setup(terms, study_uid=study_uid, number=number, attempt=attempt, participants=participants)
    numbers = site_numbers(participants)
    return SecureRoundInfo(
        site_number=numbers[site],
        sites=numbers,
        graph_seed=setup.graph_seed.hex(),
        neighbour_count=setup.neighbour_count,
        threshold=setup.threshold,
        signature_quorum=setup.signature_quorum,
        min_survivors=setup.min_survivors,
        fraction_bits=secure.fraction_bits,
        ring_bits=secure.ring_bits,
        url=secure_url(round_id),
    )
