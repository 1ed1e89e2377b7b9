import math

import pytest
import torch
from torch import nn

from shared.model import build_model, preset
from site_agent.algorithms.uncertainty import mc_dropout_entropy
from site_agent.data.loader import SiteData
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
