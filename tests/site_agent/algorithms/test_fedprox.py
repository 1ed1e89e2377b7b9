import torch

from shared.study.rules import initial_state, study_exchange
from site_agent.data.loader import SiteData
from tests.site_agent.algorithms.conftest import assert_same, local_round, study


def test_fedprox_with_mu_zero_is_fedavg_bit_for_bit(site: SiteData) -> None:
    fedavg = local_round(study("fedavg"), site)
    fedprox = local_round(study("fedprox", {"mu": 0.0}), site)
    assert_same(fedavg.shared, fedprox.shared)
    assert_same(fedavg.local, fedprox.local)
    assert fedavg.meta.metrics.loss == fedprox.meta.metrics.loss


def _distance(shared: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], names: tuple[str, ...]) -> float:
    return sum(float((shared[n] - reference[n]).pow(2).sum()) for n in names)


def test_the_proximal_term_keeps_the_shared_parameters_closer_to_the_global_model(site: SiteData) -> None:
    config = study("fedprox", {"mu": 10.0}, training={"lr": 0.05, "batch_size": 8, "max_steps": 3})
    theta, _ = initial_state(config)
    parameters = study_exchange(config).shared_parameters(config.model.config())
    pulled = local_round(config, site)
    free = local_round(study("fedavg", training={"lr": 0.05, "batch_size": 8, "max_steps": 3}), site)
    assert 0 < _distance(pulled.shared, theta, parameters) < _distance(free.shared, theta, parameters)
