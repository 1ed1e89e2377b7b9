"""The global evaluation model at a site: theta^g, phi_0 for the local heads, the site's own BatchNorm if local."""

from __future__ import annotations

import numpy as np
import torch

from shared.algorithms.exchange import model_names
from shared.evaluation.metrics import EvalStats, parse_contribution
from shared.evaluation.summaries import pooled_summary
from shared.model.network import build_model
from shared.study.rules import initial_state, study_exchange
from shared.tensors.codec import TensorDict
from shared.terms import StudyTerms
from site_agent.data.loader import SiteData
from site_agent.local_round import LocalRoundSpec, run_local_evaluation
from tests.site_agent.algorithms.conftest import RUNTIME, local_round, make_site, study

SITES = {"lyon": make_site(21, n_train=16, n_test=24), "oslo": make_site(22, n_train=16, n_test=24)}


@torch.no_grad()
def _oracle(config: StudyTerms, state: TensorDict, data: SiteData) -> EvalStats:
    """Counts and histograms of the model holding `state`, computed by hand on the site's test split."""
    model = build_model(config.model.config(), config.seed)
    model.load_state_dict(state, strict=True)
    model.eval()
    scores = torch.sigmoid(model(torch.from_numpy(data.test.signals))).numpy()
    return EvalStats.from_predictions(data.test.labels, scores)


def _reported(config: StudyTerms, site: str, theta: TensorDict, kept: TensorDict) -> EvalStats:
    _, phi_0 = initial_state(config)
    spec = LocalRoundSpec.of(config, site, config.rounds + 1)
    result = run_local_evaluation(
        spec, global_tensors=theta, local_tensors=kept, initial_local=phi_0, data=SITES[site], runtime=RUNTIME
    )
    stats = parse_contribution(result.meta.metrics.eval_stats)
    assert stats is not None
    return stats


def _same_counts(first: EvalStats, second: EvalStats) -> bool:
    fields = ("tp", "fp", "fn", "pos_hist", "neg_hist")
    return all(np.array_equal(getattr(first, f), getattr(second, f)) for f in fields)


def test_fedbn_global_evaluation_uses_each_site_s_own_batchnorm() -> None:
    config = study("fedbn")
    theta, phi_0 = initial_state(config)
    exchange = study_exchange(config)
    batchnorm = set(model_names(config.model.config()).batchnorm) & set(exchange.partition.local)
    reported, oracles = [], []
    for site in SITES:
        kept = local_round(config, SITES[site], site=site).local  # phi_k: trained local heads and BatchNorm
        assert any(not torch.equal(kept[n], phi_0[n]) for n in batchnorm if n.endswith("running_var"))
        site_bn = {**theta, **phi_0, **{n: kept[n] for n in batchnorm}}
        reported.append(_reported(config, site, theta, kept))
        oracles.append(_oracle(config, site_bn, SITES[site]))
        assert _same_counts(reported[-1], oracles[-1])
        assert not _same_counts(reported[-1], _oracle(config, {**theta, **phi_0}, SITES[site]))  # not phi_0's
    pooled, expected = pooled_summary(reported), sum(oracles[1:], oracles[0])
    assert pooled["n_samples"] == expected.n_samples == 48
    assert pooled["micro_f1"] == expected.summary()["micro_f1"]
