import re

import pytest
import torch
from pydantic import ValidationError

from shared.study.checks import checked_terms
from shared.tensors.codec import read_header
from shared.tensors.update_body import encode_update
from shared.terms import StudyTerms, TermsError
from shared.wire.protocol import UPDATE_META_KEY, UpdateMeta


def test_study_config_defaults_follow_fedcvd() -> None:
    config = StudyTerms(sites=["a"])
    assert (config.training.lr, config.training.batch_size, config.training.local_epochs) == (0.1, 32, 1)
    assert (config.algorithm.name, config.aggregation.name, config.participation.name) == ("fedavg", "samples", "all")
    assert (config.model.preset, config.model.heads) == ("paper", "6:2")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"algorithm": {"name": "fedmagic"}}, "unknown algorithm 'fedmagic'"),
        ({"aggregation": {"name": "median"}}, "unknown aggregation weighting"),
        ({"participation": {"name": "some"}}, "unknown participation policy"),
        ({"aggregation": {"name": "equal", "params": {"alpha": 1}}}, "aggregation.params.alpha"),
        ({"model": {"preset": "huge"}}, "unknown model preset"),
        ({"model": {"preset": "tiny", "heads": "six"}}, "head split"),
        ({"sites": ["a", "a"]}, "distinct"),
        ({"sites": ["Bad Name"]}, "pattern"),
        ({"min_sites": 3}, "exceeds"),
        ({"rounds": 0}, "greater than or equal"),
        ({"round_deadline_s": float("nan")}, "finite"),
        ({"surprise": 1}, "Extra inputs"),
    ],
)
def test_study_config_refuses_bad_values(changes: dict, match: str) -> None:
    with pytest.raises((ValidationError, TermsError), match=match):
        checked_terms({"sites": ["a", "b"], **changes})


def test_update_meta_rides_in_the_safetensors_header() -> None:
    meta = UpdateMeta(num_examples=12, metrics={"loss": 0.5, "accuracy": 0.9}, train_seconds=1.5)
    body = encode_update({"w": torch.ones(2)}, meta)
    metadata = read_header(body).metadata
    assert set(metadata) == {UPDATE_META_KEY}
    decoded = UpdateMeta.from_metadata(metadata)
    assert decoded == meta and decoded.metrics.model_extra == {"accuracy": 0.9}


@pytest.mark.parametrize(
    "metadata",
    [{}, {UPDATE_META_KEY: "{"}, {UPDATE_META_KEY: '{"num_examples": 0, "metrics": {"loss": 1}, "train_seconds": 0}'}],
)
def test_update_meta_refuses_missing_or_bad_entries(metadata: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        UpdateMeta.from_metadata(metadata)


def test_update_meta_refuses_non_finite_loss() -> None:
    with pytest.raises(ValidationError):
        UpdateMeta.model_validate_json('{"num_examples": 1, "metrics": {"loss": NaN}, "train_seconds": 0}')


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        (1e13, "metrics.eval_stats.hist[2][1]"),
        (-1e13, "metrics.eval_stats.hist[2][1]"),
        (10**13, "metrics.eval_stats.hist[2][1]"),
    ],
)
def test_a_number_out_of_range_deep_in_a_report_is_named_by_its_path(bad: float, where: str) -> None:
    from shared.errors import MetricsError
    from shared.wire.protocol import _check_numbers

    hist = [[0.5] * 3, [1, 2, 3], [True, 0.0, 7]]
    report = {"loss": 0.1, "eval_stats": {"n": 3, "hist": hist}, "tuple": (1.0, [2.0, {"x": 1e12}])}
    _check_numbers(report, "metrics")  # every number at most 1e12 and finite: accepted
    hist[2][1] = bad
    with pytest.raises(MetricsError, match=re.escape(f"{where} is {bad!r}")):
        _check_numbers(report, "metrics")
    for non_finite in (float("nan"), float("inf"), float("-inf")):
        report["tuple"] = (1.0, [2.0, {"x": non_finite}])
        with pytest.raises(MetricsError, match=re.escape("metrics.eval_stats.hist[2][1]")):
            _check_numbers(report, "metrics")  # the first one found, in order
        hist[2][1] = 0.0
        with pytest.raises(MetricsError, match=re.escape(f"metrics.tuple[1][1].x is {non_finite!r}")):
            _check_numbers(report, "metrics")
        hist[2][1] = bad
