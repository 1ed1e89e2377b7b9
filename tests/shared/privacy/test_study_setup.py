"""What a secure study's terms make of its rounds, and what people are told of them (`secure_summary`)."""

from __future__ import annotations

from typing import Any

from shared.study.secure_setup import round_sizes, secure_summary
from shared.terms import StudyTerms

SITES = [f"site-{i}" for i in range(6)]


def terms(**changes: Any) -> StudyTerms:
    privacy = {"secure_aggregation": {}, **changes.pop("privacy", {})}
    return StudyTerms.model_validate({"sites": SITES, "min_sites": 5, "privacy": privacy, **changes})


def test_every_round_size_the_policy_may_pick_is_checked_and_shown() -> None:
    assert list(round_sizes(terms())) == [6]  # `all`: every site, every round
    sampled = terms(participation={"name": "random"})
    assert list(round_sizes(sampled)) == [5, 6]
    (five, six, across) = secure_summary(sampled)
    assert five.startswith("against 1 colluding site(s), a round of 5 sites: shares with every other site, threshold 3")
    assert five.endswith("4 consistency signatures, at least 4 survivors (1 may drop)")
    assert six.endswith("threshold 4, 4 consistency signatures, at least 5 survivors (1 may drop)")
    assert "nothing bounds it without distributed DP" in across
    assert secure_summary(StudyTerms.model_validate({"sites": SITES})) == []


def test_the_summary_says_what_dp_does_and_does_not_cover() -> None:
    dp = {"noise_multiplier": 1.0, "clip_norm": 0.1}
    central = secure_summary(terms(aggregation={"name": "equal"}, privacy={"dp": dp}))
    assert (
        central[-1] == "central DP: the coordinator unmasks the sum before it adds the noise, so it sees it un-noised"
    )
    distributed = secure_summary(terms(aggregation={"name": "equal"}, privacy={"dp": {**dp, "mode": "distributed"}}))
    assert "distributed DP bounds it" in distributed[-1] and not any("central DP" in line for line in distributed)
