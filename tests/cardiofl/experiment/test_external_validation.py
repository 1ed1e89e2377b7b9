"""Validation sites in the runner: they leave every theta^g as it is, and report what their agents would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.experiment.config import ExperimentConfig
from cardiofl.experiment.results import external_rows, read_results
from cardiofl.experiment.runner import load_sites, simulate_study
from shared.study.rules import initial_state
from shared.terms import StudyTerms
from site_agent.device import resolve_runtime
from site_agent.released_evaluation import released_summary

CPU = resolve_runtime("cpu")


def experiment(tmp_path: Path, **changes: Any) -> ExperimentConfig:
    """Three synthetic sites, the third validating every 2nd of 3 rounds (and the final one)."""
    values: dict[str, Any] = {
        "name": "external",
        "preset": "tiny",
        "heads": ["6:2"],
        "seeds": [0],
        "rounds": 3,
        "synthetic": {"sites": 3, "records_per_site": 30, "seed": 5},
        "training": {"optimizer": "adam", "lr": 0.003, "batch_size": 8, "max_steps": 2},
        "device": "cpu",
        "cache_dir": str(tmp_path / "cache"),
        "privacy": {"min_records": 3},
        "validation_sites": ["site-3"],
        "validation_every": 2,
        **changes,
    }
    return ExperimentConfig.model_validate(values)


def without_validation(study: StudyTerms) -> StudyTerms:
    """The same study with no validation site."""
    raw = study.model_dump(mode="json")
    raw.pop("validation_sites"), raw.pop("validation_every")
    return StudyTerms.model_validate(raw)


def test_validation_sites_leave_every_theta_g_bit_identical_and_report_released_summary(tmp_path: Path) -> None:
    config = experiment(tmp_path)
    (key,) = config.runs()
    study = config.study(key)
    assert (study.sites, study.validation_sites, study.validation_every) == (["site-1", "site-2"], ["site-3"], 2)
    data = load_sites(config)
    validated = list(simulate_study(study, data, CPU))
    plain_study = without_validation(study)
    plain = list(simulate_study(plain_study, {site: data[site] for site in plain_study.sites}, CPU))

    assert [o.round for o in validated] == [o.round for o in plain] == [1, 2, 3, 4]
    for with_sites, alone in zip(validated, plain, strict=True):
        assert with_sites.global_model.keys() == alone.global_model.keys()
        assert all(torch.equal(with_sites.global_model[k], alone.global_model[k]) for k in alone.global_model)
        assert set(with_sites.results) == {"site-1", "site-2"}  # the validation site never trains
        assert with_sites.weights == alone.weights
        record, plain_record = with_sites.record(20), alone.record(20)
        record.pop("external", None)
        assert record == plain_record

    assert [o.round for o in validated if o.external] == [2, 3]  # every 2nd round, and the final round 3
    _, phi_0 = initial_state(study)
    site = data["site-3"]
    for outcome in validated[1:3]:
        direct = released_summary(
            study,
            "site-3",
            outcome.round,
            global_tensors=outcome.global_model,
            initial_local=phi_0,
            splits=[site.train, site.test],
            runtime=CPU,
        )
        assert outcome.external == {"site-3": direct}
        assert direct.n_samples == len(site.train) + len(site.test)
        assert outcome.record(20)["external"] == {"site-3": direct.model_dump(mode="json")}


def test_external_figures_reach_the_results_the_cli_and_the_report(tmp_path: Path) -> None:
    config = tmp_path / "external.toml"
    config.write_text(
        'name = "external"\npreset = "tiny"\nheads = ["6:2"]\nseeds = [0]\nrounds = 3\ndevice = "cpu"\n'
        f'cache_dir = "{tmp_path / "cache"}"\nvalidation_sites = ["site-3"]\nvalidation_every = 2\n'
        "[privacy]\nmin_records = 3\n[synthetic]\nsites = 3\nrecords_per_site = 30\nseed = 5\n"
        '[training]\noptimizer = "adam"\nlr = 0.003\nbatch_size = 8\nmax_steps = 2\n'
    )
    results = tmp_path / "results.jsonl"
    done = CliRunner().invoke(app, ["experiment", "run", str(config), "--results", str(results)])
    assert done.exit_code == 0, done.output
    rounds = [json.loads(line) for line in results.read_text().splitlines() if '"round"' in line]
    assert [r["round"] for r in rounds if "external" in r] == [2, 3]
    assert all(r["site_order"] == ["site-1", "site-2"] and "site-3" not in r["sites"] for r in rounds)
    for t in (2, 3):
        shown = rounds[t - 1]["external"]["site-3"]
        line = f"site-3 (external) on theta^g_{t}: micro-F1 {shown['micro_f1']}, mAP {shown['map']}"
        assert line in " ".join(done.output.split())

    (run,) = read_results(results)
    assert [t for t, _ in run.external["site-3"]] == [2, 3]
    final = run.external["site-3"][-1][1]
    assert final == rounds[2]["external"]["site-3"]
    f1 = final["micro_f1"]
    assert f1 is not None
    sites, columns, rows = external_rows([run])
    assert sites == ["site-3"] and columns[:2] == [("site-3", "micro_f1"), ("site-3", "map")]
    assert rows[("FedDualAtt", "6:2")]["site-3:micro_f1"] == (100 * f1, 0.0)

    table = (tmp_path / "results" / "table.md").read_text()
    table_i, external = table.split("## External validation")
    assert "site-3" not in table_i  # Table I: the training sites' columns only
    assert "| Method | H_g:H_l | site-3 F1 | site-3 mAP" in external
    assert f"{100 * f1:.1f}±0.0" in external


def test_validation_sites_are_among_the_experiments_sites_and_need_a_shared_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"validation_sites: \['site-9'\] are not among the experiment's sites"):
        experiment(tmp_path, validation_sites=["site-9"])
    local = [{"label": "Local", "algorithm": {"name": "local"}}]
    with pytest.raises(ValueError, match="algorithm 'local' releases no shared model for validation sites"):
        experiment(tmp_path, methods=local)
    assert experiment(tmp_path, validation_sites=[]).study(experiment(tmp_path).runs()[0]).validation_sites == []
