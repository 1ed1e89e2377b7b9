"""A study's terms: one frozen type, validated once, every error at its field's path, importable without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.labels import CLASS_NAMES
from shared.study.checks import Problem, check_study, checked_terms
from shared.study.description import terms_differences
from shared.terms import StudyTerms, TermsError, read_terms_file, terms_from
from shared.wire.protocol import StudyOffer, TaskSpec

ROOT = Path(__file__).resolve().parents[2]
TINY = {"preset": "tiny", "heads": "6:2"}
THREE = ["lyon", "oslo", "rome"]


def test_the_terms_import_without_torch() -> None:
    blocked = "import sys; sys.modules['torch'] = None; import shared.terms; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"  # present only as the blocked entry: nothing imported it


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({"sites": THREE, "model": {"preset": "huge"}}, "model.preset"),
        ({"sites": THREE, "model": {"preset": "tiny", "heads": "six"}}, "model.heads"),
        ({"sites": THREE, "model": {**TINY, "site_heads": {"lyon": "9:9"}}}, "model.site_heads.lyon"),
        ({"sites": THREE, "algorithm": {"name": "fedmagic"}}, "algorithm.name"),
        ({"sites": THREE, "algorithm": {"name": "fedprox", "params": {"mu": -1}}}, "algorithm.params.mu"),
        ({"sites": THREE, "participation": {"name": "random", "params": {"p": 2}}}, "participation.params.p"),
        ({"sites": THREE, "aggregation": {"name": "smoothed", "params": {"beta": 1}}}, "aggregation.params.beta"),
        ({"sites": THREE, "min_sites": 4}, "min_sites"),
        ({"sites": ["lyon", "lyon"]}, "sites"),
        ({"sites": THREE, "labels": ["NORM"]}, "labels"),
        ({"sites": THREE, "training": {"lr": 0}}, "training.lr"),
        (
            {"sites": THREE, "privacy": {"dp": {"noise_multiplier": 1.0, "clip_norm": 1.0}}},
            "aggregation.name",  # DP weighs sites equally
        ),
        (
            {
                "sites": THREE,
                "aggregation": {"name": "equal"},
                "rounds": 5,
                "privacy": {"dp": {"noise_multiplier": 0.1, "clip_norm": 1.0, "epsilon_budget": 0.001}},
            },
            "privacy.dp.epsilon_budget",
        ),
        ({"sites": THREE, "min_sites": 1, "privacy": {"secure_aggregation": {}}}, "min_sites"),
        (
            {"sites": THREE, "min_sites": 2, "privacy": {"secure_aggregation": {"threshold": 5}}},
            "privacy.secure_aggregation.threshold",
        ),
        (
            {
                "sites": [f"s{i}" for i in range(8)],
                "min_sites": 6,
                "privacy": {"secure_aggregation": {"neighbour_count": 3}},
            },
            "privacy.secure_aggregation.neighbour_count",
        ),
        ({"sites": THREE, "surprise": 1}, "surprise"),
    ],
)
def test_every_error_names_its_fields_path(raw: dict, path: str) -> None:
    with pytest.raises(TermsError) as refused:
        checked_terms(raw)
    assert any(line.startswith(f"{path}: ") for line in refused.value.problems), refused.value.problems


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({"sites": THREE, "algorithm": {"name": "nope"}}, "algorithm.name"),
        ({"sites": THREE, "algorithm": {"name": "fedprox", "params": {"mu": -1}}}, "algorithm.params.mu"),
        ({"sites": THREE, "participation": {"name": "random", "params": {"p": 2}}}, "participation.params.p"),
        ({"sites": THREE, "min_sites": 1, "privacy": {"secure_aggregation": {}}}, "min_sites"),
        (
            {
                "sites": THREE,
                "aggregation": {"name": "equal"},
                "privacy": {"dp": {"noise_multiplier": 1, "clip_norm": 1}, "secure_aggregation": None},
                "algorithm": {"name": "scaffold"},
            },
            "algorithm.name",
        ),
    ],
)
def test_the_terms_are_data_and_check_study_finds_what_needs_the_registry(raw: dict, path: str) -> None:
    terms = terms_from(raw)  # every field is well formed: the types take it
    problems = check_study(terms)
    assert problems and all(isinstance(problem, Problem) for problem in problems)
    assert any(str(problem).startswith(path) for problem in problems), problems


@pytest.mark.parametrize(
    ("changes", "path"),
    [
        ({"privacy": {"secure_aggregation": {}}}, "privacy.secure_aggregation"),
        ({"aggregation": {"name": "equal"}, "privacy": {"dp": {"noise_multiplier": 1, "clip_norm": 1}}}, "privacy.dp"),
        ({"model": {**TINY, "site_heads": {"oslo": "3:5"}}}, "model.site_heads"),
    ],
)
def test_the_local_baseline_refuses_terms_about_what_sites_upload(changes: dict, path: str) -> None:
    local = {"sites": THREE, "model": TINY, "algorithm": {"name": "local"}}
    assert check_study(terms_from(local)) == []
    (problem,) = check_study(terms_from({**local, **changes}))  # that one reason alone, at its setting
    assert str(problem).startswith(f"{path}: ") and "algorithm 'local' uploads no tensor" in str(problem)


def test_checked_terms_write_every_rules_params_out_and_the_typed_terms_round_trip() -> None:
    raw = {"sites": THREE, "algorithm": {"name": "fedprox"}, "participation": {"name": "all"}}
    terms = checked_terms(raw)
    assert terms.algorithm.params == {"mu": 0.01}  # the default, written out: what a site's operator approves
    assert check_study(terms) == [] and checked_terms(terms) == terms
    assert StudyTerms.model_validate_json(terms.model_dump_json()) == terms


def test_validating_and_checking_terms_loads_no_torch_below_the_check() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; from shared.terms import terms_from; "
        "t = terms_from({'sites': ['a', 'b'], 'algorithm': {'name': 'whatever'}}); print(t.algorithm.name)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "whatever"


def test_terms_are_frozen_and_fill_their_defaults() -> None:
    terms = StudyTerms(sites=["lyon"])
    assert terms.labels == CLASS_NAMES and terms.model.preset == "paper" and terms.privacy.min_records == 20
    with pytest.raises(ValidationError):
        terms.rounds = 3  # type: ignore[misc]
    assert StudyTerms.model_validate_json(terms.model_dump_json()) == terms


def test_tasks_and_offers_embed_the_terms_and_repeat_none_of_their_fields() -> None:
    terms = set(StudyTerms.model_fields) - {"kind"}  # the study's kind; a task's `kind` is its round's
    assert "terms" in TaskSpec.model_fields and "terms" in StudyOffer.model_fields
    assert terms.isdisjoint(TaskSpec.model_fields), terms & set(TaskSpec.model_fields)
    assert terms.isdisjoint(StudyOffer.model_fields), terms & set(StudyOffer.model_fields)


def test_differences_are_named_by_path() -> None:
    first = StudyTerms(sites=["lyon", "oslo"], model=TINY)
    second = first.model_copy(update={"seed": 4, "training": first.training.model_copy(update={"lr": 0.5})})
    assert terms_differences(first, second) == ["seed", "training.lr"]
    assert terms_differences(first, first) == []


def test_a_toml_file_is_read_with_its_name_and_refused_with_every_path(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('name = "trial"\nsites = ["lyon"]\nrounds = 3\n[model]\npreset = "tiny"\n')
    name, terms = read_terms_file(good)
    assert (name, terms.rounds, terms.model.heads) == ("trial", 3, "6:2")
    bad = tmp_path / "bad.toml"
    bad.write_text('sites = ["lyon"]\nrounds = 0\n[training]\nlr = -1\n')
    with pytest.raises(TermsError) as refused:
        read_terms_file(bad)
    assert str(bad) in str(refused.value)
    assert {line.split(":")[0] for line in refused.value.problems} == {"rounds", "training.lr"}
    with pytest.raises(TermsError, match="cannot read it"):
        read_terms_file(tmp_path / "missing.toml")
