"""A buffered study's terms: what they hold, what they refuse and why, and the release they compose."""

from __future__ import annotations

import pytest
import torch

from shared.algorithms.aggregation import WeightedAverage
from shared.algorithms.buffered import BufferedAggregator, buffer_weights, buffered_release
from shared.algorithms.server import ServerAggregator
from shared.study.checks import check_study, checked_terms
from shared.study.description import describe
from shared.study.server_round import SiteReport, buffered_server_round, round_weights
from shared.terms import StudyTerms

SITES = ["a", "b", "c", "d"]


def terms(**changes: object) -> StudyTerms:
    values: dict[str, object] = {
        "model": {"preset": "tiny", "heads": "6:2"},
        "sites": SITES,
        "rounds": 3,
        "buffered": {"buffer_size": 3},
        **changes,
    }
    return StudyTerms.model_validate(values)


def test_buffered_terms_fill_their_defaults_and_leave_other_studies_digests_alone() -> None:
    checked = checked_terms(terms())
    assert checked.buffered is not None
    assert checked.buffered.model_dump() == {
        "buffer_size": 3,
        "max_staleness": 4,
        "staleness": "inverse_sqrt",
        "server_lr": 1.0,
    }
    plain = StudyTerms.model_validate({"sites": SITES})
    assert "buffered" not in plain.model_dump() and "buffered" in checked.model_dump()  # a round study dumps as before


@pytest.mark.parametrize(
    ("changes", "path", "why"),
    [
        ({"buffered": {"buffer_size": 5}}, "buffered.buffer_size", "the study has 4 sites"),
        ({"min_sites": 4}, "min_sites", "exceeds the 3 updates"),
        ({"privacy": {"secure_aggregation": {}}}, "privacy.secure_aggregation", "synchronous cohort"),
        (
            {
                "aggregation": {"name": "equal"},
                "privacy": {"dp": {"noise_multiplier": 1.0, "clip_norm": 1.0, "mode": "distributed"}},
            },
            "privacy.dp.mode",
            "distributed noise needs secure aggregation",
        ),
        ({"participation": {"name": "random", "params": {"p": 0.5}}}, "participation.name", "must be 'all'"),
        ({"model": {"preset": "tiny", "heads": "6:2", "site_heads": {"a": "4:4"}}}, "model.site_heads", "cohort"),
        ({"algorithm": {"name": "learned_heads"}}, "algorithm.name", "cohort"),
        ({"algorithm": {"name": "scaffold"}}, "algorithm.name", "assumes synchronous rounds"),
        ({"kind": "survey", "model": {"preset": "tiny", "heads": "6:2"}}, "buffered", "trains nothing to buffer"),
    ],
)
def test_what_a_buffered_study_refuses_is_named_with_its_reason(changes: dict, path: str, why: str) -> None:
    problems = check_study(terms(**changes))
    assert [".".join(problem.path) for problem in problems] == [path], problems
    assert why in problems[0].message


def test_central_dp_may_run_buffered() -> None:
    dp = {"noise_multiplier": 1.0, "clip_norm": 1.0, "mode": "central"}
    assert check_study(terms(aggregation={"name": "equal"}, privacy={"dp": dp})) == []


def test_fedprox_and_ditto_may_run_buffered() -> None:
    for algorithm in ({"name": "fedprox", "params": {"mu": 0.01}}, {"name": "ditto"}, {"name": "fedavg"}):
        assert check_study(terms(algorithm=algorithm)) == [], algorithm


def test_the_release_is_composed_from_the_reports_weights_times_staleness() -> None:
    study = checked_terms(terms(buffered={"buffer_size": 3, "server_lr": 0.5}))
    generator = torch.Generator().manual_seed(4)
    versions = {v: {"w": torch.randn(50, generator=generator)} for v in (1, 2, 3)}
    trained = {site: {"w": torch.randn(50, generator=generator)} for site in ("a", "b", "d")}
    reports = [SiteReport(site, n, {}) for site, n in (("a", 10), ("b", 30), ("d", 60))]
    bases = [3, 1, 2]  # b_k: "a" is fresh, "b" two versions behind, "d" one

    def add_previous(average: WeightedAverage) -> None:
        average.add(versions[3], 1.0)

    def add_base(average: WeightedAverage, version: int, weight: float) -> None:
        average.add(versions[version], weight)

    def add_updates(aggregator: ServerAggregator, weights: list[float]) -> None:
        for report, weight in zip(reports, weights, strict=True):
            aggregator.add(trained[report.site], weight)

    released, weights = buffered_server_round(study, reports, bases, 3, add_previous, add_base, add_updates)
    expected_weights = buffer_weights(round_weights(study, reports), [0, 2, 1], "inverse_sqrt")
    assert weights == expected_weights and weights == pytest.approx([0.1, 0.3 / 3**0.5, 0.6 / 2**0.5])
    updates = [(trained[r.site], w, b) for r, w, b in zip(reports, weights, bases, strict=True)]
    direct = buffered_release(BufferedAggregator(0.5), versions[3], versions, updates)
    assert torch.equal(released["w"], direct["w"])
    with pytest.raises(ValueError, match="no buffered settings"):
        buffered_server_round(
            StudyTerms.model_validate({"sites": SITES}), reports, bases, 3, add_previous, add_base, add_updates
        )


def test_a_site_approves_a_buffered_study_knowing_how_late_its_upload_may_be_used() -> None:
    terms = StudyTerms.model_validate(
        {"sites": ["a", "b", "c"], "model": {"preset": "tiny"}, "buffered": {"buffer_size": 2, "max_staleness": 3}}
    )
    said = describe(terms, study_uid="u" * 32, site="a", protocol=6).statistics
    assert any("up to 3 versions later" in line for line in said)
    plain = describe(terms.model_copy(update={"buffered": None}), study_uid="u" * 32, site="a", protocol=6)
    assert not any("buffered" in line for line in plain.statistics)
