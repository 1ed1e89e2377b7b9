"""The in-process experiment runner: results, resuming, reports, and bit-identity with the service."""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from cardiofl.experiment.config import ExperimentConfig, load_experiment
from cardiofl.experiment.grid import Placement, finished_runs, run_experiment
from cardiofl.experiment.report import write_report
from cardiofl.experiment.results import read_results
from cardiofl.experiment.runner import load_sites, simulate_study
from shared.tensors.codec import load
from shared.terms import StudyTerms
from site_agent.client import CoordinatorClient
from site_agent.device import resolve_runtime
from site_agent.store import SiteStore, generate_key
from site_agent.worker import SiteWorker
from tests.coordinator.factories import ADMIN, enrol

CPU = resolve_runtime("cpu")


def tiny_experiment(tmp_path: Path, **changes: object) -> ExperimentConfig:
    values: dict[str, object] = {
        "name": "tiny",
        "preset": "tiny",
        "heads": ["8:0", "6:2"],
        "seeds": [0, 1],
        "rounds": 2,
        "synthetic": {"sites": 2, "records_per_site": 30, "seed": 5},
        "training": {"optimizer": "adam", "lr": 0.003, "batch_size": 8, "max_steps": 2},
        "device": "cpu",
        "cache_dir": str(tmp_path / "cache"),
        **changes,
    }
    return ExperimentConfig.model_validate(values)


def test_run_writes_results_and_resumes_after_an_interruption(tmp_path: Path) -> None:
    config = tiny_experiment(tmp_path, privacy={"min_records": 3})  # about 6 test records per site
    results = tmp_path / "results.jsonl"
    seen: list[str] = []

    def interrupt(key, record) -> None:  # noqa: ANN001
        seen.append(f"{key.id}#{record['round']}")
        if len(seen) == 5:  # in the middle of the second run
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, results, runtime=CPU, on_round=interrupt)
    assert finished_runs(results) == {"FedDualAtt|8:0|0"}
    ran = run_experiment(config, results, runtime=CPU)
    assert [k.id for k in ran] == ["FedDualAtt|8:0|1", "FedDualAtt|6:2|0", "FedDualAtt|6:2|1"]
    assert finished_runs(results) == {k.id for k in config.runs()}
    assert run_experiment(config, results, runtime=CPU) == []  # nothing left
    records = [json.loads(line) for line in results.read_text().splitlines()]
    done = [r for r in records if r["type"] == "run_done"]
    assert len(done) == 4 and len({r["run"] for r in done}) == 4
    runs = read_results(results)
    assert len(runs) == 4  # the interrupted attempt's rounds are ignored
    for run in runs:
        assert [t for t, _ in run.curve] == [1, 2]
        assert set(run.sites) == {"site-1", "site-2"} and run.global_["n_samples"] > 0


def records_by_run(path: Path) -> dict[str, list[dict[str, object]]]:
    """Each run's records in order, without what differs between two runs of the same grid point."""
    runs: dict[str, list[dict[str, object]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        record.pop("attempt")
        record.pop("seconds", None)
        runs.setdefault(record["run"], []).append(record)
    return runs


def test_runs_in_worker_processes_write_the_records_they_would_alone(tmp_path: Path) -> None:
    config = tiny_experiment(tmp_path, privacy={"min_records": 3})
    alone, parallel = tmp_path / "alone.jsonl", tmp_path / "parallel.jsonl"
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))  # a worker's share: sums over threads round their own way
    try:
        run_experiment(config, alone, runtime=CPU)
    finally:
        torch.set_num_threads(threads)
    seen: list[tuple[str, int]] = []
    ran = run_experiment(
        config,
        parallel,
        runtime=CPU,
        placement=Placement(jobs=2),
        on_round=lambda key, record: seen.append((key.id, record["round"])),
    )
    assert [key.id for key in ran] == [key.id for key in config.runs()]
    assert records_by_run(parallel) == records_by_run(alone)  # every metric to the bit
    assert finished_runs(parallel) == {key.id for key in config.runs()}
    expected = [(key.id, number) for key in config.runs() for number in range(1, config.rounds + 2)]
    assert sorted(seen) == sorted(expected)
    assert run_experiment(config, parallel, runtime=CPU, placement=Placement(jobs=2)) == []


def test_report_writes_table_i_and_plots(tmp_path: Path) -> None:
    config = tiny_experiment(tmp_path, seeds=[0, 1], privacy={"min_records": 3})
    results = tmp_path / "results.jsonl"
    run_experiment(config, results, runtime=CPU)
    written = write_report(results, tmp_path / "report")
    table = written["table.md"].read_text()
    assert "| FedDualAtt | 8:0 |" in table and "| FedDualAtt | 6:2 |" in table
    assert "Global F1" in table and "site-1 mAP" in table and "**" in table and "±" in table
    rows = written["table.csv"].read_text().splitlines()
    assert rows[0].startswith("method,heads,seeds,site-1_micro_f1_mean") and len(rows) == 3
    for name in ("curves.png", "head_ratio_deltas.png"):
        assert written[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # mean and std over seeds are computed from the finished runs
    runs = [r for r in read_results(results) if r.heads == "6:2"]
    values = [100 * r.global_["micro_f1"] for r in runs]
    mean = sum(values) / 2
    assert f"{mean:.1f}±" in table
    # the sites sent their clinical figures (min_records 3): macro-AUROC and balanced accuracy are columns too
    assert "Global AUROC" in table and "site-1 bal. acc." in table and "AUROC: macro-AUROC" in table
    (row,) = [row for row in csv.DictReader(io.StringIO(written["table.csv"].read_text())) if row["heads"] == "6:2"]
    expected = {
        "Global_macro_auroc_mean": statistics.fmean(100 * r.global_["macro_auroc"] for r in runs),
        "site-1_balanced_accuracy_mean": statistics.fmean(100 * r.sites["site-1"]["balanced_accuracy"] for r in runs),
    }
    assert {name: float(row[name]) for name in expected} == pytest.approx(expected, abs=1e-4)


def test_report_says_when_the_minimum_of_records_was_lowered_or_left_sites_out(tmp_path: Path) -> None:
    notes = {}
    for min_records in (3, 20):  # about 6 test records per site
        config = tiny_experiment(tmp_path, seeds=[0], heads=["6:2"], privacy={"min_records": min_records})
        results = tmp_path / f"results-{min_records}.jsonl"
        run_experiment(config, results, runtime=CPU)
        (run,) = read_results(results)
        notes[min_records] = write_report(results, tmp_path / f"report-{min_records}")["table.md"].read_text()
        if min_records == 3:
            assert run.global_["n_sites"] == 2 and run.global_["n_samples"] > 0 and run.too_few == ()
        else:
            assert run.global_["n_sites"] == 0 and run.global_["map"] is None
            assert run.too_few == ("site-1", "site-2") and run.sites["site-1"]["map"] is not None
    assert "from 3 test records on, lowered from the default minimum of 20" in notes[3]
    assert "lacks" not in notes[3]
    assert "Global lacks the test records of site-1, site-2 (too few records)" in notes[20]
    assert "lowered" not in notes[20]
    assert "AUROC" not in notes[20]  # sites below the minimum send no clinical figure: no column for them


def test_shipped_configs_load() -> None:
    cpu = load_experiment("cpu")
    assert len(cpu.runs()) == 18 + 2 and cpu.preset == "tiny" and cpu.study(cpu.runs()[0]).privacy.min_records == 20
    real = load_experiment("cpu-real")
    assert len(real.runs()) == 15 + 5 and real.privacy.min_records == 20
    for shipped in (cpu, real):  # the local baseline beside FedDualAtt, for local_vs_federated.png
        assert [key.heads for key in shipped.runs() if key.method == "Local"] == ["8:0"] * len(shipped.seeds)
        assert shipped.method("Local").algorithm.name == "local"
    assert [site.name for site in real.sites] == ["g12ec", "ningbo-sxph", "cpsc-ptbxl", "ludb"]
    assert {source.test_fraction for site in real.sites for source in site.data} == {0.4}
    paper = load_experiment("paper")
    assert paper.privacy.min_records == 20  # the default: the paper's sites have thousands of test records
    assert paper.rounds == 50 and len(paper.runs()) == 45 + 4 * 5 + 6 * 5 and paper.training.lr == 0.1
    plain = [key for key in paper.runs() if paper.study(key).model.preset == "resnet1d34"]
    assert {key.method for key in plain} == {"FedAvg", "FedProx", "Scaffold", "Scaffold (FedCVD)", "Ditto", "FedALA"}
    assert {key.heads for key in plain} == {"-"} and len(plain) == 6 * 5
    assert paper.preset == "paper" and [s.name for s in paper.sites] == ["sph", "ptbxl", "sxph", "g12ec"]
    with pytest.raises(FileNotFoundError):
        load_experiment("nope")


def test_two_rounds_through_the_service_equal_two_rounds_in_the_runner(coordinator: TestClient, tmp_path: Path) -> None:
    experiment = tiny_experiment(tmp_path, seeds=[7], heads=["6:2"])
    data = load_sites(experiment)
    (key,) = experiment.runs()
    study = experiment.study(key)

    # the service: coordinator + one agent per site, over the HTTP API
    workers = {}
    for name in study.sites:
        headers = enrol(coordinator, name)
        http = httpx.Client(transport=coordinator._transport, base_url=str(coordinator.base_url), headers=headers)
        workers[name] = SiteWorker(
            site=name,
            client=CoordinatorClient(http, poll_wait_s=0.0),
            store=SiteStore(tmp_path / "stores" / name, generate_key(), name),
            data=lambda name=name: data[name],
            runtime=CPU,
            progress_bar=False,
            auto_approve=True,
        )
    created = coordinator.post(
        "/api/v1/studies", json={"name": "equivalence", "config": study.model_dump(mode="json")}, headers=ADMIN
    ).json()
    coordinator.post(f"/api/v1/studies/{created['id']}/start", headers=ADMIN)
    for _ in range(study.rounds + 1):  # two training rounds and the final evaluation
        for worker in workers.values():
            assert worker.poll_once()
    service = {
        t: load(coordinator.get(f"/api/v1/studies/{created['id']}/models/{t}", headers=ADMIN).content)[0]
        for t in (1, 2)
    }

    # the runner: the same study in one process
    outcomes = list(simulate_study(study, data, CPU))
    assert [o.kind for o in outcomes] == ["train", "train", "evaluate"]
    for t in (1, 2):
        ours = outcomes[t - 1].global_model
        assert ours.keys() == service[t].keys()
        different = [n for n in ours if not torch.equal(ours[n], service[t][n])]
        assert not different, f"round {t}: {len(different)} tensors differ, e.g. {different[:3]}"
    rounds = coordinator.get(f"/api/v1/studies/{created['id']}/rounds", headers=ADMIN).json()["data"]
    assert {u["site"]: u["weight"] for u in rounds[0]["updates"]} == outcomes[0].weights
    # and the same reports give the same numbers: per site, and pooled
    records = [o.record(study.model.config().n_classes) for o in outcomes]
    by_number = {r["number"]: r for r in rounds}
    for t, record in enumerate(records, start=1):
        shown = by_number[t]
        assert {u["site"]: u["local_eval"] for u in shown["updates"]} == {
            site: values["local"] for site, values in record["sites"].items()
        }
        assert shown["pooled"]["local_eval"] == record["local"]
        assert shown["pooled"]["train_loss"] == record["train_loss"]
        if t > 1:  # theta^g_{t-1} as the sites evaluated it in round t
            assert by_number[t - 1]["pooled"]["eval"] == record["previous_global"]
    assert records[0]["local"]["n_sites"] == 2 and records[0]["sites"]["site-1"]["local"]["map"] is not None


@pytest.mark.parametrize(
    ("algorithm", "aggregation"),
    [({"name": "scaffold"}, {"name": "samples"}), ({"name": "ditto"}, {"name": "uncertainty"})],
)
def test_runner_runs_other_algorithms(tmp_path: Path, algorithm: dict, aggregation: dict) -> None:
    config = tiny_experiment(
        tmp_path,
        seeds=[0],
        heads=["6:2"],
        methods=[{"label": algorithm["name"], "algorithm": algorithm, "aggregation": aggregation}],
    )
    (key,) = config.runs()
    outcomes = list(simulate_study(config.study(key), load_sites(config), CPU))
    assert [o.kind for o in outcomes] == ["train", "train", "evaluate"]
    assert abs(sum(outcomes[0].weights.values()) - 1.0) < 1e-12
    assert not torch.equal(outcomes[0].global_model["head.weight"], outcomes[1].global_model["head.weight"])


def test_runner_trains_uncertainty_studies_on_the_training_split_less_its_validation_carve(tmp_path: Path) -> None:
    aggregation = {"name": "uncertainty", "params": {"mc_passes": 2, "validation_fraction": 0.25}}
    config = tiny_experiment(
        tmp_path, seeds=[0], heads=["6:2"], methods=[{"label": "uncertain", "aggregation": aggregation}]
    )
    (key,) = config.runs()
    sites = load_sites(config)
    first = next(simulate_study(config.study(key), sites, CPU, evaluate_final=False))
    for site, result in first.results.items():
        n = len(sites[site].train)
        assert result.meta.num_examples == n - round(0.25 * n) < n
        assert result.meta.metrics.model_extra["entropy"] > 0  # type: ignore[index]


@pytest.mark.parametrize(
    "privacy",
    [
        {"min_records": 1, "dp": {"noise_multiplier": 1.1, "clip_norm": 0.05}},
        {
            "min_records": 1,
            "secure_aggregation": {},
            "dp": {"noise_multiplier": 1.1, "clip_norm": 0.05, "mode": "distributed"},
        },
    ],
    ids=["central", "secure-distributed"],
)
def test_a_simulated_dp_study_draws_its_noise_from_its_seed(tmp_path: Path, privacy: dict[str, object]) -> None:
    config = tiny_experiment(tmp_path, synthetic={"sites": 3, "records_per_site": 30, "seed": 5})
    data = load_sites(config)
    base = config.study(config.runs()[0]).model_dump(mode="json")
    study = StudyTerms.model_validate({**base, "aggregation": {"name": "equal"}, "min_sites": 2, "privacy": privacy})

    def released(terms: StudyTerms) -> list[dict[str, torch.Tensor]]:
        return [o.global_model for o in simulate_study(terms, data, CPU, evaluate_final=False)]

    first, again = released(study), released(study)  # OS-keyed noise would differ between the two
    for one, two in zip(first, again, strict=True):
        assert all(torch.equal(one[name], two[name]) for name in one)  # the same noise, to the bit
