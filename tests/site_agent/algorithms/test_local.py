"""The local baseline's client: each site trains its whole model alone and uploads no tensor."""

from __future__ import annotations

from functools import partial

import torch

from shared.model.network import build_model
from shared.model.partition import model_schema
from shared.study.rules import initial_state, study_exchange
from shared.tensors.codec import TensorDict
from shared.terms import StudyTerms
from site_agent.algorithms.base import make_optimizer
from site_agent.data import SiteData, iterate_batches
from site_agent.local_round import round_seed, seeded_rng, steps_for
from site_agent.training import cycle_batches, train_steps
from tests.site_agent.algorithms.conftest import RUNTIME, assert_same, final_evaluation, local_round, study


def trained_alone(config: StudyTerms, data: SiteData, rounds: int, site: str = "lyon") -> TensorDict:
    """The site's model trained by hand with no other site: built from the study's seed, each round seeded alone."""
    model = build_model(config.model.config(), config.seed)
    training = config.training
    for number in range(1, rounds + 1):
        seed = round_seed(config.seed, number, site)
        generator = torch.Generator().manual_seed(seed)
        limit = training.max_steps * training.batch_size if training.max_steps is not None else None
        epoch = partial(iterate_batches, data.train, training.batch_size, shuffle=True, generator=generator)
        batches = cycle_batches(partial(epoch, limit_samples=limit))
        with seeded_rng(seed, RUNTIME):
            steps = steps_for(len(data.train), training, 1.0)
            train_steps(model, batches, make_optimizer(model, training), steps=steps, runtime=RUNTIME)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_local_uploads_no_tensor_and_keeps_the_whole_model(site: SiteData) -> None:
    config = study("local")
    theta_0, phi_0 = initial_state(config)
    assert theta_0 == {} and phi_0.keys() == model_schema(config.model.config()).keys()
    result = local_round(config, site)
    assert result.shared == {} and result.grid == {}  # nothing but metrics leaves the site
    assert result.local.keys() == phi_0.keys() == study_exchange(config).local_names()
    assert result.meta.metrics.local_eval is not None and result.meta.metrics.eval_stats is not None


def test_a_site_s_model_after_each_round_is_its_model_trained_alone(site: SiteData) -> None:
    config = study("local", training={"lr": 0.05, "batch_size": 8, "max_steps": 2, "local_epochs": 2})
    first = local_round(config, site)
    assert_same(first.local, trained_alone(config, site, 1))
    second = local_round(config, site, global_tensors={}, local_tensors=first.local, round_=2)
    assert_same(second.local, trained_alone(config, site, 2))
    # and it did train: every floating tensor moved from phi_0
    assert not any(torch.equal(first.local[n], t) for n, t in initial_state(config)[1].items() if t.is_floating_point())


def test_the_global_evaluation_of_a_local_study_is_the_site_s_own_model(site: SiteData) -> None:
    config = study("local")
    trained = local_round(config, site)
    final = final_evaluation(config, site, global_tensors={}, local_tensors=trained.local)
    metrics = final.meta.metrics
    assert metrics.local_eval is not None and metrics.eval_stats is not None
    assert metrics.loss == metrics.local_eval.loss  # eval_stats and local_eval read the same model
    assert final.shared == {} and final.local == trained.local
