"""An evaluate study's site adapting only phi of a released model: theta^g untouched, seeded, as a plain loop does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.algorithms.exchange import model_names
from shared.model.network import build_model
from shared.study.rules import algorithm_model, initial_state, study_exchange
from shared.tensors.codec import TensorDict
from shared.terms import StudyTerms
from site_agent.adaptation import (
    ADAPT_PHASE,
    adapt_local,
    adaptation_context,
    evaluate_with_adaptation,
)
from site_agent.algorithms.base import stable_seed
from site_agent.data.loader import SiteData, SplitArrays
from site_agent.data.planted import PlantedSpec, planted_sites
from site_agent.device import resolve_runtime
from site_agent.local_round import round_seed
from site_agent.released_evaluation import released_summary

RUNTIME = resolve_runtime("cpu")
SITE = "nantes"


def evaluate_terms(epochs: int, algorithm: str = "fedavg", **training: Any) -> StudyTerms:
    """A tiny-model evaluate study whose sites adapt phi for `epochs` epochs."""
    return StudyTerms.model_validate(
        {
            "kind": "evaluate",
            "evaluation": {"study_uid": "a" * 32, "adapt_local_epochs": epochs},
            "model": {"preset": "tiny", "heads": "6:2"},
            "algorithm": {"name": algorithm},
            "sites": [SITE],
            "training": {"lr": 0.1, "batch_size": 8, **training},
            "seed": 7,
        }
    )


@pytest.fixture(scope="module")
def site() -> SiteData:
    """A planted site: labels from a teacher's global and local heads, short records."""
    config = algorithm_model(evaluate_terms(0).model, evaluate_terms(0).algorithm)
    spec = PlantedSpec(local_heads=(2,), train_records=(40,), test_records=24, signal_len=256, seed=3)
    return planted_sites(config, spec, [SITE], Path("."))[0]


def released(terms: StudyTerms) -> tuple[TensorDict, TensorDict]:
    """(theta^g, phi_0) of the released model: the seeded round-0 model of the evaluated study's rules."""
    return initial_state(terms)


def adapted(terms: StudyTerms, data: SiteData) -> Any:
    """`evaluate_with_adaptation` of the released model at SITE."""
    theta, phi = released(terms)
    return evaluate_with_adaptation(terms, SITE, global_tensors=theta, initial_local=phi, data=data, runtime=RUNTIME)


def empty(split: SplitArrays) -> SplitArrays:
    """`split` without any record."""
    return split.subset(np.arange(0))


def test_without_adaptation_the_report_is_the_released_summary(site: SiteData) -> None:
    terms = evaluate_terms(0)
    theta, phi = released(terms)
    result = adapted(terms, site)
    expected = released_summary(
        terms, SITE, 0, global_tensors=theta, initial_local=phi, splits=[site.test], runtime=RUNTIME
    )
    assert result.before == expected
    assert result.before.n_samples == 24
    assert (result.after, result.adapt_records, result.local) == (None, None, None)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedper", "fedbn"])
def test_adaptation_trains_phi_and_leaves_every_shared_tensor_as_released(site: SiteData, algorithm: str) -> None:
    terms = evaluate_terms(2, algorithm, max_steps=3)
    theta, phi = released(terms)
    exchange = study_exchange(terms)
    ctx = adaptation_context(terms, SITE, global_tensors=theta, initial_local=phi, data=site, runtime=RUNTIME)
    with torch.random.fork_rng(devices=[]):
        state = adapt_local(ctx, 2).state_dict()
    batchnorm = set(model_names(ctx.config).batchnorm)
    assert batchnorm & set(exchange.partition.shared), "every algorithm here shares some BatchNorm tensors"
    assert [name for name in exchange.partition.shared if not state[name].equal(theta[name])] == []
    changed = {name for name in exchange.partition.local if not state[name].equal(phi[name])}
    assert "blocks.0.local_branch.out_proj.weight" in changed
    local_statistics = {name for name in exchange.partition.local if name.endswith("running_mean")}
    assert local_statistics <= changed  # BatchNorm statistics the site keeps adapt with phi


def test_shared_batchnorm_statistics_would_move_in_train_mode(site: SiteData) -> None:
    terms = evaluate_terms(1, max_steps=1)
    theta, phi = released(terms)
    ctx = adaptation_context(terms, SITE, global_tensors=theta, initial_local=phi, data=site, runtime=RUNTIME)
    model = ctx.build({**ctx.received, **ctx.own})
    trainable = [name for name, _ in model.named_parameters() if name in ctx.own]
    with torch.random.fork_rng(devices=[]):
        ctx.train(model, 1, trainable=trainable)  # no BatchNorm held: the check above is not vacuous
    assert not model.state_dict()["backbone.bn1.running_mean"].equal(theta["backbone.bn1.running_mean"])


def reference_phi(terms: StudyTerms, data: SiteData) -> TensorDict:
    """The phi a plain torch loop adapts: shared parameters frozen, BatchNorm in eval mode, SGD, the same batches."""
    theta, phi = released(terms)
    assert terms.evaluation is not None
    local = set(study_exchange(terms).partition.local)
    model = build_model(algorithm_model(terms.model, terms.algorithm), seed=terms.seed)
    model.load_state_dict({**theta, **phi})
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in local)
    training = terms.training
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad],
        lr=training.lr,
        momentum=training.momentum,
        weight_decay=training.weight_decay,
    )
    model.train()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            module.eval()
    seed = round_seed(terms.seed, 0, SITE)
    batches = torch.Generator().manual_seed(stable_seed(seed, ADAPT_PHASE))
    size = training.batch_size
    limit = None if training.max_steps is None else training.max_steps * size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # dropout's stream
        for _ in range(terms.evaluation.adapt_local_epochs):
            order = torch.randperm(len(data.train), generator=batches).numpy()[:limit]
            for start in range(0, len(order), size):
                rows = np.sort(order[start : start + size])
                x = torch.from_numpy(np.asarray(data.train.signals[rows], dtype=np.float32))
                y = torch.from_numpy(np.asarray(data.train.labels[rows], dtype=np.float32))
                loss = F.binary_cross_entropy_with_logits(model(x), y)
                optimizer.zero_grad()
                torch.autograd.backward(loss)
                optimizer.step()
    state = model.state_dict()
    return {name: state[name] for name in local}


def test_adaptation_is_the_plain_loop_over_the_same_batches(site: SiteData) -> None:
    terms = evaluate_terms(2, momentum=0.9, weight_decay=1e-3, max_steps=4)  # 4 of 5 batches per epoch
    result = adapted(terms, site)
    expected = reference_phi(terms, site)
    assert result.local is not None and result.local.keys() == expected.keys()
    assert [name for name in expected if not torch.equal(result.local[name], expected[name])] == []
    _, phi = released(terms)
    assert not result.local["blocks.1.local_branch.in_proj.weight"].equal(phi["blocks.1.local_branch.in_proj.weight"])
    assert result.adapt_records == 40


def test_the_report_after_is_the_released_summary_with_the_adapted_phi(site: SiteData) -> None:
    terms = evaluate_terms(1)
    theta, _ = released(terms)
    result = adapted(terms, site)
    again = released_summary(
        terms, SITE, 0, global_tensors=theta, initial_local=result.local, splits=[site.test], runtime=RUNTIME
    )
    assert result.after == again
    assert result.after != result.before


def test_the_same_call_gives_the_same_bytes(site: SiteData) -> None:
    terms = evaluate_terms(1, max_steps=3)
    first, second = adapted(terms, site), adapted(terms, site)
    assert (first.before, first.after, first.adapt_records) == (second.before, second.after, second.adapt_records)
    assert first.local is not None and second.local is not None
    assert all(first.local[name].equal(second.local[name]) for name in first.local)
    other = adapted(terms.model_copy(update={"seed": 8}), site)
    assert other.local is not None and not other.local["blocks.0.local_branch.in_proj.weight"].equal(
        first.local["blocks.0.local_branch.in_proj.weight"]
    )


def test_adapting_to_a_planted_site_lowers_its_losses(site: SiteData) -> None:
    terms = evaluate_terms(5)
    theta, phi = released(terms)
    result = adapted(terms, site)
    assert result.after is not None and result.after.loss < result.before.loss
    assert result.local is not None
    before, after = (
        released_summary(
            terms, SITE, 0, global_tensors=theta, initial_local=local, splits=[site.train], runtime=RUNTIME
        )
        for local in (phi, result.local)
    )
    assert after.loss < before.loss  # on the records it adapted on


def test_a_site_without_the_records_it_needs_is_refused(site: SiteData) -> None:
    no_test = replace(site, test=empty(site.test))
    with pytest.raises(ValueError, match="no test records"):
        adapted(evaluate_terms(0), no_test)
    no_train = replace(site, train=empty(site.train))
    with pytest.raises(ValueError, match="no training records"):
        adapted(evaluate_terms(1), no_train)
    assert adapted(evaluate_terms(0), no_train).after is None  # nothing to adapt: training records not needed


def test_only_an_evaluate_study_adapts(site: SiteData) -> None:
    terms = StudyTerms.model_validate({"model": {"preset": "tiny"}, "sites": [SITE]})
    with pytest.raises(ValueError, match="evaluate study"):
        adapted(terms, site)
