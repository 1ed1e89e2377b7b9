"""A site's check of a task against the terms its operator approved: each round fact recomputed, any difference named.

The coordinator may lie. A task carries the study's terms whole and the round's facts beside them;
the site takes the terms only when they are the ones its operator approved (their digest,
site_agent/approvals.py; the terms were checked whole, shared/study/checks.py, when the operator
approved them and again when the task was read, site_agent/client.py), and recomputes every fact
from those terms and the round's public identity (study uid, round, attempt) with the functions
the coordinator uses (shared/study/round_terms.py):

- the round's kind (train, or the final evaluation T + 1) and its attempt within the retries;
- the participants: within the terms' sites, naming this site, at least the quorum, and the pick of
  the participation policy (recomputed whole, or bounded in size where the policy reads round times);
- the load factor |sites| / |participants|;
- the secure setup (numbering, graph seed, neighbours, threshold, signature quorum, fewest
  survivors, fraction and ring bits), present exactly when the terms ask for secure aggregation;
- the URLs of theta^g_{t-1}, phi_0, the update, the decline and the secure phases;
- the plug-in that provides the algorithm: the one installed here, of the identity the terms name
  (shared/algorithms/registry.py `terms_plugin_problems`; code never comes from the coordinator);
- in a secure study, the site's ledger (site_agent/ledger.py): no other attempt of a round it
  revealed in, and no secure round from a theta^g it took part in a secure round from before;
- versions only increase: no task of a round before the last one whose update this site had
  accepted (the same round again only as its retry). In a buffered study, where an update may join
  a later buffer, this is what bounds what a coordinator can ask of a site's data and phi_k.

What it returns is the site's round as the terms make it (LocalRoundSpec.of); a difference raises
TaskMismatch naming every one, and the worker declines the task without training or sending anything.
"""

from __future__ import annotations

from shared.algorithms.registry import terms_plugin_problems
from shared.study.round_terms import load_factor, round_kind, secure_round_info
from shared.study.rules import participation_problem
from shared.terms import StudyTerms
from shared.wire.protocol import RoundKind, SecureRoundInfo, TaskSpec
from shared.wire.secure import SecureRoundView
from shared.wire.urls import decline_url, global_model_url, initial_local_url, update_url
from site_agent.approvals import study_key
from site_agent.errors import TaskMismatch
from site_agent.local_round import LocalRoundSpec

__all__ = ["check_round_view", "check_task", "replay_problem"]


def check_task(
    task: TaskSpec,
    approved: StudyTerms,
    site: str,
    *,
    signing_key: str | None = None,
    revealed: int | None = None,
    used: tuple[str, int] | None = None,
    trained: int | None = None,
) -> LocalRoundSpec:
    """The site's round of `task`, built from the `approved` terms; TaskMismatch naming whatever the task says else.

    `signing_key` is the site's own (hex): secure terms must name it for this site. `revealed` is
    the attempt of this round whose unmasking shares the site sent, if any: it takes no task of the
    round again, of that attempt or another. `used` is the (study key, round) of the secure round
    the site took part in from the task's theta^g, if any (site_agent/ledger.py): a secure task
    from it is taken only as that very round again (an honest retry). `trained` is the last round whose
    update the site had accepted (its latest committed phi_k), if any.
    """
    problems = _problems(task, approved, site)
    if trained is not None and task.round < trained:
        problems.append(
            f"round {task.round} comes after round {trained}, whose update this site had accepted: versions only "
            "increase"
        )
    problems += terms_plugin_problems(approved)
    problems += _secure_site_problems(task, approved, site, signing_key, revealed)
    problems += _replay_problems(task, approved, used)
    if problems:
        raise TaskMismatch("; ".join(problems))
    return LocalRoundSpec.of(approved, site, task.round, task.participants)


def _problems(task: TaskSpec, approved: StudyTerms, site: str) -> list[str]:
    problems = []
    if task.terms != approved:
        problems.append("its terms are not the ones this site's operator approved")
    if task.site != site:
        problems.append(f"it is addressed to site {task.site!r}, not {site!r}")
    kind = round_kind(approved, task.round)
    if kind is None:
        problems.append(f"round {task.round} is past the study's end")
    elif kind != task.kind:
        problems.append(f"round {task.round} is a {kind} round, the task says {task.kind}")
    if not 1 <= task.attempt <= approved.round_retries + 1:
        problems.append(f"attempt {task.attempt} is beyond the {approved.round_retries} retries of the terms")
    if task.global_model_round != task.round - 1:
        problems.append(
            f"round {task.round} trains from theta^g of round {task.round - 1}, not {task.global_model_round}"
        )
    problems += _participant_problems(task, approved, site, kind)
    problems += _url_problems(task)
    problems += _secure_problems(task, approved, site)
    return problems


def _participant_problems(task: TaskSpec, approved: StudyTerms, site: str, kind: RoundKind | None) -> list[str]:
    chosen = task.participants
    if site not in chosen:
        return [f"its participants {chosen} do not name this site"]
    if kind is RoundKind.EVALUATE:
        problem = None if sorted(chosen) == sorted(approved.sites) else "the final evaluation asks every site"
    else:
        problem = participation_problem(approved, task.round, task.attempt, chosen)
    if problem is not None:
        return [f"participants: {problem}"]
    expected = load_factor(approved, chosen)
    if task.load_factor != expected:
        return [f"load factor {task.load_factor!r}; {len(approved.sites)} sites over {len(chosen)} is {expected!r}"]
    return []


def _url_problems(task: TaskSpec) -> list[str]:
    expected = {
        "global_model_url": global_model_url(task.study_id, task.round - 1),
        "initial_local_url": initial_local_url(task.study_id),
        "update_url": update_url(task.round_id),
        "decline_url": decline_url(task.round_id),
    }
    return [
        f"{name} is {getattr(task, name)!r}, not {url!r}"
        for name, url in expected.items()
        if getattr(task, name) != url
    ]


def _secure_problems(task: TaskSpec, approved: StudyTerms, site: str) -> list[str]:
    secure = approved.privacy.secure_aggregation is not None
    if task.secure is None:
        return ["the terms ask for secure aggregation and the task is a plain round"] if secure else []
    if not secure:
        return ["the task is a secure round and the terms ask for no secure aggregation"]
    if site not in task.participants:
        return []  # said already
    derived = secure_round_info(
        approved,
        study_uid=task.study_uid,
        number=task.round,
        attempt=task.attempt,
        participants=task.participants,
        site=site,
        round_id=task.round_id,
    )
    return [
        f"secure.{name} is {getattr(task.secure, name)!r}; the terms make it {getattr(derived, name)!r}"
        for name in SecureRoundInfo.model_fields
        if getattr(task.secure, name) != getattr(derived, name)
    ]


def _secure_site_problems(
    task: TaskSpec, approved: StudyTerms, site: str, signing_key: str | None, revealed: int | None
) -> list[str]:
    secure = approved.privacy.secure_aggregation
    if secure is None:
        return []
    problems = []
    if signing_key is not None and secure.site_keys.get(site) != signing_key:
        problems.append("the terms name another signing key for this site than its own")
    if revealed is not None:  # an honest coordinator offers a secure round only before the site advertises
        problems.append(
            f"this site revealed its shares in attempt {revealed} of round {task.round}: it takes no further task "
            "of the round, whatever attempt it names (two sums over different sites would let the coordinator "
            "difference them)"
        )
    return problems


def _replay_problems(task: TaskSpec, approved: StudyTerms, used: tuple[str, int] | None) -> list[str]:
    if approved.privacy.secure_aggregation is None:
        return []
    problem = replay_problem(task, used, f"theta^g {task.global_model_sha256[:12]}")
    return [problem] if problem is not None else []


def replay_problem(task: TaskSpec, used: tuple[str, int] | None, what: str) -> str | None:
    """Why the secure task may not use `what`, which this site took part in round `used` from; None when it may.

    Only that very round again (another attempt of it: an honest retry) may.
    """
    if used is None or used == (study_key(task.study_id, task.study_uid), task.round):
        return None
    study, number = used
    return (
        f"this site took part in a secure round from {what} before (round {number} of study {study}): a second "
        "secure sum from the same model, with its bit-identical honest updates, would let the coordinator "
        "difference the two"
    )


def check_round_view(view: SecureRoundView, round_id: int) -> None:
    """TaskMismatch when a secure round's view is not of this site's round attempt.

    What the view relays is checked by the protocol itself (shared/privacy/client.py): signatures,
    theta^g, the survivor set; the view names no weight (a site computes its own).
    """
    if view.round_id != round_id:
        raise TaskMismatch(f"the secure round view is of round {view.round_id}, not {round_id}")
