"""Learned head assignment measured: the auto-heads configs, gates in the runner's records, the report's claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from cardiofl.experiment.claims import LOWERED, RAISED, WITHIN, compare, learned_claim
from cardiofl.experiment.config import LEARNED, load_experiment
from cardiofl.experiment.grid import run_experiment
from cardiofl.experiment.readings import averaged_learned_heads
from cardiofl.experiment.report import write_report
from cardiofl.experiment.results import effective_heads, read_results
from cardiofl.experiment.runner import load_sites, simulate_study
from shared.algorithms.learned_heads import FROZEN_LOGIT
from shared.algorithms.registry import parsed_params
from shared.model.network import head_ratios, preset
from shared.study.rules import algorithm_model, initial_state, study_exchange
from tests.cardiofl.experiment.test_runner import CPU, tiny_experiment
from tests.site_agent.algorithms.test_learned_heads import CARVE_METHOD

REPO = Path(__file__).resolve().parents[3]
LEARNED_METHOD = {
    "label": "learned heads",
    "algorithm": {"name": "learned_heads", "params": {"freeze_after": 1, **CARVE_METHOD}},
}


def test_auto_heads_configs_expand_to_nine_fixed_splits_and_the_learned_row_over_the_same_seeds() -> None:
    for name in ("auto-heads", "auto-heads-real", "auto-heads-planted", "auto-heads-planted-separated"):
        experiment = load_experiment(name)
        runs = experiment.runs()
        fixed = [key for key in runs if key.method == "FedDualAtt"]
        learned = [key for key in runs if key.method == "learned heads"]
        assert len(experiment.seeds) >= 3 and experiment.preset == "tiny"
        assert [key.heads for key in fixed] == [h for h in head_ratios(8) for _ in experiment.seeds]
        assert [(key.heads, key.seed) for key in learned] == [(LEARNED, seed) for seed in experiment.seeds]
        assert len(runs) == 10 * len(experiment.seeds)
        study = experiment.study(learned[0])
        assert study.algorithm.name == "learned_heads" and parsed_params(study.algorithm).freeze_after is not None
        assert study.model.heads == preset("tiny").heads  # the gated model holds every head in both branches
        assert algorithm_model(study.model, study.algorithm).learned_heads
        assert not algorithm_model(experiment.study(fixed[0]).model, experiment.study(fixed[0]).algorithm).learned_heads
    synthetic, real, cpu_real = (
        load_experiment("auto-heads"),
        load_experiment("auto-heads-real"),
        load_experiment("cpu-real"),
    )
    assert synthetic.synthetic is not None and synthetic.synthetic.sites == 3 and not synthetic.sites
    assert real.sites == cpu_real.sites and real.privacy == cpu_real.privacy  # cpu-real's four sites, 40% test
    assert {source.test_fraction for site in real.sites for source in site.data} == {0.4}
    planted = load_experiment("auto-heads-planted")
    assert planted.planted is not None and planted.planted.local_heads == (0, 0, 8) and not planted.sites
    assert planted.seeds == [3, 4, 5] and planted.with_seeds([0, 1, 2]).runs()[0].seed == 0  # tuned on 0-2
    separated = load_experiment("auto-heads-planted-separated")
    assert separated.planted is not None and separated.planted.sources == 2 and separated.seeds == [3, 4, 5]
    assert separated.planted.local_heads == (0,) * 7 + (8,) and separated.planted.train_records == (40,) * 7 + (16,)
    with pytest.raises(
        FileNotFoundError,
        match="auto-heads, auto-heads-planted, auto-heads-planted-separated, auto-heads-real, cpu, cpu-heterogeneous, "
        "cpu-real, paper",
    ):
        load_experiment("nope")


def test_the_real_config_names_folders_that_exist() -> None:
    ecg = REPO.parent / "shared" / "data" / "ecg"
    if not ecg.is_dir():
        pytest.skip(f"real ECG records not found at {ecg} (the ../shared/data folder is absent)")
    for site in load_experiment("auto-heads-real").sites:
        for source in site.data:
            assert (REPO / source.path).exists(), f"{site.name}: {source.path}"


def test_learned_is_the_split_of_learned_heads_alone(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="belongs to algorithm 'learned_heads'"):
        tiny_experiment(tmp_path, methods=[{**LEARNED_METHOD, "heads": ["6:2"]}])
    with pytest.raises(ValidationError, match="belongs to algorithm 'learned_heads'"):
        tiny_experiment(tmp_path, methods=[{"label": "FedDualAtt", "heads": [LEARNED]}])
    with pytest.raises(ValidationError, match="not the experiment's"):
        tiny_experiment(tmp_path, heads=[LEARNED])
    experiment = tiny_experiment(tmp_path, methods=[{**LEARNED_METHOD, "heads": [LEARNED]}], seeds=[0])
    assert [key.id for key in experiment.runs()] == ["learned heads|learned|0"]


def test_the_runner_records_each_sites_gates_for_learned_runs_only(tmp_path: Path) -> None:
    experiment = tiny_experiment(
        tmp_path,
        heads=["8:0"],
        seeds=[0],
        synthetic={"sites": 2, "records_per_site": 20, "seed": 5},
        training={"optimizer": "adam", "lr": 0.003, "batch_size": 8, "max_steps": 1},
        methods=[{"label": "FedDualAtt"}, LEARNED_METHOD],
        privacy={"min_records": 3},
    )
    fixed, learned = experiment.runs()
    data = load_sites(experiment)
    outcomes = list(simulate_study(experiment.study(fixed), data, CPU, evaluate_final=False))
    assert all(o.gates == {} for o in outcomes)
    assert all("gates" not in values for o in outcomes for values in o.record(20)["sites"].values())

    results = tmp_path / "results.jsonl"
    run_experiment(experiment.model_copy(update={"methods": experiment.methods[1:]}), results, runtime=CPU)
    records = [json.loads(line) for line in results.read_text().splitlines()]
    rounds = [r for r in records if r["type"] == "round"]
    assert [r["kind"] for r in rounds] == ["train", "train", "evaluate"]
    config = algorithm_model(experiment.study(learned).model, experiment.study(learned).algorithm)
    for record in rounds[:2]:
        for values in record["sites"].values():
            gates = torch.tensor(values["gates"])
            assert gates.shape == (config.n_blocks, config.n_heads) and bool(((gates >= 0) & (gates <= 1)).all())
    soft = torch.tensor(rounds[0]["sites"]["site-1"]["gates"])
    assert bool(((soft > 0) & (soft < 1)).all())  # round 1: trained from 1/2, not yet frozen
    hard = torch.tensor(rounds[1]["sites"]["site-1"]["gates"])
    assert bool(((hard == 0) | (hard == 1)).all())  # frozen after one trained round
    assert torch.equal(hard, (soft >= 0.5).float())  # each gate hardened toward its nearer end
    assert all("gates" not in values for values in rounds[2]["sites"].values())  # the evaluation round trains none
    (run,) = read_results(results)
    assert [t for t, _ in run.gate_curves["site-2"]] == [1, 2]
    assert effective_heads([run])[("learned heads", "site-1")] == [(float(b.sum()), 0.0) for b in hard]


# (method, heads) -> per seed: (site-a F1, site-b F1, Global F1), fractions
Grid = dict[tuple[str, str], list[tuple[float, float, float]]]

# the learned run's gates per seed: block 0 keeps 2 (seed 0) or 4 (seed 1) heads local at site a
GATES = {
    "a": [[[1, 1, 0, 0, 0, 0, 0, 0], [0.5] * 8], [[1, 1, 1, 1, 0, 0, 0, 0], [0.5] * 8]],
    "b": [[[0] * 8, [1] * 8], [[0] * 8, [1] * 8]],
}


def results_file(path: Path, grid: Grid) -> Path:
    """A results file of finished runs with these final F1s; learned runs also have a training round with gates."""
    lines = []
    for (method, heads), seeds in grid.items():
        for seed, (a, b, pooled) in enumerate(seeds):
            run, attempt = f"{method}|{heads}|{seed}", f"{method}-{heads}-{seed}"
            common = {"type": "round", "run": run, "attempt": attempt, "method": method, "heads": heads, "seed": seed}
            if heads == LEARNED:
                sites = {name: {"local": None, "previous_global": None, "gates": GATES[name][seed]} for name in "ab"}
                lines.append(json.dumps({**common, "round": 1, "kind": "train", "sites": sites, "previous_global": {}}))
            sites = {
                name: {"local": {"micro_f1": f1, "map": f1}, "previous_global": {}}
                for name, f1 in zip("ab", (a, b), strict=True)
            }
            final = {**common, "round": 2, "kind": "evaluate", "sites": sites, "site_order": ["a", "b"]}
            final["previous_global"], final["global_readings"] = {"micro_f1": pooled, "map": pooled}, {}
            lines += [json.dumps(final), json.dumps({"type": "run_done", "run": run, "attempt": attempt})]
    path.write_text("\n".join(lines) + "\n")
    return path


FIXED: Grid = {
    ("FedDualAtt", "8:0"): [(0.40, 0.50, 0.60), (0.42, 0.50, 0.62)],  # Global 61.0±1.4
    ("FedDualAtt", "4:4"): [(0.50, 0.51, 0.55), (0.52, 0.49, 0.57)],  # a's best: 51.0±1.4
    ("FedDualAtt", "0:8"): [(0.48, 0.60, 0.30), (0.50, 0.62, 0.32)],  # b's best: 61.0±1.4
}


def test_the_claim_holds_within_the_spread(tmp_path: Path) -> None:
    grid = {**FIXED, ("learned heads", LEARNED): [(0.49, 0.60, 0.60), (0.51, 0.64, 0.61)]}
    written = write_report(results_file(tmp_path / "results.jsonl", grid), tmp_path / "report")
    table = written["table.md"].read_text()
    assert "| learned heads | learned |" in table
    claim = table.split("## Learned head assignment: the claim", 1)[1]
    assert "### learned heads against FedDualAtt's fixed splits (micro-F1 %, mean±std over 2 seeds)" in claim
    assert compare((50.0, 1.4), (51.0, 1.4)) == (-1.0, WITHIN)
    assert "- a: holds (within the seeds' spread of the best fixed split 4:4). learned 50.0±1.4, " in claim
    assert "best fixed 4:4 51.0±1.4 (−1.0 pp, within spread); learned is above" in claim
    assert "- b: holds (within the seeds' spread of the best fixed split 0:8). learned 62.0±2.8" in claim
    assert "- Global: holds (within the seeds' spread of 8:0). learned 60.5±0.7, 8:0 61.0±1.4 (−0.5 pp" in claim
    assert "learned is above 2 of 3 fixed splits." in claim
    assert "the claim holds at 2 of 2 sites judged; Global: holds. Overall: the claim holds." in claim
    assert "## The paper's direction (Fig. 2)" in table  # the fixed method's check, undisturbed by the learned row
    assert written["gates.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_claim_fails_outside_the_spread_and_says_so(tmp_path: Path) -> None:
    grid = {**FIXED, ("learned heads", LEARNED): [(0.60, 0.30, 0.40), (0.62, 0.32, 0.41)]}
    runs = read_results(results_file(tmp_path / "results.jsonl", grid))
    claim = learned_claim(runs)
    assert compare((31.0, 1.4), (61.0, 1.4)) == (-30.0, LOWERED) and compare((61.0, 1.4), (51.0, 1.4))[1] == RAISED
    assert "- a: holds (above the best fixed split 4:4, beyond the spread). learned 61.0±1.4" in claim
    assert "- b: fails (below the best fixed split 0:8, beyond the spread). learned 31.0±1.4" in claim
    assert "(−30.0 pp, lowered)" in claim
    assert "- Global: fails (below 8:0, beyond the spread). learned 40.5±0.7, 8:0 61.0±1.4 (−20.5 pp, lowered)" in claim
    assert "learned is above 3 of 3 fixed splits." in claim and "learned is above 0 of 3 fixed splits." in claim
    assert "the claim holds at 1 of 2 sites judged; Global: fails. Overall: the claim does not hold." in claim


def test_effective_heads_sum_each_blocks_gates_over_seeds(tmp_path: Path) -> None:
    grid = {**FIXED, ("learned heads", LEARNED): [(0.49, 0.60, 0.60), (0.51, 0.64, 0.61)]}
    runs = read_results(results_file(tmp_path / "results.jsonl", grid))
    effective = effective_heads(runs)
    assert set(effective) == {("learned heads", "a"), ("learned heads", "b")}
    (a0_mean, a0_std), a1 = effective[("learned heads", "a")]
    assert a0_mean == 3.0 and abs(a0_std - 2**0.5) < 1e-12 and a1 == (4.0, 0.0)
    assert effective[("learned heads", "b")] == [(0.0, 0.0), (8.0, 0.0)]
    table = write_report(tmp_path / "results.jsonl", tmp_path / "report")["table.md"].read_text()
    assert "| learned heads | a | 3.00±1.41 | 4.00±0.00 | 0 of 2 seeds | 0.500 |" in table
    assert "| learned heads | b | 0.00±0.00 | 8.00±0.00 | 2 of 2 seeds | – |" in table
    assert "| hard gates at the end | farthest soft gate from ½ |" in table


def test_a_report_without_learned_runs_has_no_gates(tmp_path: Path) -> None:
    written = write_report(results_file(tmp_path / "results.jsonl", FIXED), tmp_path / "report")
    assert "gates.png" not in written and not (tmp_path / "report" / "gates.png").exists()
    assert "Learned head assignment" not in written["table.md"].read_text()
    assert learned_claim(read_results(tmp_path / "results.jsonl")) == ""


def test_the_phi_k_averaged_reading_averages_gates_not_their_logits(tmp_path: Path) -> None:
    experiment = tiny_experiment(tmp_path, methods=[LEARNED_METHOD], seeds=[0])
    (key,) = experiment.runs()
    study = experiment.study(key)
    config = algorithm_model(study.model, study.algorithm)
    exchange = study_exchange(study)
    names = exchange.partition.local
    generator = torch.Generator().manual_seed(0)
    private = {site: {n: torch.randn(exchange.schema[n].shape, generator=generator) for n in names} for site in "ab"}
    hard = torch.full((config.n_heads,), -FROZEN_LOGIT)
    hard[:3] = FROZEN_LOGIT  # site a keeps heads 0-2 local
    private["a"]["blocks.0.head_gate"], private["b"]["blocks.0.head_gate"] = hard, torch.full_like(hard, -FROZEN_LOGIT)
    private["a"]["blocks.1.head_gate"] = private["b"]["blocks.1.head_gate"] = torch.zeros(config.n_heads)
    weights = {"a": 0.25, "b": 0.75}

    averaged = averaged_learned_heads(study, private, weights, names)

    g0 = torch.sigmoid(averaged["blocks.0.head_gate"].double())
    torch.testing.assert_close(g0[:3], torch.full((3,), 0.25, dtype=torch.float64))  # a's share, not a vote
    assert bool((g0[3:] == 0).all())  # no site keeps heads 3-7 local: global
    torch.testing.assert_close(averaged["blocks.1.head_gate"], torch.zeros(config.n_heads))  # g = 1/2 everywhere
    E, weight = config.head_dim, "blocks.0.local_branch.out_proj.weight"
    torch.testing.assert_close(averaged[weight][:, : 3 * E], private["a"][weight][:, : 3 * E])  # a's own heads
    _, phi_0 = initial_state(study)
    torch.testing.assert_close(averaged[weight][:, 3 * E :], phi_0[weight][:, 3 * E :])  # kept local by none


def test_on_planted_sites_the_claim_says_whether_each_sites_local_heads_are_its_planted_ones(tmp_path: Path) -> None:
    grid = {**FIXED, ("learned heads", LEARNED): [(0.49, 0.60, 0.60), (0.51, 0.64, 0.61)]}
    path = results_file(tmp_path / "results.jsonl", grid)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if record["type"] == "round":
            record["planted_local_heads"] = {"a": 3, "b": 8}
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")

    claim = learned_claim(read_results(path))

    assert "### learned heads: effective local heads against the planted H_l (within 1 head)" in claim
    assert (
        "- a: holds. planted H_l 3; mean effective local heads per block 3.00, 4.00; within 1 head in 4 of 4" in claim
    )
    assert (
        "- b: fails. planted H_l 8; mean effective local heads per block 0.00, 8.00; within 1 head in 2 of 4" in claim
    )
    assert "Planted H_l recovered at 1 of 2 sites." in claim
    assert "effective local heads against the planted" not in learned_claim(read_results(results_file(path, grid)))
