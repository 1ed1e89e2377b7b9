"""Global's two readings in the runner and its report, and FedALA's averaged BatchNorm statistics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from cardiofl.experiment.config import ExperimentConfig
from cardiofl.experiment.grid import run_experiment
from cardiofl.experiment.readings import PHI_K_AVERAGED, averaged_local, pooled_reading
from cardiofl.experiment.report import write_report
from cardiofl.experiment.results import read_results
from cardiofl.experiment.runner import load_sites, simulate_study
from shared.algorithms.exchange import GLOBAL, GLOBAL_SITE_BN, model_names
from shared.study.rules import initial_state, study_exchange
from site_agent.device import resolve_runtime

CPU = resolve_runtime("cpu")


def experiment(tmp_path: Path, methods: list[dict[str, Any]], rounds: int = 2) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "name": "readings",
            "preset": "tiny",
            "heads": ["6:2"],
            "seeds": [0],
            "rounds": rounds,
            "synthetic": {"sites": 2, "records_per_site": 30, "seed": 5},
            "training": {"optimizer": "adam", "lr": 0.003, "batch_size": 8, "max_steps": 2},
            "device": "cpu",
            "cache_dir": str(tmp_path / "cache"),
            "privacy": {"min_records": 3},
            "methods": methods,
        }
    )


def method(name: str, **params: object) -> dict[str, Any]:
    return {"label": name, "algorithm": {"name": name, "params": params}, "aggregation": {"name": "samples"}}


def test_fedala_as_fedcvd_averages_the_sites_bn_statistics(tmp_path: Path) -> None:
    config = experiment(tmp_path, [method("fedala")], rounds=1)
    (key,) = config.runs()
    study = config.study(key)
    first = next(simulate_study(study, load_sites(config), CPU))
    theta_0, _ = initial_state(study)
    for name in model_names(study.model.config()).buffers:
        aggregated = first.global_model[name]
        if name.endswith("num_batches_tracked"):  # a count: the largest, as for every integer tensor
            assert aggregated == max(r.shared[name] for r in first.results.values())
            continue
        expected = sum(first.weights[site] * r.shared[name].double() for site, r in first.results.items())
        torch.testing.assert_close(aggregated, expected.float(), rtol=1e-6, atol=1e-7)
        if name.endswith("running_var"):  # trained at the sites: no longer phi_0's ones
            assert not torch.equal(aggregated, theta_0[name])


def test_averaged_local_weights_each_site_s_tensors() -> None:
    private = {"a": {"w": torch.tensor([0.0, 4.0])}, "b": {"w": torch.tensor([2.0, 8.0])}}
    torch.testing.assert_close(averaged_local(private, {"a": 0.75, "b": 0.25}, ("w",))["w"], torch.tensor([0.5, 5.0]))


def test_the_runner_reports_both_global_readings_labelled(tmp_path: Path) -> None:
    config = experiment(tmp_path, [method("fedavg"), method("fedbn")], rounds=1)
    results = tmp_path / "results.jsonl"
    run_experiment(config, results, runtime=CPU)
    records = [json.loads(line) for line in results.read_text().splitlines()]
    final = {r["method"]: r for r in records if r["type"] == "round" and r["kind"] == "evaluate"}
    assert final["fedavg"]["global_label"] == GLOBAL and final["fedbn"]["global_label"] == GLOBAL_SITE_BN
    assert all(set(r["global_readings"]) == {PHI_K_AVERAGED} for r in final.values())

    # the averaged reading is theta^g_T with the sites' phi_k averaged by theta^g_T's weights, pooled
    key = next(k for k in config.runs() if k.method == "fedbn")
    study, data = config.study(key), load_sites(config)
    outcomes = list(simulate_study(study, data, CPU))
    last, evaluation = outcomes[-2], outcomes[-1]
    partition = study_exchange(study).partition
    private = {site: result.local for site, result in last.results.items()}
    state = {
        **{n: last.global_model[n] for n in partition.shared},
        **averaged_local(private, last.weights, partition.local),
    }
    assert evaluation.readings[PHI_K_AVERAGED] == pooled_reading(study, state, data, CPU)

    runs = {run.method: run for run in read_results(results)}
    assert runs["fedbn"].global_label == GLOBAL_SITE_BN and runs["fedbn"].summary(PHI_K_AVERAGED) is not None
    written = write_report(results, tmp_path / "report")
    table = written["table.md"].read_text()
    for reading in (GLOBAL, PHI_K_AVERAGED):  # the clinical figures beside FedCVD's, for each reading
        assert f"| {reading} F1 | {reading} mAP | {reading} AUROC | {reading} bal. acc. |" in table
    assert f"{GLOBAL_SITE_BN}: for fedbn" in table and "simulation only" in table
    header = written["table.csv"].read_text().splitlines()[0]
    assert "Global_micro_f1_mean" in header and "Global_phi_k_averaged_map_std" in header
