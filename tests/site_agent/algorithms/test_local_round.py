import pytest
import torch

import site_agent.local_round as local_round_module
from shared.study.rules import initial_state, study_exchange
from site_agent.algorithms import CLIENT_ALGORITHMS
from site_agent.algorithms.base import ClientAlgorithm, RoundContext, RoundOutcome
from site_agent.data.loader import SiteData
from tests.site_agent.algorithms.conftest import local_round, study


def test_a_global_model_of_another_study_is_refused(site: SiteData) -> None:
    theta, _ = initial_state(study("scaffold"))
    with pytest.raises(ValueError, match="global model does not match"):
        local_round(study("fedavg"), site, global_tensors=theta)  # carries scaffold.c.*


def test_unknown_kept_tensors_are_refused(site: SiteData) -> None:
    _, phi = initial_state(study())
    with pytest.raises(ValueError, match="unknown"):
        local_round(study(), site, local_tensors={**phi, "ditto.personal.head.bias": torch.zeros(20)})
    with pytest.raises(ValueError, match="missing"):
        local_round(study(), site, local_tensors={})


def test_the_partition_must_be_the_studys(site: SiteData) -> None:
    from site_agent.local_round import LocalRoundSpec, run_local_round
    from tests.site_agent.algorithms.conftest import RUNTIME

    config = study("fedper")
    theta, phi = initial_state(config)
    spec = LocalRoundSpec.of(config, "lyon", 1)
    with pytest.raises(ValueError, match="partition"):
        run_local_round(
            spec,
            study_exchange(study()).partition,
            global_tensors=theta,
            local_tensors=phi,
            initial_local=phi,
            data=site,
            runtime=RUNTIME,
        )


class Leaky(ClientAlgorithm):
    """Keeps a tensor its study never declared."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        model = ctx.build(ctx.start_state())
        return RoundOutcome(model, ctx.train(model, 1), state={"undeclared": torch.zeros(1)})


def test_an_algorithm_outside_its_declared_exchange_fails_loudly(
    site: SiteData, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_round_module, "CLIENT_ALGORITHMS", {**CLIENT_ALGORITHMS, "fedavg": Leaky()})
    with pytest.raises(RuntimeError, match="declared exchange"):
        local_round(study(), site)
