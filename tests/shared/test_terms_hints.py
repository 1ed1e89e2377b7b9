"""Terms that name their fix: a typo'd key names the field it is closest to, a head split must share out H heads."""

from __future__ import annotations

import pytest

from shared.errors import ModelConfigError, SharedError
from shared.terms import TermsError, terms_from
from shared.terms.field_names import did_you_mean
from shared.terms.model_config import preset
from shared.terms.study_terms import StudyTerms

SITES = ["lyon", "oslo", "rome"]


def problems(**raw: object) -> list[str]:
    with pytest.raises(TermsError) as refused:
        terms_from({"sites": SITES, **raw})
    return refused.value.problems


@pytest.mark.parametrize(
    ("raw", "line"),
    [
        ({"trainig": {"lr": 0.1}}, "trainig: Extra inputs are not permitted; did you mean `training`?"),
        (
            {"privacy": {"dp": {"noise_multiplyer": 1.0, "noise_multiplier": 1.0, "clip_norm": 1.0}}},
            "privacy.dp.noise_multiplyer: Extra inputs are not permitted; did you mean `noise_multiplier`?",
        ),
        (
            {"model": {"preset": "tiny", "hedas": "6:2"}},
            "model.hedas: Extra inputs are not permitted; did you mean `heads`?",
        ),
        ({"zzzz": 1}, "zzzz: Extra inputs are not permitted"),
    ],
)
def test_an_unknown_key_names_the_field_it_is_closest_to(raw: dict[str, object], line: str) -> None:
    assert line in problems(**raw)


def test_the_suggestion_follows_lists_and_stops_where_no_model_is() -> None:
    assert did_you_mean(StudyTerms, ("trainig",)) == "; did you mean `training`?"
    assert did_you_mean(StudyTerms, ("sites", 0, "nam")) == ""  # a list of names holds no model
    assert did_you_mean(StudyTerms, ("nosuch", "heads")) == ""
    assert did_you_mean(StudyTerms, ()) == ""


@pytest.mark.parametrize("name", ["paper", "small", "tiny"])
def test_a_split_of_another_head_count_is_refused(name: str) -> None:
    with pytest.raises(
        ModelConfigError, match=rf"heads '6:3' splits 9 heads; preset '{name}' has 8 \(H_g \+ H_l = 8\)"
    ):
        preset(name, "6:3")
    with pytest.raises(SharedError, match="splits 4 heads"):
        preset(name, "2:2")
    for split in ("8:0", "7:1", "6:2", "4:4", "0:8"):
        config = preset(name, split)
        assert config.heads == split and config.n_heads == 8


def test_the_terms_refuse_it_at_model_heads() -> None:
    assert problems(model={"preset": "paper", "heads": "6:3"}) == [
        "model.heads: heads '6:3' splits 9 heads; preset 'paper' has 8 (H_g + H_l = 8)"
    ]
    assert preset("resnet1d34", "-").heads == "-"  # no attention: its only split
