import math
from typing import Any

import pytest
import torch
from torch import nn

from shared.model.network import build_model, preset
from shared.study.rules import initial_state
from site_agent import local_round as local_round_module
from site_agent.algorithms import base, uncertainty
from site_agent.algorithms.uncertainty import mc_dropout_entropy
from site_agent.data.loader import SiteData, SplitArrays
from site_agent.local_round import LocalRoundSpec, run_local_evaluation
from tests.site_agent.algorithms.conftest import RUNTIME, local_round, make_split, study


class Undecided(nn.Module):
    """Logits 0 for every class: p = 0.5, the largest binary entropy, ln 2."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(x.shape[0], 20)


def test_an_undecided_model_has_entropy_ln_2() -> None:
    assert mc_dropout_entropy(Undecided(), make_split(5, 0), RUNTIME, passes=3) == pytest.approx(math.log(2))


def test_without_dropout_the_entropy_is_that_of_the_plain_prediction() -> None:
    config = preset("tiny", "6:2")
    model = build_model(type(config)(**{**config.__dict__, "dropout": 0.0}), seed=1)
    split = make_split(7, 3)
    model.eval()
    with torch.no_grad():
        p = torch.sigmoid(model(torch.from_numpy(split.signals)))
    expected = float((-(p * p.log() + (1 - p) * (1 - p).log())).mean())
    assert mc_dropout_entropy(model, split, RUNTIME, passes=4) == pytest.approx(expected, rel=1e-5)


def test_dropout_passes_are_stochastic_and_the_statistics_untouched() -> None:
    model = build_model(preset("tiny", "6:2"), seed=1)
    model.blocks[0].ffn.dropout.p = 0.5  # strong dropout: the passes disagree
    split = make_split(6, 4)
    statistics = model.backbone.bn1.running_mean.clone()
    torch.manual_seed(0)
    one = mc_dropout_entropy(model, split, RUNTIME, passes=1)
    torch.manual_seed(0)
    again = mc_dropout_entropy(model, split, RUNTIME, passes=1)
    many = mc_dropout_entropy(model, split, RUNTIME, passes=8)
    assert one == again and one != many and 0 < many <= math.log(2)
    assert torch.equal(model.backbone.bn1.running_mean, statistics) and not model.training


def test_the_update_reports_h_k_only_for_the_uncertainty_weighting(site: SiteData) -> None:
    weighted = local_round(study(aggregation={"name": "uncertainty", "params": {"mc_passes": 2}}), site)
    entropy = weighted.meta.metrics.model_extra["entropy"]  # type: ignore[index]
    assert 0 < entropy <= math.log(2)
    plain = local_round(study(), site)
    assert "entropy" not in (plain.meta.metrics.model_extra or {})


def record_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[SplitArrays]]:
    """The splits a round reads: to train on, to measure H_k on, and to evaluate on (the test split)."""
    reads: dict[str, list[SplitArrays]] = {"train": [], "entropy": [], "evaluate": []}
    for part, module in (("train", base), ("entropy", uncertainty), ("evaluate", local_round_module)):
        original = module.iterate_batches

        def recording(split: SplitArrays, *args: Any, _part: str = part, _original: Any = original, **kw: Any) -> Any:
            reads[_part].append(split)
            return _original(split, *args, **kw)

        monkeypatch.setattr(module, "iterate_batches", recording)
    return reads


def ids(splits: list[SplitArrays]) -> set[tuple[str, ...]]:
    return {split.record_ids for split in splits}


WEIGHTED = {"name": "uncertainty", "params": {"mc_passes": 2, "validation_fraction": 0.25}}


def test_h_k_is_measured_on_training_records_held_out_never_on_the_test_split(
    site: SiteData, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = record_reads(monkeypatch)
    result = local_round(study(aggregation=WEIGHTED), site)
    (trained,) = ids(reads["train"])
    (measured,) = ids(reads["entropy"])
    assert ids(reads["evaluate"]) == {site.test.record_ids}
    assert len(measured) == 5  # 25 % of the site's 20 training records
    assert set(measured).isdisjoint(site.test.record_ids) and set(measured).isdisjoint(trained)
    assert set(trained) | set(measured) == set(site.train.record_ids)
    assert result.meta.num_examples == len(trained) == 15  # n_k counts the records trained on


def test_the_validation_carve_is_the_same_every_round_and_differs_between_sites(
    site: SiteData, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = record_reads(monkeypatch)
    for round_, name in ((1, "lyon"), (3, "lyon"), (1, "oslo")):
        local_round(study(aggregation=WEIGHTED), site, round_=round_, site=name)
    lyon_1, lyon_3, oslo = (split.record_ids for split in reads["entropy"])
    assert lyon_1 == lyon_3 and lyon_1 != oslo
    changed = study(aggregation=WEIGHTED, seed=6)  # another study seed, another carve
    local_round(changed, site)
    assert reads["entropy"][-1].record_ids != lyon_1


def test_without_uncertainty_the_round_trains_on_the_whole_training_split(
    site: SiteData, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = record_reads(monkeypatch)
    result = local_round(study(), site)
    assert reads["entropy"] == [] and reads["train"] and all(split is site.train for split in reads["train"])
    assert result.meta.num_examples == len(site.train) == 20


def test_the_final_evaluation_reports_the_n_k_trained_on(site: SiteData) -> None:
    config = study(aggregation=WEIGHTED)
    theta, phi = initial_state(config)
    spec = LocalRoundSpec.of(config, "lyon", config.rounds + 1)
    final = run_local_evaluation(
        spec, global_tensors=theta, local_tensors=phi, initial_local=phi, data=site, runtime=RUNTIME
    )
    assert final.meta.num_examples == 15
