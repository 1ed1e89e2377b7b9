from shared.algorithms.registry import ALGORITHMS
from shared.algorithms.weightings import WEIGHTINGS
from site_agent.algorithms import CLIENT_ALGORITHMS
from site_agent.algorithms.uncertainty import SITE_REPORTS


def test_every_study_algorithm_has_a_client_and_nothing_else() -> None:
    assert CLIENT_ALGORITHMS.keys() == ALGORITHMS.keys()
    plain = {"fedavg", "fedprox", "scaffold", "scaffold_fedcvd", "ditto"}
    assert plain | {"fedala", "fedah", "fedbn", "fedper", "fedrep", "learned_heads", "local"} == set(ALGORITHMS)


def test_site_reports_name_weightings() -> None:
    assert SITE_REPORTS.keys() <= WEIGHTINGS.keys()
    assert "uncertainty" in SITE_REPORTS
